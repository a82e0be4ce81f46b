"""DeepSpeed-MoE routed by an imbalance model, and its per-layer load log.

DeepSpeed's `TopKGate` computes the router's logits and hands them to one of three gating functions
of `deepspeed.moe.sharded_moe` (`top1gating`, `top2gating`, `topkgating`), which pick the experts,
apply the capacity (dropping what exceeds it, or with `drop_tokens=False` raising the capacity to the
largest expert load in the expert-parallel group: an all-reduce MAX) and build the dispatch. Nothing
there is replaced. `SteeredGate` only shifts the logits first: the assignments the imbalance model
gives for (layer, microbatch, iteration, this rank) get a routing map (moe/imbalance.py), and the
chosen experts of each token are lifted above every other by the row's logit range plus a margin
(40: top-2's Gumbel sampling of the second expert cannot undo it). So DeepSpeed's own selection picks
exactly the modelled experts, the chosen experts keep their relative logits (the gate values among
them and their gradients are the router's), and capacity, dropping and the aux loss are DeepSpeed's.

With ghosts in the expert-parallel group, the dropless capacity exchange is answered from the model:
`capacity_part` gives the ghosts' largest load for the same call (session.ghost_reductions), so the
sandbox's buffers have the size the real job's would, which is where imbalance costs memory.

The k-th call of a gate is microbatch k mod M of iteration k div M (M: the engine's gradient
accumulation steps). Layers are numbered 1, 2, ... in module order, as each rank builds its model.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import numpy as np
import torch

from prism_megatron.moe.imbalance import routing_map

MARGIN = 40.0
GATING_FUNCTIONS = ("top1gating", "top2gating", "topkgating")


class SteeredGate:
    """One TopKGate's modelled routing (see the module docstring)."""

    def __init__(self, gate: Any, state: Any, layer: int, source_rank: Callable[[], int],
                 microbatches: Callable[[], int]) -> None:
        self.gate, self.state, self.layer = gate, state, layer
        self._source, self._microbatches = source_rank, microbatches
        self.calls = 0
        self.last_counts: Optional[np.ndarray] = None

    def steer(self, logits: torch.Tensor) -> torch.Tensor:
        tokens, experts = logits.shape
        topk = int(self.gate.k)
        iteration, microbatch = divmod(self.calls, max(1, self._microbatches()))
        self.calls += 1
        key = dict(experts=experts, tokens=tokens, topk=topk, layer=self.layer, microbatch=microbatch,
                   iteration=iteration)
        self.state.last = key
        # DeepSpeed's dropless gate exchanges the capacity (all-reduce MAX) right after selecting:
        # that one operation, and no later one, is answered for ghosts from the model
        self.state.capacity_exchange = None if self.gate.drop_tokens else key
        counts = self.state.model.counts(**key, source=self._source())
        self.last_counts = counts
        chosen = torch.from_numpy(routing_map(counts, tokens, topk)).to(logits.device)
        with torch.no_grad():
            lift = logits.amax(dim=1) - logits.amin(dim=1) + MARGIN
        return logits + chosen.to(logits.dtype) * lift.unsqueeze(1)


class DeepSpeedRouting:
    """An installation's steered gates: the gating functions of deepspeed.moe.sharded_moe patched
    once to shift the logits of the gate that is running, and the capacity provider registered once."""

    def __init__(self, inst: Any) -> None:
        from deepspeed.moe import sharded_moe

        self.inst, self.state = inst, inst.routing
        self.running: list[SteeredGate] = []
        self.gates: list[SteeredGate] = []
        for name in GATING_FUNCTIONS:
            inst.patch(sharded_moe, name, _steering(getattr(sharded_moe, name), self.running))
        session = getattr(inst, "session", None)
        if session is not None:
            session.ghost_reductions.append(functools.partial(capacity_part, self.state))

    def attach(self, model: torch.nn.Module, source_rank: Callable[[], int],
               microbatches: Callable[[], int]) -> list[SteeredGate]:
        """Route every TopKGate of `model` by the routing model; returns their SteeredGates."""
        from deepspeed.moe import sharded_moe

        steered = []
        gates = [m for m in model.modules() if isinstance(m, sharded_moe.TopKGate)]
        for layer, gate in enumerate(gates, start=1):
            s = SteeredGate(gate, self.state, layer, source_rank, microbatches)
            original = gate.forward

            @functools.wraps(original)
            def forward(*args, _s=s, _original=original, **kwargs):
                self.running.append(_s)
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.running.pop()

            gate.forward = forward
            self.inst._exits.append(functools.partial(_restore_forward, gate))
            steered.append(s)
        self.gates += steered
        return steered


