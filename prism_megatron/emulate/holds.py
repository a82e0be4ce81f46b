"""Closed-loop holds: how long a sandbox's communication holds its stream when ghosts are replayed.

A collective with ghost members ends when its last member arrives plus its modelled transfer. The
replay (sim/des.py) computes that end for one iteration; a sandbox running for real must end the
operation at the same place *of its own run*, and its own run differs from the replay: its compute is
measured again, under another duty cycle, on a clock that drifts. A fixed wait per operation (the
replay's end less the sandbox's arrival in the replay) keeps every difference: a sandbox that computes
2 % faster keeps its old waits and finishes 2 % early, where a real rank would have waited longer for
its peers.

So each operation is held until the later of two times, both taken on the sandbox's own stream:

- its own part: the sandbox's arrival plus the modelled transfer (`self_s`, counted from the point the
  hold runs, after the operation's local work, so that part is taken off);
- its ghosts' part: when the last ghost peer arrives plus the transfer. A ghost's arrival is the end
  of a chain of ghost work that began at the end of one of the sandbox's earlier operations (the
  *anchor*: the replay's causes are followed back from the ghost until they reach an operation the
  sandbox took part in) or at the iteration's start. Held as `anchor's end in this run + ghost_s`, a
  late sandbox delays its ghost peers exactly as a late real rank does, and an early one waits longer.

Replayed with the replay's own figures, the rule gives back every end the replay computed. A
synchronous operation (the next compute on its stream is the first to wait for it) is held at its
issue; an overlapped one has its end planned at its issue and is held where it is waited for.

The emulator's own time. Between an operation's begin and its issue the backend works on the host
(ghost folding, the recorder's marks): a few hundred microseconds where a real NCCL launch takes tens.
Where the device waits for that host (after a device-to-host synchronization, as MoE dispatchers make)
the operation runs past the end the rule gives, and that overrun is the emulator's, not the job's. The
clocks (trace/clock.py, comm/csrc/holds_cuda.h) keep it as a debt: they plan every end on the job's
timeline (the stream's time less the debt) and pay the debt back out of later holds, which then spin
that much less, so the device idles as long as in the replay wherever later holds leave room. Only
spins are shortened, never compute. The debt starts at zero each iteration; what is left at the
iteration's end shows in its wall, and the clocks report what was run up and paid back.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from prism_megatron.graph.model import RoleGraph
from prism_megatron.sim.des import SimResult
from prism_megatron.trace.holdplan import START, Hold, read_plan, write_plan  # noqa: F401 - re-exported
from prism_megatron.util import gc_paused

SLACK = 0.25
"""Paths are kept that decide the ghosts' arrival for a sandbox whose compute runs up to this share
faster or slower than in the replay (`_prune`)."""
_FACTORS = tuple(1 + SLACK * (k / 5 - 1) for k in range(11))


def overlapped(g: RoleGraph) -> np.ndarray:
    """Per communication node of `g` in program order: whether compute runs between its issue and
    the first compute node that waits for it, or none waits for it in the iteration (False:
    synchronous, waited for by the next compute). An overlapped operation is held only where it is
    waited for: one that nothing waits for holds nothing, as in the replay."""
    kind = g.columns["kind"]
    comm = np.nonzero(kind != 0)[0].tolist()
    waiter: dict[int, int] = {}
    for j in np.nonzero(kind == 0)[0].tolist():
        for d in g.dep_idx[g.dep_ptr[j]:g.dep_ptr[j + 1]].tolist():
            if kind[d] != 0 and d not in waiter:
                waiter[d] = j
    compute = np.nonzero(kind == 0)[0]
    out = np.zeros(len(comm), dtype=bool)
    for k, i in enumerate(comm):
        j = waiter.get(i)
        pos = int(np.searchsorted(compute, i, side="right"))
        out[k] = j is None or not (pos < len(compute) and j == int(compute[pos]))
    return out


def holds(result: SimResult, rank: int, g: RoleGraph) -> list[Optional[Hold]]:
    """The holds of `rank`'s communication in program order (None: not held, a local operation),
    from a replay run with `causes=True` in which `g` is `rank`'s graph."""
    if result.causes is None:
        raise ValueError("holds need a replay run with causes=True")
    with gc_paused():
        return _holds(result, rank, g)


