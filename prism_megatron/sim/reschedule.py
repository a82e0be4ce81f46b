"""What-if on the number of microbatches: the captured graph rewritten for M' microbatches, no recapture.

A pipeline schedule without interleaving is periodic in its steady state. Megatron's 1F1B runs, per
stage, w warm-up forwards, s = M - w steady (forward, backward) pairs and w cool-down backwards; its
no-pipelining schedule is the case w = 0. Cutting the program at the first node of each steady
forward gives *units* [forward i, its p2p, backward, its p2p], and every unit but the first and the
last steady pair is the same program. So M' = M + k microbatches is the captured program with a middle
unit repeated k more times (k > 0) or k middle units removed (k < 0); warm-up, the first and the last
steady pairs, cool-down, gradient synchronisation and the optimizer stay as captured.

Dependencies of a copied node keep their distance when they reach back at most one unit (program
order, issue, waits, p2p: all local), and keep their target otherwise (the prologue: parameter
all-gathers and the like). Every rewritten dependency is verified to land on a node of the same
signature (kind, name, op, dim, bytes, stream, peer); a graph for which that fails is not periodic and
is refused with the reason. The pipeline spans are renumbered, MoE token records are copied with the
forward they belong to, and the memory timeline and peak are kept: with 1F1B (and without pipelining)
the peak does not depend on M once M >= the number of stages. The job's global batch size in the
graph's config is scaled by M'/M, so tokens/s and MFU follow.

Interleaved (virtual-pipeline) schedules are refused: their steady state repeats in groups of
pp * vpp microbatches and megatron requires M to be a multiple of pp there.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import yaml

from prism_megatron.graph.model import MOE_COLUMNS, SPAN_COLUMNS, ExecutionGraph, RoleGraph
from prism_megatron.graph.rewrite import level_at, node_signatures, renumbered_seq, rewritten_memory


class RescheduleError(ValueError):
    """The graph's schedule cannot be rewritten for another number of microbatches."""


def microbatches_of(graph: ExecutionGraph) -> int:
    """Microbatches per iteration (the forward spans of chunk 0 of any role)."""
    counts = {_forward_count(graph, g) for g in graph.roles.values()}
    counts.discard(0)
    if len(counts) != 1:
        raise RescheduleError("the graph has no pipeline spans (or roles disagree on the microbatch "
                              "count); capture it again with this version")
    return counts.pop()


def with_microbatches(graph: ExecutionGraph, microbatches: int) -> ExecutionGraph:
    """`graph` rewritten for `microbatches` per iteration (see the module docstring)."""
    current = microbatches_of(graph)
    if microbatches < 1:
        raise RescheduleError(f"microbatches={microbatches}: expected a positive count")
    if microbatches == current:
        return graph
    pp = graph.world.pp
    if current < pp + 2 or microbatches < pp + 1:
        raise RescheduleError(
            f"the graph was captured with {current} microbatches and PP={pp}: rewriting needs at least "
            f"{pp + 2} captured (3 steady 1F1B pairs on the first stage) and at least {pp + 1} simulated; "
            f"capture with global_batch_size >= {pp + 2} x micro_batch_size x DP")
    done: dict[int, RoleGraph] = {}
    roles = {}
    for role, g in graph.roles.items():
        if id(g.dep_ptr) not in done:
            try:
                done[id(g.dep_ptr)] = _rewrite(graph, g, microbatches - current)
            except RescheduleError as err:
                raise RescheduleError(f"role {role}: {err}") from None
        roles[role] = replace(done[id(g.dep_ptr)], role=role, representative=g.representative,
                              source=g.source)
    meta = dict(graph.meta)
    meta["config"] = _scaled_config(str(meta.get("config", "")), microbatches / current)
    meta["microbatches"] = {"captured": current, "simulated": microbatches}
    return ExecutionGraph(world=graph.world, roles=roles, strings=graph.strings, meta=meta)


