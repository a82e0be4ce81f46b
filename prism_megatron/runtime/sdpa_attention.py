"""Fused core attention for megatron-core's local spec: torch's scaled_dot_product_attention.

Production jobs do not build the score matrix: they run FlashAttention or cuDNN's fused attention
(Transformer Engine's `flash` and `fused` backends). Without Transformer Engine megatron-core has only
its unfused `DotProductAttention`. `LocalCoreAttention` is what the local spec builds as core attention
here (runtime/local_specs.py puts it where megatron's local spec provider looks): it reads megatron's
own `config.attention_backend`, so a Megatron-LM script's `--attention-backend` and our
`model.attention_backend` choose the same way:

- `flash`: `SdpaAttention` restricted to torch's FlashAttention-2 kernel;
- `fused`: restricted to torch's cuDNN attention kernel (what TE's fused attention calls);
- `local`, `unfused`, `auto`: megatron's `DotProductAttention` (auto is what megatron-core chooses
  without TE: the local one), with context parallelism (runtime/cp_attention.py).

`SdpaAttention` takes megatron's [s, b, heads, dim] layout, hands torch [b, heads, s, dim] views
(grouped-query attention natively: `enable_gqa`, no repeated K/V), the causal mask as `is_causal`,
megatron's softmax scale and the attention dropout. Under context parallelism it all-gathers K/V over
the CP group as the local CP attention does and masks by global positions (then flash cannot take the
mask and torch picks another fused kernel). On a CPU (and under fake execution) torch runs its CPU flash
kernel, whose op the kernel-cost model prices as the GPU kernel of the configured backend
(kernels/attention.py).

Known limits: no packed sequences, attention bias or sliding windows (megatron's local attention has
none either).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnBackend, AttnMaskType

from prism_megatron.runtime.cp_attention import ContextParallelDotProductAttention, global_positions

SDPA_BACKENDS = {AttnBackend.flash: "FLASH_ATTENTION", AttnBackend.fused: "CUDNN_ATTENTION"}
"""megatron's attention backend -> the torch SDPA backend it is restricted to."""


def _kernel_choice(backend: str, device_type: str):
    """The context that restricts SDPA to `backend` on a GPU (on a CPU torch has one fused kernel)."""
    if device_type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend)])


class SdpaAttention(ContextParallelDotProductAttention):
    """Core attention by `torch.nn.functional.scaled_dot_product_attention` (module docstring)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.sdpa_backend = SDPA_BACKENDS[config.attention_backend]

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("fused attention of the local spec supports neither packed sequences "
                             "nor attention bias; use Transformer Engine")
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        cp_size = self.config.context_parallel_size
        explicit = None
        if cp_size > 1:
            group = parallel_state.get_context_parallel_group()
            cp_rank = parallel_state.get_context_parallel_rank()
            key = gather_from_sequence_parallel_region(key, True, group)
            value = gather_from_sequence_parallel_region(value, True, group)
            chunk = query.shape[0] // 2
            q_pos = global_positions(cp_rank, cp_size, chunk, query.device)
            k_pos = torch.cat([global_positions(r, cp_size, chunk, query.device) for r in range(cp_size)])
            explicit = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # True: attend
            causal = False
        elif attention_mask is not None and not causal:
            explicit = ~attention_mask  # megatron's mask is True where a score is masked out
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        dropout = self.attention_dropout.p if self.training else 0.0
        with _kernel_choice(self.sdpa_backend, query.device.type):
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=explicit, dropout_p=dropout, is_causal=causal,
                scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        # [b, heads, sq, dim] -> [sq, b, heads * dim]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


class LocalCoreAttention:
    """Factory with DotProductAttention's signature: the core attention megatron's
    `config.attention_backend` asks for (module docstring)."""

    def __new__(cls, config, *args, **kwargs):
        if config.attention_backend in SDPA_BACKENDS:
            return SdpaAttention(config, *args, **kwargs)
        return ContextParallelDotProductAttention(config, *args, **kwargs)
