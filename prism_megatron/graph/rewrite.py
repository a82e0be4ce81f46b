"""What every rewrite of a captured program shares: node signatures and group sequence numbers.

sim/reschedule.py (another microbatch count) and graph/derive.py (another pipeline stage) both build a
program out of a captured one's nodes in a new order; each copied node keeps its signature and gets the
sequence number its group's counter gives it in the new order.
"""

from __future__ import annotations

import numpy as np

from prism_megatron.graph.model import NodeKind, RoleGraph


def node_signatures(g: RoleGraph) -> list[tuple]:
    """Per node, what a rewrite must keep equal: (kind, name, op, dim, bytes, stream, peer)."""
    c = g.columns
    return list(zip(c["kind"].tolist(), c["name"].tolist(), c["op"].tolist(), c["dim"].tolist(),
                    c["nbytes"].tolist(), c["stream"].tolist(), c["peer_delta"].tolist()))


def renumbered_seq(g: RoleGraph, seq_map: np.ndarray) -> np.ndarray:
    """The `seq` column of the program whose node x is node `seq_map[x]` of `g`: sequence numbers
    in the new program order, per group. The graph does not name the group an op was counted on, so
    groups are recovered from the captured numbers: an op continues the group of its dim whose last
    number is one less than its own (a dim's p2p and collectives may be counted on separate groups)."""
    c = g.columns
    counter = np.full(g.num_nodes, -1, dtype=np.int64)
    last: list[tuple[int, int]] = []  # per counter: (dim, last number)
    first: list[int] = []
    for i in np.nonzero(c["kind"] == NodeKind.COMM)[0].tolist():
        dim, value = int(c["dim"][i]), int(c["seq"][i])
        k = next((j for j, (d, v) in enumerate(last) if d == dim and v == value - 1), None)
        if k is None:
            k = len(last)
            last.append((dim, value))
            first.append(value)
        last[k] = (dim, value)
        counter[i] = k
    seq = c["seq"][seq_map].copy()
    count = [0] * len(first)
    for x, o in enumerate(seq_map.tolist()):
        k = int(counter[o])
        if k >= 0:
            seq[x] = first[k] + count[k]
            count[k] += 1
    return seq


def level_at(g: RoleGraph, at_s: float) -> int:
    """Allocated bytes of `g`'s memory timeline at time `at_s` (its first sample before it starts)."""
    i = int(np.searchsorted(g.mem_t_s, at_s, side="right")) - 1
    return int(g.mem_bytes[max(i, 0)])


def rewritten_memory(g: RoleGraph, mem_t_s: np.ndarray, mem_bytes: np.ndarray) -> dict:
    """RoleGraph fields for `g` with a rewritten allocated-bytes timeline: the peak (and its
    activations, and the reserved peak) moved by the timeline maximum's change. On a CUDA allocator
    (real or modelled) reserved memory is kept once grown, so it only moves up."""
    mem_bytes = np.asarray(mem_bytes, dtype="i8")
    delta = int(mem_bytes.max()) - int(g.mem_bytes.max())
    by_category = dict(g.peak_by_category)
    if delta and "activations" in by_category:
        by_category["activations"] += delta
    reserved = delta if g.memory_source == "tracker" else max(delta, 0)
    return {"mem_t_s": mem_t_s, "mem_bytes": mem_bytes, "peak_bytes": g.peak_bytes + delta,
            "peak_reserved_bytes": g.peak_reserved_bytes + reserved, "peak_by_category": by_category}