def _steering(original: Callable, running: list) -> Callable:
    @functools.wraps(original)
    def gating(logits, *args, **kwargs):
        if running:
            logits = running[-1].steer(logits)
        return original(logits, *args, **kwargs)
    return gating


def _restore_forward(gate: Any) -> None:
    gate.__dict__.pop("forward", None)


def capacity_part(state: Any, op: str, members: tuple[int, ...], ghosts: list[int], tensor: torch.Tensor,
                  reduce_op: Any) -> Optional[torch.Tensor]:
    """The ghosts' part of DeepSpeed's dropless capacity exchange (an all-reduce MAX of one integer,
    the largest expert load of a rank's tokens, right after a steered gate's selection): the largest
    modelled load over the ghosts as sources, for the same call."""
    from torch.distributed import ReduceOp

    key = state.capacity_exchange
    if (op != "all_reduce" or reduce_op != ReduceOp.MAX or key is None or tensor.numel() != 1
            or tensor.dtype not in (torch.int64, torch.int32)):
        return None
    state.capacity_exchange = None
    loads = [int(state.model.counts(**key, source=g).max()) for g in ghosts]
    return torch.tensor(max(loads), dtype=tensor.dtype)


def attach_load_log(log: Any, model: torch.nn.Module, gates: list[SteeredGate]) -> list[Any]:
    """Hook `log` (a moe/loadlog.MoeLoadLog) on every DeepSpeed MOELayer of `model`: the gate's output
    gives this rank's assignments per expert (before dropping), the kept ones and the capacity; the
    experts' input gives the tokens each local expert receives. With a routing model, that is the sum
    over the expert-parallel group's sources of min(load, capacity) (what DeepSpeed keeps per source
    and expert), so ghosts' tokens count as modelled; without one, the non-empty rows of the experts'
    padded input (exact when every peer is real)."""
    import torch.distributed as dist
    from deepspeed.moe.sharded_moe import MOELayer

    steered = {id(s.gate): s for s in gates}
    handles = []
    layers = [m for m in model.modules() if isinstance(m, MOELayer)]
    for layer, moe in enumerate(layers, start=1):
        ep_rank = dist.get_rank(group=moe.ep_group) if moe.ep_group is not None else 0
        local = [ep_rank * moe.num_local_experts + i for i in range(moe.num_local_experts)]
        members = (dist.get_process_group_ranks(moe.ep_group) if moe.ep_group is not None
                   else [dist.get_rank()])
        handles.append(moe.gate.register_forward_hook(
            _on_gate(log, layer, int(moe.gate.k), local, members, steered.get(id(moe.gate)))))
        handles.append(moe.experts.register_forward_pre_hook(_on_experts(log, layer)))
        handles.append(moe.register_forward_hook(log._on_layer_end(layer, local), always_call=True))
    return handles


def _on_gate(log: Any, layer: int, topk: int, local: list[int], members: list[int],
             steered: Optional[SteeredGate]):
    def hook(mod, args, output):
        indices, exp_counts, capacity = output[3], output[-1], int(output[1])
        routed = int(exp_counts.sum())
        kept = int((indices >= 0).sum())
        pending = log._pending.setdefault(layer, {})
        pending.update(routed=routed, dropped=routed - kept,
                       routed_per_expert=[int(x) for x in exp_counts.tolist()], capacity=capacity)
        if steered is not None and steered.state.last is not None:
            key = steered.state.last
            loads = np.stack([steered.state.model.counts(**key, source=r) for r in members])
            pending["tokens"] = [int(x) for x in np.minimum(loads[:, local], capacity).sum(axis=0)]
    return hook


def _on_experts(log: Any, layer: int):
    def hook(mod, args):
        pending = log._pending.setdefault(layer, {})
        if "tokens" in pending or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]  # [ep, local experts, capacity, hidden], zero rows are padding
        filled = (x.detach() != 0).any(dim=-1).sum(dim=(0, 2))
        pending["tokens"] = [int(t) for t in filled.tolist()]
    return hook