def _holds(result: SimResult, rank: int, g: RoleGraph) -> list[Optional[Hold]]:
    causes = result.causes
    cs = int(result.class_of_rank[rank])
    comm = np.nonzero(g.columns["kind"] != 0)[0].tolist()
    local = g.columns["duration_s"]
    own: dict = {}  # operation key -> this rank's ordinal of it
    for ordinal, i in enumerate(comm):
        key = causes.keys.get((cs, i))
        if key is not None and key not in own:
            own[key] = ordinal
    paths = _Paths(causes, own, causes.offset[cs])
    at_wait = overlapped(g)
    out: list[Optional[Hold]] = []
    for ordinal, i in enumerate(comm):
        key = causes.keys.get((cs, i))
        if key is None:
            out.append(None)
            continue
        start, end, arrivals = causes.ops[key]
        transfer = end - start
        others = [a for a in arrivals if not (a[0] == cs and a[2] == i)]
        terms: dict = {}
        for a in others:
            _merge(terms, paths.ready(a[0], a[2]), 0.0)
        _prune(terms, paths.end, paths.start_s)
        rows: dict = {}
        for anchor, at in terms.items():
            if anchor != START and anchor >= ordinal:  # a path from an operation issued later
                anchor = START  # (an overlapped one): held at its replayed time instead
            ghost_s = at + transfer - paths.end[anchor]
            rows[anchor] = max(rows.get(anchor, -math.inf), ghost_s)
        out.append(Hold(transfer - float(local[i]), tuple(sorted(rows.items())), bool(at_wait[ordinal]),
                        transfer))
    return out


class _Paths:
    """Every path by which a node of the replay became ready, as (where it began: an end of one of
    the sandbox's operations or START) -> the time it reached the node, in the max-plus sense: the
    node is ready at the latest of them. Memoized per node; paths that decide for no sandbox speed
    within `SLACK` are pruned."""

    def __init__(self, causes, own: dict, start_s: float) -> None:
        self.c, self.own, self.start_s = causes, own, start_s
        self.end = {START: start_s}
        for key, ordinal in own.items():
            self.end[ordinal] = causes.ops[key][1]
        self._ready: dict = {}
        self._fin: dict = {}

    def ready(self, c: int, i: int) -> dict:
        todo = [("ready", c, i)]
        while todo:
            kind, c, i = todo[-1]
            memo = self._ready if kind == "ready" else self._fin
            if (c, i) in memo:
                todo.pop()
                continue
            parts = self._parts(kind, c, i)
            missing = [(k, cc, ii) for k, cc, ii, _ in parts
                       if (cc, ii) not in (self._ready if k == "ready" else self._fin)]
            if missing:
                todo.extend(missing)
                continue
            terms: dict = {}
            for k, cc, ii, weight in parts:
                _merge(terms, (self._ready if k == "ready" else self._fin)[(cc, ii)], weight)
            if kind == "ready":
                _merge(terms, {START: self.c.offset[c]}, 0.0)
            else:
                key = self.c.keys.get((c, i))
                if key is not None and key in self.own:
                    terms = {self.own[key]: self.c.ops[key][1]}
            _prune(terms, self.end, self.start_s)
            memo[(c, i)] = terms
            todo.pop()
        return self._ready[(c, i)]

    def _parts(self, kind: str, c: int, i: int) -> list:
        """What the node's ready (or end) is the latest of: (kind, class, node, weight) each."""
        cz = self.c
        if kind == "ready":  # its dependencies: ended, or (p2p after p2p on one stream) posted
            p2p, streams = cz.p2p[c], cz.streams[c]
            return [("ready" if p2p[i] and p2p[d] and streams[d] == streams[i] else "fin", c, d, 0.0)
                    for d in cz.deps[c][i]]
        key = cz.keys.get((c, i))
        if key is None:  # compute (or a local operation): ready plus its duration
            return [("ready", c, i, cz.compute_s[c][i])]
        if key in self.own:
            return []
        start, end, arrivals = cz.ops[key]
        return [("ready", a[0], a[2], end - start) for a in arrivals]


def _merge(into: dict, terms: dict, weight: float) -> None:
    for anchor, at in terms.items():
        at += weight
        if at > into.get(anchor, -math.inf):
            into[anchor] = at


def _prune(terms: dict, end: dict, start_s: float) -> None:
    """Keep the paths that are the latest for some sandbox speed: a sandbox whose compute takes f
    times as long shifts the end of its operation a by about (f - 1) * (end[a] - start), so each
    path's time is a line in f; the lines on the upper envelope over f in 1 +- SLACK (sampled) stay."""
    if len(terms) <= 1:
        return
    kept = set()
    for f in _FACTORS:
        kept.add(max(terms, key=lambda a: terms[a] + (f - 1) * (end[a] - start_s)))
    for anchor in [a for a in terms if a not in kept]:
        del terms[anchor]
