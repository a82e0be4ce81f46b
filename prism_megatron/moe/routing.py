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

import math
from typing import Callable, Optional

import numpy as np
import torch

from prism_megatron.moe.imbalance import Imbalance, routing_map


class RoutingState:
    """What this process's routers last decided, shared by them; and the ghost-data provider that
    gives a ghost's token counts in the dispatcher's count exchange.

    megatron's all-to-all dispatcher all-gathers each rank's tokens per expert (a long tensor of
    `experts` entries) over the TP x EP group right after routing. A ghost's slot there is filled with
    what the model gives for the ghost as source, so the sandbox's output splits, the tokens its
    experts receive and the memory they allocate are those of the modelled routing."""

    def __init__(self, model: Imbalance, capacity_factor: Optional[float] = None) -> None:
        self.model = model
        self.capacity_factor = capacity_factor  # model.moe_expert_capacity_factor: megatron drops
        self.last: Optional[dict] = None  # keyword arguments of the latest counts() call
        self.capacity_exchange: Optional[dict] = None  # a DeepSpeed dropless gate's pending exchange
        self.offer: Optional[Callable[[Optional[torch.Tensor]], None]] = None
        """Where a router call hands the ghosts' row ahead of the count all-gather (the native
        session's `offer_row`): a model whose counts do not depend on the sending rank gives every
        ghost the same row, so the backend fills the gather's ghost slots itself, without calling
        `provide` under the interpreter lock for each gather."""

    def route(self, key: dict, device: torch.device) -> None:
        """Record a router call's arguments (`last`) and offer the ghosts' row for its gather."""
        self.last = key
        if self.offer is None:
            return
        if self.model.depends_on_source:
            self.offer(None)  # one row per ghost: `provide` answers
            return
        row = torch.from_numpy(np.ascontiguousarray(self._kept(self.model.counts(**key, source=0))))
        self.offer(row.pin_memory() if device.type == "cuda" else row)

    def provide(self, op: str, members: tuple[int, ...], ghosts: list[int],
                like: torch.Tensor) -> Optional[np.ndarray]:
        """The ghosts' tokens per local expert for the dispatcher's all-gather of counts (one row per
        ghost), or None for any other operation. A model whose counts do not depend on the sending
        rank draws them once for all the ghosts."""
        last = self.last
        if op != "all_gather" or last is None or like.dtype != torch.long or like.numel() != last["experts"]:
            return None
        if self.model.depends_on_source:
            rows = np.stack([self.model.counts(**last, source=g) for g in ghosts])
        else:
            rows = np.broadcast_to(self.model.counts(**last, source=ghosts[0]), (len(ghosts), last["experts"]))
        return self._kept(rows)

    def _kept(self, rows: np.ndarray) -> np.ndarray:
        """What megatron keeps of `rows` (loads per expert) under a capacity: min(load, capacity)."""
        if self.capacity_factor is None:
            return rows
        t, k, e = self.last["tokens"], self.last["topk"], self.last["experts"]
        capacity = math.ceil(t * k / e * self.capacity_factor)
        return np.minimum(rows, capacity) if capacity < t else rows


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a host tensor `src`, without making the host wait for the device: a copy
    from pageable memory into a GPU tensor first waits for the stream to drain (a synchronize a real
    rank's router does not make), so on GPU `src` is pinned and copied asynchronously."""
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


class ModelledTopk:
    """A `router_replay` for one TopKRouter: top-k indices from the imbalance model."""

    def __init__(self, state: RoutingState, layer: int, source_rank: Callable[[], int],
                 microbatches: Callable[[], int]) -> None:
        self.state, self.model, self.layer = state, state.model, layer
        self._source, self._microbatches = source_rank, microbatches
        self.calls = 0
        self.last_counts: Optional[np.ndarray] = None
        self.last_indices: Optional[torch.Tensor] = None  # [tokens, topk], a real tensor

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None, default_compute_topk=None):
        if group_topk:
            raise ValueError("moe.imbalance with group-limited routing (moe_router_group_topk) is not "
                             "supported; use moe.imbalance=none for this model")
        tokens, experts = scores.shape
        m = max(1, self._microbatches())
        iteration, microbatch = divmod(self.calls, m)
        self.calls += 1
        key = dict(experts=experts, tokens=tokens, topk=topk, layer=self.layer, microbatch=microbatch,
                   iteration=iteration)
        self.state.route(key, scores.device)
        counts = self.model.counts(**key, source=self._source())
        self.last_counts = counts
        rmap = routing_map(counts, tokens, topk)
        chosen = torch.from_numpy(np.nonzero(rmap)[1].reshape(tokens, topk))
        if scores.device.type == "cpu":
            indices = chosen
        else:  # a router's top-k does not make the host wait for the device
            indices = torch.empty(chosen.shape, dtype=chosen.dtype, device=scores.device)
            copy_from_host(indices, chosen)
        self.last_indices = indices
        return scores.gather(1, indices), indices


def attach(model: torch.nn.Module, state: RoutingState, source_rank: Callable[[], int],
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
            module.router_replay = ModelledTopk(state, layer, source_rank, microbatches)
            out.append(module.router_replay)
    return out
