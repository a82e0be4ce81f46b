"""Another pipeline stage's program derived from a captured one: capture cost independent of depth.

Megatron's pipeline schedules, with interleaving (virtual stages) or without, run on every stage the
same sequence of forward steps F_0..F_{N-1} and of backward steps B_0..B_{N-1} (N = microbatches x
model chunks; F_k's chunk and microbatch are the same on every stage), merged by the stage's warm-up
count W: F_0..F_{W-1}, then N - W pairs (F_{W+k}, B_k), then B_{N-W}..B_{N-1}. Stages between the first
(embedding) and the last (loss) hold the same layers' shapes, so their programs are the same steps
merged by another W, with the schedule's glue (its p2p, host work) between them.

So a middle stage's graph with warm-up W' is built from a captured middle stage's graph with warm-up
W: the captured prologue (up to the first step) and tail (after the last), each step's nodes copied
from the captured step of the same kind and index, and between two steps the captured glue of the same
*transition* (phase and kind of the step before and after: warm-up, steady, cool-down). What the
derivation relies on is checked on the captured graph first and refused with the reason otherwise:

- the captured span sequence is such a merge;
- every captured glue of one transition is the same program (node signatures);
- every dependency reaching outside its own segment (step or glue) and the prologue lands on the
  latest earlier node of its signature (program order, stream order, p2p waits: all local). The
  derived graph's dependencies are placed by that rule.

The memory timeline is rebuilt from each segment's allocations relative to its start, so the peak
follows the number of microbatches in flight (the breakdown at the peak moves by the change as
activations: the split between activations and temporaries at a peak elsewhere is not known, their
sum is); group sequence numbers are renumbered in the new order.
Forward steps run in the order F_0, F_1, ... on every stage, so the MoE rows (one per forward step and
layer, in that order) stay as captured.

Status and known limits: every middle stage derived from stage 1 equals its direct capture in nodes,
dependencies and spans on PP8 1F1B and PP8 VPP2 (tests/test_derive.py) and on GPT-175B TP8 PP16 VPP3
under fake execution (stages 2-14). Not yet exact, so the capture does not use the derivation:
- the peak: a role's peak includes what a node allocates and frees inside itself, which the timeline
  (one sample per node boundary) does not hold, and the node that sets the peak moves with the
  warm-up count (GPT-175B VPP3: +0.01 % on stage 2 to +0.42 % on stage 14, against the 0.01 % goal);
  the recorder must keep each sample's high-water mark;
- on the tiny test models the levels at node boundaries drift by one allocator block (512 B) and, with
  VPP, two backward nodes' modelled durations differ from the copied ones (their cost depends on
  state the copy does not carry).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from prism_megatron.graph.model import SPAN_COLUMNS, RoleGraph
from prism_megatron.graph.rewrite import level_at, node_signatures, renumbered_seq, rewritten_memory


class DeriveError(ValueError):
    """The captured stage's program cannot be re-merged for another warm-up count."""


def merge_order(steps: int, warmup: int) -> list[tuple[str, int]]:
    """The steps of a stage with `warmup` warm-up forwards, in program order: ("F", k) / ("B", k)."""
    w = min(warmup, steps)
    order = [("F", k) for k in range(w)]
    for k in range(steps - w):
        order += [("F", w + k), ("B", k)]
    return order + [("B", k) for k in range(steps - w, steps)]


def _phase(kind: str, k: int, steps: int, warmup: int) -> str:
    if kind == "F":
        return "warmup" if k < warmup else "steady"
    return "steady" if k < steps - warmup else "cooldown"


def _transitions(steps: int, warmup: int) -> list[tuple]:
    """Per position of merge_order: the key of the glue after it (kind and phase of the steps before
    and after it). Not the model chunk: a glue waits on the step before it by position (the chunk's
    nodes are named after it), and its nodes are the same for every chunk of a middle stage."""
    order = merge_order(steps, warmup)

    def side(step: tuple) -> tuple:
        return (step[0], _phase(*step, steps, warmup))

    return [side(step) + (side(order[p + 1]) if p + 1 < len(order) else ("end",))
            for p, step in enumerate(order)]