def _forward_count(graph: ExecutionGraph, g: RoleGraph) -> int:
    names = [graph.string(i) for i in g.spans["name"].tolist()]
    return sum(1 for n, c in zip(names, g.spans["chunk"].tolist()) if n == "forward" and c == 0)


def _rewrite(graph: ExecutionGraph, g: RoleGraph, k: int) -> RoleGraph:
    spans = g.spans
    if len(spans["first"]) == 0:
        raise RescheduleError("no pipeline spans were recorded")
    if (spans["chunk"] != 0).any():
        raise RescheduleError("an interleaved (virtual pipeline) schedule: the microbatch count "
                              "cannot be changed without recapture")
    order = np.argsort(spans["first"], kind="stable")
    kinds = "".join("F" if graph.string(int(spans["name"][i])) == "forward" else "B" for i in order)
    m = kinds.count("F")
    w = kinds.find("B") - 1
    if w < 0 or kinds != "F" * (w + 1) + "BF" * (m - w - 1) + "B" * (w + 1):
        raise RescheduleError(f"the span sequence {kinds[:24]}... is not a 1F1B or no-pipelining schedule")
    s = m - w
    if s < 3 or s + k < 2:
        raise RescheduleError(f"{m} captured microbatches give {s} steady (forward, backward) pairs; "
                              f"changing the count needs at least 3 captured and keeps at least 2 "
                              f"(capture with at least {w + 3} microbatches, and simulate at least {w + 2})")
    forwards = [int(spans["first"][i]) for i, c in zip(order, kinds) if c == "F"]
    u0, u1 = forwards[w + 1], forwards[w + 2]  # the template: the second steady unit
    length = u1 - u0
    n = g.num_nodes
    sig = node_signatures(g)
    if k > 0:
        seq = np.concatenate([np.arange(0, u1), np.tile(np.arange(u0, u1), k), np.arange(u1, n)])
        shifted_from = u1
    else:
        removed_end = u0 - k * length
        if forwards[w + 1 - k] != removed_end:
            raise RescheduleError("the steady-state units differ in length: the schedule is not periodic")
        seq = np.concatenate([np.arange(0, u0), np.arange(removed_end, n)])
        shifted_from = u0
    units = (np.arange(len(seq)) - seq) // length  # how many units each new node moved by
    deps_ptr, deps_idx = [0], []
    near = u0 - length
    for x, o in enumerate(seq.tolist()):
        ds = g.dep_idx[g.dep_ptr[o]:g.dep_ptr[o + 1]].tolist()
        if x < shifted_from:
            deps_idx.extend(ds)
        else:
            for d in ds:
                y = x - (o - d) if d >= near else d
                if not 0 <= y < x or sig[seq[y]] != sig[d]:
                    raise RescheduleError(f"node {o} ({graph.string(int(g.columns['name'][o]))}) depends on "
                                          f"node {d}, which has no counterpart in the rewritten schedule: "
                                          "the schedule is not periodic")
                deps_idx.append(y)
        deps_ptr.append(len(deps_idx))
    unit_s = float(g.columns["start_s"][u1] - g.columns["start_s"][u0])
    columns = {name: col[seq].copy() for name, col in g.columns.items()}
    columns["start_s"] = columns["start_s"] + units * unit_s
    columns["seq"] = renumbered_seq(g, seq)
    forward = next(int(spans["name"][i]) for i, c in zip(order, kinds) if c == "F")
    spans_new, moe_new = _spans_and_moe(g, seq, units * unit_s, forward)
    memory = _memory(g, float(g.columns["start_s"][u0]), float(g.columns["start_s"][u1]), k)
    return replace(g, columns=columns, dep_ptr=np.asarray(deps_ptr, dtype="i8"),
                   dep_idx=np.asarray(deps_idx, dtype="i4"), spans=spans_new, **moe_new, **memory)


