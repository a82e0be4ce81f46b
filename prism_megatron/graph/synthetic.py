"""Synthetic execution graphs of a known shape, for tests and benchmarks that need no capture.

`synthetic_graph` builds, for every role of a world, a 1F1B-shaped iteration: per microbatch a forward
(recv from the previous stage, attention, tensor-parallel all-reduce, MLP, send to the next stage),
then the backwards (recv from the next stage, MLP backward, send to the previous), then one
data-parallel gradient all-reduce and, if asked, an optimizer step after it. Durations are nominal
(1 ms compute, 0.1 ms communication).
"""

from __future__ import annotations

from prism_megatron.graph.model import ExecutionGraph, RoleGraphBuilder, StringTable
from prism_megatron.world import VirtualWorld


def synthetic_graph(world: VirtualWorld, microbatches: int = 2, tp_bytes: int = 4096,
                    pp_bytes: int = 8192, optimizer_s: float = 0.0) -> ExecutionGraph:
    """A 1F1B-shaped graph: per microbatch forward (TP all-reduce, send to the next stage), backward
    (recv from the next stage, send to the previous), then a data-parallel all-reduce and, with
    `optimizer_s` > 0, an optimizer step of that length."""
    strings = StringTable()
    roles = {}
    for role in world.roles():
        rank = world.representative(role)
        b = RoleGraphBuilder(role, rank, strings)
        t, last, seqs = 0.0, None, {}

        def seq(dim):
            seqs[dim] = seqs.get(dim, -1) + 1
            return seqs[dim]

        def node(kind, *args, duration_s=1e-3, **kw):
            nonlocal t, last
            deps = [last] if last is not None else []
            n = (b.compute(*args, stream="compute", start_s=t, duration_s=duration_s, deps=deps, **kw)
                 if kind == "compute" else
                 b.comm(*args, stream="comm", start_s=t, duration_s=1e-4, deps=deps, **kw))
            t, last = t + 1e-3, n

        stages = world.pp
        for _ in range(microbatches):
            if role.pp > 0:
                node("comm", "recv", dim="pp", nbytes=pp_bytes, dtype="float32", seq=seq("pp"), peer_delta=-1)
            node("compute", "attention")
            node("comm", "all_reduce", dim="tp", nbytes=tp_bytes, dtype="float32", seq=seq("tp"))
            node("compute", "mlp")
            if role.pp < stages - 1:
                node("comm", "send", dim="pp", nbytes=pp_bytes, dtype="float32", seq=seq("pp"), peer_delta=1)
        for _ in range(microbatches):
            if role.pp < stages - 1:
                node("comm", "recv", dim="pp", nbytes=pp_bytes, dtype="float32", seq=seq("pp"), peer_delta=1)
            node("compute", "mlp_backward")
            if role.pp > 0:
                node("comm", "send", dim="pp", nbytes=pp_bytes, dtype="float32", seq=seq("pp"), peer_delta=-1)
        node("comm", "all_reduce", dim="dp", nbytes=65536, dtype="float32", seq=seq("dp"))
        if optimizer_s > 0:
            node("compute", "optimizer.adam", duration_s=optimizer_s)
        roles[role] = b.build(mem_t_s=[0.0, t], mem_bytes=[1000, 5000 + role.pp],
                              peak_by_category={"params": 1000, "activations": 4000 + role.pp})
    return ExecutionGraph(world=world, roles=roles, strings=strings.strings, meta={"config": "test"})
