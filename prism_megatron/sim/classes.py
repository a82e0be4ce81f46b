"""Equivalence classes of ranks: ranks the DES may simulate as one, exactly.

Two ranks behave identically when they run the same graph, with the same perturbation (slowdown),
and every group they synchronize with holds the same classes: for collectives, the same multiset
of classes placed the same way on the cluster; for point-to-point dims (pipeline), the same class
at every offset. The partition is the coarsest one with that property, found by refinement (as in
colour refinement of graphs): start from (graph, perturbation) and split by the groups' class
signatures until nothing changes. With no perturbation a dense TP8 PP16 DP64 world of 8192 ranks
ends in one class per distinct stage graph (16, or fewer when stages share a verified graph),
whatever N is; a straggler splits exactly the classes whose groups contain it.

Pure numpy over the VirtualWorld's group tables.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Mapping

import numpy as np

from prism_megatron.world import VirtualWorld

P2P_DIMS = frozenset({"pp"})


def _relabel(columns: list[np.ndarray]) -> np.ndarray:
    """Dense ids of the rows of the stacked columns."""
    stacked = np.stack(columns, axis=1)
    _, ids = np.unique(stacked, axis=0, return_inverse=True)
    return ids.reshape(-1).astype(np.int64)


def _dim_signature(world: VirtualWorld, dim: str, labels: np.ndarray) -> np.ndarray:
    table, group_of_rank, index_in_group = world._lookup(dim)
    size = table.shape[1]
    member_labels = labels[table]  # groups x size
    if dim in P2P_DIMS:  # position matters: the classes at each offset from me
        offsets = (index_in_group[:, None] + np.arange(size)[None, :]) % size
        rows = member_labels[np.maximum(group_of_rank, 0)[:, None], offsets]
        sig = _relabel([rows[:, j] for j in range(size)])
    else:  # a multiset, and how the group sits on nodes
        ordered = np.sort(member_labels, axis=1)
        per_group = _relabel([ordered[:, j] for j in range(size)] + [placement_of(world, table)])
        sig = per_group[np.maximum(group_of_rank, 0)]
    return np.where(group_of_rank >= 0, sig, -1)


def placement_of(world: VirtualWorld, table: np.ndarray) -> np.ndarray:
    """Per group: nodes spanned * 1e6 + most members on one node (a comparable key)."""
    nodes = table // world.gpus_per_node
    ordered = np.sort(nodes, axis=1)
    distinct = 1 + np.count_nonzero(np.diff(ordered, axis=1), axis=1)
    # members per node: the largest run of equal node ids in each sorted row
    runs = np.ones(len(table), dtype=np.int64)
    current = np.ones(len(table), dtype=np.int64)
    for j in range(1, ordered.shape[1]):
        same = ordered[:, j] == ordered[:, j - 1]
        current = np.where(same, current + 1, 1)
        runs = np.maximum(runs, current)
    return distinct.astype(np.int64) * 1_000_000 + runs


def rank_classes(world: VirtualWorld, initial: np.ndarray, dims: Iterable[str],
                 max_rounds: int = 64) -> np.ndarray:
    """Class id per rank: the coarsest refinement of `initial` (an int per rank) that is stable
    under the group signatures of `dims`."""
    dims = sorted(set(dims))
    labels = _relabel([np.asarray(initial, dtype=np.int64)])
    for _ in range(max_rounds):
        columns = [labels] + [_dim_signature(world, d, labels) for d in dims]
        new = _relabel(columns)
        if new.max() == labels.max():
            return new
        labels = new
    raise RuntimeError("class refinement did not converge; please report the world's sizes")


def initial_labels(world: VirtualWorld, graph_key: Mapping,
                   perturbation: Mapping[int, Hashable]) -> np.ndarray:
    """(graph identity of the rank's role, its perturbation) as an int per rank."""
    roles, role_of_rank, _ = world._role_table()
    keys: dict[Hashable, int] = {}
    per_role = np.asarray([keys.setdefault(graph_key[r], len(keys)) for r in roles], dtype=np.int64)
    labels = per_role[role_of_rank]
    if perturbation:
        extra: dict[Hashable, int] = {}
        for rank, value in perturbation.items():
            labels[rank] = labels[rank] + (1 + extra.setdefault(value, len(extra))) * (len(keys) + 1)
    return labels