class _Segments:
    """The captured graph cut into prologue, steps (spans) and glue."""

    def __init__(self, g: RoleGraph, strings: Sequence[str], warmup: int) -> None:
        sp = g.spans
        if len(sp["first"]) == 0:
            raise DeriveError("the graph has no pipeline spans")
        order = np.argsort(sp["first"], kind="stable")
        kinds = ["F" if strings[int(sp["name"][j])] == "forward" else "B" for j in order]
        steps = kinds.count("F")
        self.steps, self.warmup = steps, min(warmup, steps)
        expected = merge_order(steps, self.warmup)
        index = {"F": 0, "B": 0}
        seen = []
        for kind in kinds:
            seen.append((kind, index[kind]))
            index[kind] += 1
        if seen != expected:
            got = "".join(k for k, _ in seen)
            raise DeriveError(f"the span sequence {got[:32]}... is not a pipeline merge with {warmup} "
                              "warm-up steps")
        self.span_row = {step: int(j) for step, j in zip(seen, order)}
        firsts = [int(sp["first"][j]) for j in order]
        lasts = [int(sp["last"][j]) for j in order]
        self.prologue = (0, firsts[0])
        self.step_range = {step: (f, l + 1) for step, f, l in zip(seen, firsts, lasts)}
        ends = firsts[1:] + [g.num_nodes]
        self.glue_range = [(l + 1, e) for l, e in zip(lasts, ends)]
        self.tail = self.glue_range[-1]
        self.order = seen
        self.keys = _transitions(steps, self.warmup)
        self.chunk_of = {step: int(sp["chunk"][j]) for step, j in self.span_row.items()}

    def chunk_changes(self, order: list[tuple]) -> list[tuple]:
        """Per position: whether the next step of its kind, and of the following step's kind, runs
        another model chunk (the schedule then receives for another chunk)."""
        def change(step: tuple) -> bool:
            following = (step[0], step[1] + 1)
            return following in self.chunk_of and self.chunk_of[following] != self.chunk_of[step]

        return [(change(step), change(order[p + 1]) if p + 1 < len(order) else False)
                for p, step in enumerate(order)]


def derive_stage(g: RoleGraph, strings: Sequence[str], warmup_captured: int, warmup: int) -> RoleGraph:
    """`g` (a captured middle stage whose schedule runs `warmup_captured` warm-up steps) re-merged
    for a stage of `warmup` warm-up steps (see the module docstring). Role fields stay `g`'s: the
    caller re-labels the result (RoleGraph.as_role)."""
    src = _Segments(g, strings, warmup_captured)
    if min(warmup, src.steps) == src.warmup:
        return g
    sig = node_signatures(g)
    segment = np.full(g.num_nodes, -1, dtype=np.int64)  # -1: prologue
    for s, (a, b) in enumerate([src.step_range[st] for st in src.order] + src.glue_range):
        segment[a:b] = s
    _check_local(g, sig, segment, src.prologue[1])
    glue: dict[tuple, list[tuple[int, int, tuple]]] = {}  # transition -> its captured instances
    for key, (a, b), changes in zip(src.keys[:-1], src.glue_range[:-1], src.chunk_changes(src.order)):
        instances = glue.setdefault(key, [])
        if instances and sig[instances[0][0]:instances[0][1]] != sig[a:b]:
            raise DeriveError(f"the glue of transition {key} differs between steps: the schedule's "
                              "work between steps is not one program per transition")
        instances.append((a, b, changes))
    steps, w = src.steps, min(warmup, src.steps)
    pieces: list[tuple[int, int]] = [src.prologue]  # source ranges, in the derived program order
    span_pieces: list[tuple[tuple, int]] = []  # (step, index into pieces)
    keys = _transitions(steps, w)
    order = merge_order(steps, w)
    changes = src.chunk_changes(order)
    used: dict[tuple, int] = {}
    for p, step in enumerate(order):
        span_pieces.append((step, len(pieces)))
        pieces.append(src.step_range[step])
        if p + 1 < len(keys):
            if keys[p] not in glue:
                raise DeriveError(f"the captured stage has no glue for transition {keys[p]} (its "
                                  f"{src.warmup} warm-up steps of {steps}); capture a stage with more "
                                  "warm-up and steady steps")
            # a transition's first glue may depend on the prologue (nothing of its kind before it):
            # it copies the captured first; a later one copies a later one, where it can one at the
            # same chunk changes (its receive buffers are those of the chunks around it)
            nth = used[keys[p]] = used.get(keys[p], -1) + 1
            instances = glue[keys[p]]
            later = [i for i in instances[1:] if i[2] == changes[p]] or instances[1:] or instances
            a, b, _ = instances[0] if nth == 0 else later[min(nth, len(later)) - 1]
            pieces.append((a, b))
    pieces.append(src.tail)
    seq = np.concatenate([np.arange(a, b) for a, b in pieces]).astype(np.int64)
    piece_of = np.repeat(np.arange(len(pieces)), [b - a for a, b in pieces])
    starts = np.cumsum([0] + [b - a for a, b in pieces])
    deps_ptr, deps_idx = [0], []
    latest: dict[tuple, int] = {}
    prologue_end = src.prologue[1]
    seg_start = np.r_[0, np.flatnonzero(np.diff(segment)) + 1]  # captured segments' first nodes
    for x, o in enumerate(seq.tolist()):
        i = int(piece_of[x])
        a = pieces[i][0]
        before = int(seg_start[np.searchsorted(seg_start, a, side="left") - 1]) if a > 0 else 0
        for d in g.dep_idx[g.dep_ptr[o]:g.dep_ptr[o + 1]].tolist():
            if d < prologue_end:
                y = d
            elif a <= d < o:
                y = x - (o - d)
            elif before <= d < a and i > 0 and starts[i] - (a - d) >= starts[i - 1]:
                y = int(starts[i]) - (a - d)  # the segment just before, at the same distance:
                if sig[seq[y]][0] != sig[d][0] or sig[seq[y]][5] != sig[d][5]:  # same kind, stream
                    y = -1
                deps_idx.append(y)
                if y < 0:
                    raise DeriveError(f"node {o} depends on node {d} of the step before it, which "
                                      "differs in kind or stream in the derived program")
                continue
            else:
                y = latest.get(sig[d], -1)
            if not 0 <= y < x or sig[seq[y]] != sig[d]:
                raise DeriveError(f"node {o} depends on node {d}, which has no counterpart in the derived "
                                  "program")
            deps_idx.append(y)
        deps_ptr.append(len(deps_idx))
        latest[sig[o]] = x
    columns = {name: col[seq].copy() for name, col in g.columns.items()}
    columns["seq"] = renumbered_seq(g, seq)
    t = g.columns["start_s"]
    piece_t0 = [float(t[a]) if b > a else None for a, b in pieces]
    piece_len = [_duration_of(g, a, b) for a, b in pieces]
    cursor = np.cumsum([float(t[0]) if g.num_nodes else 0.0] + piece_len)
    shift = np.asarray([cursor[i] - (piece_t0[i] if piece_t0[i] is not None else 0.0)
                        for i in range(len(pieces))])
    columns["start_s"] = t[seq] + shift[piece_of]
    spans = _spans(g, src, span_pieces, starts, shift)
    memory = _memory(g, pieces, piece_t0, cursor)
    return replace(g, columns=columns, dep_ptr=np.asarray(deps_ptr, dtype="i8"),
                   dep_idx=np.asarray(deps_idx, dtype="i4"), spans=spans, **memory)


