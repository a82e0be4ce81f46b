"""Route MoE tokens by an imbalance model, through megatron-core's own router-replay hook.

megatron-core's `TopKRouter` asks `router.router_replay.get_replay_topk(scores, topk, ...)` for the
top-k expert indices when a replay object is set (its routing-replay feature); the probabilities are
the router's scores gathered at those indices, so gradients still reach the router and the aux loss
is computed as usual. `ModelledTopk` is such an object: for each call it takes the counts the
imbalance model gives for (layer, microbatch, iteration, this rank) and turns them into a routing map
with exactly those counts (moe/imbalance.py). Every rank, sandbox or slice, routes its own tokens by
the same function, so a job's routing is one thing, known everywhere.

The k-th forward call of a router in the run is microbatch k mod M of iteration k div M (M the
microbatches per iteration). Activation recomputation of MoE layers would call the router again in
backward; it is not supported (the counts would advance) and is refused.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from prism_megatron.moe.imbalance import Imbalance, routing_map


class ModelledTopk:
    """A `router_replay` for one TopKRouter: top-k indices from the imbalance model."""

    def __init__(self, model: Imbalance, layer: int, source_rank: Callable[[], int],
                 microbatches: Callable[[], int]) -> None:
        self.model, self.layer = model, layer
        self._source, self._microbatches = source_rank, microbatches
        self.calls = 0
        self.last_counts: Optional[np.ndarray] = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None, default_compute_topk=None):
        if group_topk:
            raise ValueError("moe.imbalance with group-limited routing (moe_router_group_topk) is not "
                             "supported; use moe.imbalance=none for this model")
        tokens, experts = scores.shape
        m = max(1, self._microbatches())
        iteration, microbatch = divmod(self.calls, m)
        self.calls += 1
        counts = self.model.counts(experts=experts, tokens=tokens, topk=topk, layer=self.layer,
                                   microbatch=microbatch, iteration=iteration, source=self._source())
        self.last_counts = counts
        rmap = routing_map(counts, tokens, topk)
        indices = torch.from_numpy(np.nonzero(rmap)[1].reshape(tokens, topk)).to(scores.device)
        return scores.gather(1, indices), indices


def attach(model: torch.nn.Module, imbalance: Imbalance, source_rank: Callable[[], int],
           microbatches: Callable[[], int]) -> list[ModelledTopk]:
    """Give every TopKRouter of `model` a ModelledTopk; returns them."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            if getattr(module.config, "recompute_granularity", None) and "moe" in (
                    getattr(module.config, "recompute_modules", None) or []):
                raise ValueError("moe.imbalance with MoE activation recomputation is not supported")
            layer = int(getattr(module, "layer_number", None) or 0)
            module.router_replay = ModelledTopk(imbalance, layer, source_rank, microbatches)
            out.append(module.router_replay)
    return out
