"""Which virtual ranks run for real (sandbox choice) and which ghosts they touch (pruning figures).

Sandbox specs are virtual ranks or role names:

- `first-stage`, `last-stage`: the lowest rank of pipeline stage 0 / pp-1;
- `hottest-expert`: the rank whose captured MoE layers received the most tokens (needs MoE records);
- `slowest`: the rank of the class with the longest simulated iteration;
- an integer rank, `0 .. N-1`.

`--prism-sandbox-ranks` of a training run takes the names that need no graph (first-stage,
last-stage; config/flags.py).

Direct peers are the ghosts a sandbox exchanges data with under the algorithm the cost model uses:
its ring neighbours in every collective group (previous and next member), its pipeline neighbours,
and every member of an all-to-all (expert) group. Their number depends on the parallel sizes, not
on N; the DES keeps everyone else in equivalence classes.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from prism_megatron.config.schema import ConfigError
from prism_megatron.graph.model import ExecutionGraph, NodeKind
from prism_megatron.world import VirtualWorld

ROLE_NAMES = ("first-stage", "last-stage", "hottest-expert", "slowest")


def resolve_sandbox(specs: Iterable[str], graph: ExecutionGraph,
                    class_times: Optional[np.ndarray] = None) -> list[int]:
    """Virtual ranks for `specs` (names or integers), in the order given, without repeats.
    `class_times`: per-rank simulated iteration times (for `slowest`)."""
    world = graph.world
    out: list[int] = []
    for spec in specs:
        spec = str(spec).strip()
        if not spec:
            continue
        if spec.lstrip("-").isdigit():
            rank = int(spec)
            if not 0 <= rank < world.world_size:
                raise ConfigError(f"sandbox rank {rank} is outside the virtual world of {world.world_size}; "
                                  f"choose 0..{world.world_size - 1} or one of {', '.join(ROLE_NAMES)}")
        elif spec == "first-stage":
            rank = world.stage_rank(0)
        elif spec == "last-stage":
            rank = world.stage_rank(world.pp - 1)
        elif spec == "hottest-expert":
            rank = _hottest_expert(graph)
        elif spec == "slowest":
            if class_times is None:
                raise ConfigError("sandbox `slowest` needs a simulation of the graph first")
            rank = int(np.argmax(class_times))
        else:
            raise ConfigError(f"sandbox {spec!r}: expected a virtual rank or one of {', '.join(ROLE_NAMES)}")
        if rank not in out:
            out.append(rank)
    if not out:
        raise ConfigError(f"no sandbox rank given; name ranks or roles ({', '.join(ROLE_NAMES)})")
    return out


def _hottest_expert(graph: ExecutionGraph) -> int:
    best, best_tokens = None, -1
    for role, g in graph.roles.items():
        tokens = int(g.moe_tokens.sum()) if len(g.moe_tokens) else -1
        if tokens > best_tokens:
            best, best_tokens = role, tokens
    if best is None or best_tokens < 0:
        raise ConfigError("sandbox `hottest-expert`: the graph has no MoE token records (a dense model, or "
                          "captured without MoE); name a rank instead")
    return graph.world.representative(best)


def direct_peers(graph: ExecutionGraph, sandbox: list[int]) -> set[int]:
    """Ghost ranks that exchange data with a sandbox rank (see the module docstring)."""
    world = graph.world
    peers: set[int] = set()
    for rank in sandbox:
        g = graph.graph_of(rank)
        cols = g.columns
        comm = cols["kind"] == NodeKind.COMM
        for d, o in set(zip(cols["dim"][comm].tolist(), cols["op"][comm].tolist())):
            dim, op = graph.string(d), graph.string(o)
            if dim == "other":
                continue
            members = tuple(range(world.world_size)) if dim == "world" else world.group(rank, dim)
            if len(members) < 2:
                continue
            i = members.index(rank)
            if op == "all_to_all":
                peers.update(members)
            else:  # ring neighbours; p2p peers are the pipeline neighbours, also ring-adjacent
                peers.update((members[i - 1], members[(i + 1) % len(members)]))
    return peers - set(sandbox)
