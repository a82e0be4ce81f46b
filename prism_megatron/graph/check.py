"""Consistency of an ExecutionGraph: a DAG, every role present, collectives that match up.

A collective is only well-formed if every member of the group issues it: for each role and each
group dim, the sequence of (op, bytes) on that dim must be the same for every role that has a member
in the role's group. Point-to-point traffic is matched pairwise: what a role sends to the peer at
offset +k along a dim, the role of that peer must receive from offset -k, in the same order and sizes.
"""

from __future__ import annotations

import numpy as np

from prism_megatron.graph.model import NO_PEER, ExecutionGraph, NodeKind, RoleGraph


class GraphFileError(ValueError):
    """A graph that cannot be used; the message is one line naming the file and the fix."""


_UNMATCHED_DIMS = {"other"}  # groups outside megatron's dims: membership unknown
_P2P = {"send": "recv", "recv": "send"}
# Sizes that depend on the data: each member of an MoE all-to-all sends what its router chose, so the
# members' byte counts legitimately differ (the replay takes the largest); only the op must match.
DATA_DEPENDENT_SIZES = frozenset({"all_to_all"})


def check_graph(graph: ExecutionGraph, path: str = "graph") -> None:
    """Raise GraphFileError for the first inconsistency found."""
    world = graph.world
    missing = [r for r in world.roles() if r not in graph.roles]
    if missing:
        raise GraphFileError(f"{path}: {len(missing)} of {len(world.roles())} roles have no graph "
                             f"(first: {missing[0]}); capture the missing slices")
    for role, g in graph.roles.items():
        _check_dag(g, path, role)
    sequences = {role: _collectives_by_dim(graph, g) for role, g in graph.roles.items()}
    for role, by_dim in sequences.items():
        rank = graph.roles[role].representative
        for dim, seq in by_dim.items():
            members = range(world.world_size) if dim == "world" else world.group(rank, dim)
            for other_role in {world.role(m) for m in members}:
                theirs = sequences[other_role].get(dim, [])
                if theirs != seq:
                    where = next((i for i, (a, b) in enumerate(zip(seq, theirs)) if a != b),
                                 min(len(seq), len(theirs)))
                    raise GraphFileError(
                        f"{path}: collectives on {dim} do not match between roles {role} and "
                        f"{other_role} at call {where} ({len(seq)} vs {len(theirs)} calls; "
                        f"{_show(seq, where)} vs {_show(theirs, where)}): the graph mixes captures of "
                        "different configs, or roles whose programs differ with the data")
    _check_p2p(graph, path)


def _show(seq: list[tuple[str, int]], i: int) -> str:
    if i >= len(seq):
        return "nothing"
    return seq[i][0] if seq[i][1] < 0 else f"{seq[i][0]} of {seq[i][1]} bytes"


def _check_dag(g: RoleGraph, path: str, role) -> None:
    if len(g.dep_ptr) == 0 or g.dep_ptr[0] != 0 or np.any(np.diff(g.dep_ptr) < 0) \
            or g.dep_ptr[-1] != len(g.dep_idx):
        raise GraphFileError(f"{path}: role {role}: malformed dependency index")
    if len(g.dep_idx):
        owner = np.repeat(np.arange(g.num_nodes), np.diff(g.dep_ptr))
        if np.any(g.dep_idx >= owner) or np.any(g.dep_idx < 0):
            raise GraphFileError(f"{path}: role {role}: a node depends on itself or a later node; "
                                 "the graph is not a DAG")


def _collectives_by_dim(graph: ExecutionGraph, g: RoleGraph) -> dict[str, list[tuple[str, int]]]:
    cols = g.columns
    out: dict[str, list[tuple[str, int]]] = {}
    comm = np.nonzero(cols["kind"] == NodeKind.COMM)[0]
    for i in comm[np.argsort(cols["seq"][comm], kind="stable")]:
        op, dim = graph.string(int(cols["op"][i])), graph.string(int(cols["dim"][i]))
        if op in _P2P or dim in _UNMATCHED_DIMS:
            continue
        out.setdefault(dim, []).append((op, -1 if op in DATA_DEPENDENT_SIZES else int(cols["nbytes"][i])))
    return out


def _check_p2p(graph: ExecutionGraph, path: str) -> None:
    world = graph.world
    for role, g in graph.roles.items():
        cols = g.columns
        rank = g.representative
        streams: dict[tuple[str, str, int], list[int]] = {}
        for i in np.nonzero(cols["peer_delta"] != NO_PEER)[0]:
            op, dim = graph.string(int(cols["op"][i])), graph.string(int(cols["dim"][i]))
            streams.setdefault((op, dim, int(cols["peer_delta"][i])), []).append(int(cols["nbytes"][i]))
        for (op, dim, delta), sizes in streams.items():
            if op not in _P2P or dim in _UNMATCHED_DIMS:
                continue
            group = tuple(range(world.world_size)) if dim == "world" else world.group(rank, dim)
            peer = group[(group.index(rank) + delta) % len(group)]
            peer_graph = graph.roles[world.role(peer)]
            theirs = _p2p_sizes(graph, peer_graph, _P2P[op], dim, -delta, len(group))
            if theirs != sizes:
                raise GraphFileError(
                    f"{path}: {op} from role {role} to offset {delta:+d} on {dim} ({len(sizes)} "
                    f"messages) has no matching {_P2P[op]} ({len(theirs)}) on role {world.role(peer)}")


def _p2p_sizes(graph: ExecutionGraph, g: RoleGraph, op: str, dim: str, delta: int, size: int) -> list[int]:
    cols = g.columns
    out = []
    for i in np.nonzero(cols["peer_delta"] != NO_PEER)[0]:
        if (graph.string(int(cols["op"][i])) == op and graph.string(int(cols["dim"][i])) == dim
                and int(cols["peer_delta"][i]) % size == delta % size):
            out.append(int(cols["nbytes"][i]))
    return out