def _duration_of(g: RoleGraph, a: int, b: int) -> float:
    if b <= a:
        return 0.0
    t, d = g.columns["start_s"], g.columns["duration_s"]
    nxt = float(t[b]) if b < g.num_nodes else float((t[a:b] + d[a:b]).max())
    return nxt - float(t[a])


def _check_local(g: RoleGraph, sig: list, segment: np.ndarray, prologue_end: int) -> None:
    """Every dependency outside its segment and the prologue is on the latest node of its signature."""
    latest: dict[tuple, int] = {}
    for o in range(g.num_nodes):
        for d in g.dep_idx[g.dep_ptr[o]:g.dep_ptr[o + 1]].tolist():
            if d >= prologue_end and segment[d] != segment[o] and latest.get(sig[d]) != d:
                raise DeriveError(f"node {o} depends on node {d}, which is not the latest node of its kind "
                                  "before it: the schedule's dependencies are not local")
        latest[sig[o]] = o


def _spans(g: RoleGraph, src: _Segments, span_pieces, starts, shift) -> dict:
    sp = g.spans
    rows: dict[str, list] = {name: [] for name in SPAN_COLUMNS}
    for step, piece in span_pieces:
        j = src.span_row[step]
        first = int(starts[piece])
        for name in ("name", "microbatch", "chunk"):
            rows[name].append(int(sp[name][j]))
        rows["first"].append(first)
        rows["last"].append(first + int(sp["last"][j]) - int(sp["first"][j]))
        rows["start_s"].append(float(sp["start_s"][j] + shift[piece]))
        rows["end_s"].append(float(sp["end_s"][j] + shift[piece]))
    return {name: np.asarray(v, dtype=SPAN_COLUMNS[name]) for name, v in rows.items()}


def _memory(g: RoleGraph, pieces, piece_t0, cursor) -> dict:
    """The allocated-bytes timeline re-laid piece by piece: each piece's samples relative to the level
    at its start, stacked in the derived order. The peak moves by the timeline's change."""
    t, b = g.mem_t_s, g.mem_bytes
    if len(t) == 0:
        return {}

    def level(at: float) -> int:
        return level_at(g, at)
    bounds = sorted({p for p in piece_t0 if p is not None})
    out_t, out_b = [t[t < bounds[0]]], [b[t < bounds[0]]]
    running = level(bounds[0]) if len(out_b[0]) else int(b[0])
    for i, (a, z) in enumerate(pieces):
        t0 = piece_t0[i]
        if t0 is None:
            continue
        t1 = t0 + _duration_of(g, a, z)
        inside = (t >= t0) & (t < t1) if i + 1 < len(pieces) else t >= t0
        base = level(t0)
        out_t.append(t[inside] - t0 + cursor[i])
        out_b.append(b[inside] - base + running)
        running += level(t1) - base if i + 1 < len(pieces) else 0
    mem_t, mem_b = np.concatenate(out_t), np.concatenate(out_b).astype("i8")
    return rewritten_memory(g, mem_t, mem_b)