def _memory(g: RoleGraph, t0: float, t1: float, k: int) -> dict:
    """The memory timeline with the template unit's samples repeated (or removed) like its nodes.
    A steady unit frees what it allocates except what the schedule keeps per microbatch (the reduced
    losses of the last stage: a few bytes); that residue accumulates, so the peak moves by it."""
    t, b = g.mem_t_s, g.mem_bytes
    if len(t) == 0:
        return {}

    def level(at: float) -> int:
        return level_at(g, at)
    unit_s, residue = t1 - t0, level(t1) - level(t0)
    before, unit, after = t < t0, (t >= t0) & (t < t1), t >= t1
    if k > 0:
        copies = range(1, k + 1)
        parts_t = [t[before | unit], *(t[unit] + c * unit_s for c in copies), t[after] + k * unit_s]
        parts_b = [b[before | unit], *(b[unit] + c * residue for c in copies), b[after] + k * residue]
    else:
        keep_after = t >= t0 - k * unit_s
        parts_t, parts_b = [t[before], t[keep_after] + k * unit_s], [b[before], b[keep_after] + k * residue]
    mem_t, mem_b = np.concatenate(parts_t), np.concatenate(parts_b).astype("i8")
    return rewritten_memory(g, mem_t, mem_b)


def _spans_and_moe(g: RoleGraph, seq: np.ndarray, shift_s: np.ndarray, forward: int) -> tuple[dict, dict]:
    """Spans at their new positions, microbatches renumbered in program order; MoE records follow
    the forward span of their microbatch."""
    sp = g.spans
    first_at = {int(f): j for j, f in enumerate(sp["first"].tolist())}
    rows: dict[str, list] = {name: [] for name in SPAN_COLUMNS}
    renumber = {"F": 0, "B": 0}
    origin_of_forward = []  # new forward microbatch -> captured microbatch
    names = sp["name"].tolist()
    for x, o in enumerate(seq.tolist()):
        j = first_at.get(o)
        if j is None:
            continue
        kind = "F" if names[j] == forward else "B"
        rows["name"].append(names[j])
        rows["microbatch"].append(renumber[kind])
        if kind == "F":
            origin_of_forward.append(int(sp["microbatch"][j]))
        renumber[kind] += 1
        rows["chunk"].append(int(sp["chunk"][j]))
        rows["first"].append(x)
        rows["last"].append(x + int(sp["last"][j]) - o)
        rows["start_s"].append(float(sp["start_s"][j] + shift_s[x]))
        rows["end_s"].append(float(sp["end_s"][j] + shift_s[x]))
    spans = {name: np.asarray(v, dtype=SPAN_COLUMNS[name]) for name, v in rows.items()}
    moe = {name: [] for name in MOE_COLUMNS}
    ptr, tokens = [0], []
    by_mb: dict[int, list[int]] = {}
    for r, mb in enumerate(g.moe["microbatch"].tolist()):
        by_mb.setdefault(mb, []).append(r)
    for new_mb, old_mb in enumerate(origin_of_forward):
        for r in by_mb.get(old_mb, []):
            moe["layer"].append(int(g.moe["layer"][r]))
            moe["microbatch"].append(new_mb)
            moe["chunk"].append(int(g.moe["chunk"][r]))
            tokens.extend(g.moe_tokens[g.moe_ptr[r]:g.moe_ptr[r + 1]].tolist())
            ptr.append(len(tokens))
    return spans, {"moe": {name: np.asarray(v, dtype=MOE_COLUMNS[name]) for name, v in moe.items()},
                   "moe_ptr": np.asarray(ptr, dtype="i8"), "moe_tokens": np.asarray(tokens, dtype="i8")}


def _scaled_config(config_yaml: str, factor: float) -> str:
    try:
        cfg = yaml.safe_load(config_yaml or "") or {}
    except yaml.YAMLError:
        return config_yaml
    train = cfg.get("train") if isinstance(cfg, dict) else None
    if not isinstance(train, dict) or not train.get("global_batch_size"):
        return config_yaml
    train["global_batch_size"] = int(round(train["global_batch_size"] * factor))
    return yaml.safe_dump(cfg, sort_keys=False)
