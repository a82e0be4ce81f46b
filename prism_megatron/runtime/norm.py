"""A torch LayerNorm/RMSNorm that megatron-core accepts under sequence parallelism, for CPU runs.

megatron-core's `WrappedTorchNorm` (the fallback without apex/Transformer Engine) refuses
`sequence_parallel`. Under sequence parallelism each tensor-parallel rank normalizes its own slice of
the sequence, so the norm itself is unchanged; what differs is that its weight gradients are partial and
must be summed over the tensor-parallel group. Megatron does that in `finalize_model_grads` for every
parameter carrying `sequence_parallel = True`, which is the attribute apex's FusedLayerNorm sets; this
norm sets the same attribute and is otherwise plain torch.
"""

from __future__ import annotations

import torch

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelTorchNorm:
    """Factory with WrappedTorchNorm's signature; returns a torch norm module."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        kind = config.normalization
        if kind not in _NORMS or config.layernorm_zero_centered_gamma:
            raise ValueError(f"normalization {kind!r} (zero-centered gamma: "
                             f"{config.layernorm_zero_centered_gamma}) is not available on CPU; "
                             "use LayerNorm or RMSNorm without zero-centered gamma")
        norm = _NORMS[kind](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
