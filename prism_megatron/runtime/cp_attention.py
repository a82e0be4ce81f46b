"""Context-parallel core attention for megatron-core's local spec (CPU runs without Transformer Engine).

megatron-core's local `DotProductAttention` refuses context parallelism; only Transformer Engine's
attention implements it. This subclass adds it the way TE's `cp_comm_type="all_gather"` does: each
context-parallel rank all-gathers K and V over the CP group (the backward pass reduce-scatters their
gradients) and attends its local queries to the whole sequence under the causal mask.

Sequence layout is megatron's load-balanced one (`get_batch_on_this_cp_rank`): the sequence is cut
into 2*cp chunks and CP rank r holds chunks r and 2*cp-1-r, so the causal mask is built from the
global position of every query and key row. With cp == 1 it is exactly megatron's DotProductAttention.

Known limits: causal self-attention only (what GPT uses); no packed sequences, attention bias or
sliding windows under CP; the communication pattern is TE's all-gather variant, not its p2p ring.
"""

from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention


def global_positions(cp_rank: int, cp_size: int, chunk: int, device=None) -> torch.Tensor:
    """Global sequence positions of the rows a CP rank holds (its chunks r and 2*cp-1-r)."""
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


class ContextParallelDotProductAttention(DotProductAttention):
    """megatron's DotProductAttention plus context parallelism by all-gathered K/V."""

    def __init__(self, config, *args, **kwargs):
        # The parent asserts cp == 1; build it from a copy that says so, then keep the real config.
        plain = copy.copy(config)
        plain.context_parallel_size = 1
        super().__init__(plain, *args, **kwargs)
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        cp_size = self.config.context_parallel_size
        if cp_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("context-parallel attention on CPU supports neither packed sequences "
                             "nor attention bias; use Transformer Engine")
        group = parallel_state.get_context_parallel_group()
        cp_rank = parallel_state.get_context_parallel_rank()
        # [s/cp, b, ng, hn] -> [s, b, ng, hn], rank-major; gradients are reduce-scattered back.
        key = gather_from_sequence_parallel_region(key, True, group)
        value = gather_from_sequence_parallel_region(value, True, group)
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        sq, b, heads, _ = query.shape
        chunk = sq // 2
        q_pos = global_positions(cp_rank, cp_size, chunk, query.device)
        k_pos = torch.cat([global_positions(r, cp_size, chunk, query.device) for r in range(cp_size)])
        masked = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [sq, sk]: a key after the query
        # [b, np, sq, hn] x [b, np, hn, sk] -> [b, np, sq, sk]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 3, 0)
        scores = torch.matmul(q, k) * self.softmax_scale
        scores = scores.float() if self.config.attention_softmax_in_fp32 else scores
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        probs = self.attention_dropout(probs)
        context = torch.matmul(probs, value.permute(1, 2, 0, 3))  # [b, np, sq, hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)
