"""One recorded iteration of the recorder (trace/recorder.py), and what its marks become.

`Iteration` holds the device-clock marks of one training iteration in program order and the nodes cut
between them; `mapped_seconds` resolves the marks of a labelled iteration on the clock of a timed one
(the recorder's two passes), `same_program` says whether two iterations may be mapped so, and
`host_bound` reads how much of an iteration's compute ended with its device waiting for the host.
No torch here: the clock resolves its own marks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from prism_megatron.graph.model import NodeKind


@dataclass(slots=True)
class Node:
    """One node of an iteration: a compute segment or a communication operation, between two marks."""

    kind: NodeKind
    name: str
    stream: str
    t0: int  # index into the iteration's marks
    t1: Optional[int]
    deps: list[int]
    op: str = ""
    dim: str = ""
    group: str = ""
    nbytes: int = 0
    dtype: str = ""
    peer_delta: Optional[int] = None
    ordinal: int = -1  # the k-th communication operation of its iteration (injected waits)


@dataclass
class Iteration:
    """What the recorder kept of one iteration (or of the setup before the first)."""

    labelled: bool
    marks: list[Any] = field(default_factory=list)        # device-clock marks in program order; [0]: origin
    anchor: list[bool] = field(default_factory=list)      # per mark: an anchor (trace/recorder.py)
    signature: list[str] = field(default_factory=list)    # per anchor: what made it
    nodes: list[Node] = field(default_factory=list)
    last: dict[str, int] = field(default_factory=dict)  # stream -> its latest node
    spans: list[tuple] = field(default_factory=list)    # (name, microbatch, chunk, first, last, m0, m1)
    moe: list[tuple] = field(default_factory=list)      # (layer, microbatch, chunk, tokens)
    mem: list[tuple[int, int]] = field(default_factory=list)  # (mark, bytes)
    idle: list[int] = field(default_factory=list)  # marks of operations' begins found the device idle

    def add(self, mark: Any, anchor: Optional[str]) -> int:
        self.marks.append(mark)
        self.anchor.append(anchor is not None)
        if anchor is not None:
            self.signature.append(anchor)
        return len(self.marks) - 1


HOST_BOUND_WARN_SHARE = 0.15
"""A rank whose compute was this share or more in segments that ended with its device idle
(`host_bound`) is reported as host-bound: over repeated emulations of one graph the measured compute
rises with this share (`benchmarks/emulate_scale.py`; docs/results.md gives the figures)."""


def mapped_seconds(clock: Any, it: Iteration, timed: Iteration) -> np.ndarray:
    """Seconds of every mark of `it` from its origin, on the clock of `timed`: each interval between two
    anchors of `it` is scaled into the interval between the same anchors of `timed` (trace/recorder.py
    two passes)."""
    own = clock.seconds(it.marks, it.marks[0])
    if timed is it:
        return own
    anchors = np.flatnonzero(np.asarray(it.anchor, dtype=bool))
    a0 = own[anchors]
    theirs = np.flatnonzero(timed.anchor)[:len(anchors)]
    target = clock.seconds([timed.marks[i] for i in theirs], timed.marks[0])
    if len(target) < len(a0):  # the run's last iteration goes on past the other: as recorded
        target = np.concatenate([target, target[-1] + a0[len(target):] - a0[len(target) - 1]])
    before = np.cumsum(it.anchor) - 1  # per mark: its anchor or the anchor before it
    span_own = np.diff(a0, append=np.nan)
    span_target = np.diff(target, append=np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.where(span_own > 0, span_target / span_own, 0.0)
    scale = np.nan_to_num(scale, nan=1.0)  # after the last anchor: as recorded
    return target[before] + (own - a0[before]) * scale[before]


def same_program(labelled: Iteration, timed: Iteration, last: Iteration) -> bool:
    """Whether both ran one program: the same anchors in the same order (the run's `last` iteration
    has no next iteration's begin, and may go on with what the run does after training)."""
    a, b = labelled.signature, timed.signature
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n] and (len(a) == len(b) or last in (labelled, timed))


def host_bound(it: Iteration, seconds: np.ndarray) -> dict:
    """How far iteration `it` ran host-bound on a device clock: of its `ops` communication
    operations, `idle_ops` began with the device idle (it had run everything queued before the
    host issued the operation), and `idle_compute_s` of its `compute_s` was in the compute
    segments that ended there. A segment that ends with the device idle lasts until the host
    arrives, so its measured time holds host time: the device waited for the host's Python,
    inside the segment as at its end, and where the production host runs ahead of its GPU the
    same segment would be shorter. `share` = idle_compute_s / compute_s. `seconds`: of `it`'s marks,
    on its own clock."""
    idle = set(it.idle)
    compute = idle_compute = 0.0
    ops = 0
    for node in it.nodes:
        if node.kind != NodeKind.COMPUTE:
            ops += 1
            continue
        duration = max(0.0, float(seconds[node.t1]) - float(seconds[node.t0]))
        compute += duration
        if node.t1 in idle:
            idle_compute += duration
    return {"ops": ops, "idle_ops": len(it.idle), "compute_s": compute, "idle_compute_s": idle_compute,
            "share": idle_compute / compute if compute > 0 else 0.0}


def durations_path(graph_path: str) -> str:
    """Where a sandbox graph's per-iteration node durations are kept (next to the graph)."""
    return graph_path + ".iterations.npz"


def write_durations(graph_path: str, iterations: list[int], duration_s: np.ndarray) -> None:
    """Keep the recorder's `iteration_durations` beside `graph_path` (atomically)."""
    import io

    from prism_megatron.util import atomic_write_bytes

    buffer = io.BytesIO()
    np.savez(buffer, iterations=np.asarray(iterations, dtype=np.int64),
             duration_s=np.asarray(duration_s, dtype="f8"))
    atomic_write_bytes(durations_path(graph_path), buffer.getvalue())


def read_durations(graph_path: str) -> Optional[tuple[list[int], np.ndarray]]:
    """The iterations (1-based) a graph's durations came from and each one's node durations, kept
    beside `graph_path`; None where none were kept (trace.keep_iterations off, an older version) or
    the file is unreadable."""
    import zipfile

    try:
        with np.load(durations_path(graph_path)) as data:
            iterations = [int(i) for i in data["iterations"]]
            durations = np.asarray(data["duration_s"], dtype="f8")
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    if durations.ndim != 2 or len(durations) != len(iterations):
        return None
    return iterations, durations
