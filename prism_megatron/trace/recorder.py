"""The recorder: one rank's program as it runs, turned into its role's graph.

Everything the hooks observe arrives here as a *boundary*: a module or span starts or ends, a
collective is issued, asynchronous work is waited for, an iteration begins. A boundary closes the
current compute segment, which becomes one compute node named by the innermost open label (a
module path such as `decoder.layers.0.self_attention`, its backward `...self_attention.backward`,
`optimizer.step`, or a pipeline span `forward`/`backward`). So compute nodes are module-level ops by
default and finer when finer labels are pushed (aten ops on request), and the node sequence is a
deterministic function of the program, not of timing.

Dependencies: each node depends on the previous node of its stream (program order); a collective
or p2p depends on the compute node that issued it; a stream that waits for a device event (or for
another stream) depends on the node the event marks; the first compute node after `wait()` on an
operation's work depends on that operation (for synchronous calls torch itself waits at once). A
synchronous call waited right after it returns adds no node for the instant between the two.

A communication node lasts from its issue to the backend's return: on a slice that is the local
part of the operation (for ghost peers, folding in their contributions); completion as such is the
replay's business (issue [C]), expressed here by the dependency. The time a blocked `wait()` spends
is not compute either: it belongs to nobody's node and reappears in the replay as the dependency. So
the compute and communication nodes of a stream never overlap, and their durations add up to the
device's busy-or-launching time. Times are marks of the device clock (trace/clock.py) resolved at the end.

No torch.distributed here: the hooks (trace/attach.py) translate framework events into these calls.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from prism_megatron.graph.model import NodeKind, RoleGraph, RoleGraphBuilder, StringTable
from prism_megatron.world import Role


@dataclass(slots=True)
class _Node:
    kind: NodeKind
    name: str
    stream: str
    t0: Any
    t1: Any
    deps: list[int]
    op: str = ""
    dim: str = ""
    group: str = ""
    nbytes: int = 0
    dtype: str = ""
    peer_delta: Optional[int] = None


@dataclass
class _Iteration:
    origin: Any
    nodes: list[_Node] = field(default_factory=list)
    last: dict[str, int] = field(default_factory=dict)  # stream -> its latest node
    spans: list[tuple] = field(default_factory=list)    # (name, microbatch, chunk, first, last, t0, t1)
    moe: list[tuple] = field(default_factory=list)      # (layer, microbatch, chunk, tokens)
    mem: list[tuple[Any, int]] = field(default_factory=list)


class RecorderError(RuntimeError):
    """The recording cannot become a graph (e.g. no iteration ran)."""


class Recorder:
    """Collects one rank's events; `build` turns one iteration into a RoleGraph."""

    def __init__(self, clock: Any, allocated_bytes: Callable[[], int],
                 blocking_collectives: Optional[bool] = None,
                 memory_at_module_boundaries: bool = True) -> None:
        """`blocking_collectives`: the host thread is held until a collective completes (gloo on
        CPU: the next compute depends on the collective itself); default: when the clock is the
        host's. On GPU a collective only joins the compute stream where it is waited for.
        `memory_at_module_boundaries`: sample `allocated_bytes` at every module boundary too, not
        only at spans, communication and waits (on GPU reading the allocator costs host time that a
        launch-bound run pays as device idle; its peak comes from the allocator anyway)."""
        self.clock = clock
        self.blocking = (clock.kind == "cpu") if blocking_collectives is None else blocking_collectives
        self._allocated = allocated_bytes
        self._fine_memory = memory_at_module_boundaries
        self._delays: Optional[Sequence[float]] = None
        self._comm_ordinal = 0
        self._lock = threading.RLock()
        now = clock.mark()
        self.setup = _Iteration(origin=now)
        self.iterations: list[_Iteration] = []
        self._cur = self.setup
        self._seg_start = now
        self._labels: list[str] = ["host"]
        self._open_spans: list[tuple] = []
        self._pending: dict[str, list[int]] = {}  # stream -> deps of its next compute node
        self._events: dict[int, tuple[_Iteration, int]] = {}  # id(device event) -> node it marks
        self._works: dict[int, tuple[Any, _Iteration, int]] = {}

    # -- labels and spans ----------------------------------------------------------------------

    def enter(self, label: str) -> None:
        with self._lock:
            self._cut(self._fine_memory)
            self._labels.append(label)

    def exit(self) -> None:
        with self._lock:
            self._cut(self._fine_memory)
            if len(self._labels) > 1:
                self._labels.pop()

    def backward_at(self, label: str) -> None:
        """Autograd reached `label`'s backward: what follows in the open backward span is its."""
        with self._lock:
            self._cut(self._fine_memory)
            for i in range(len(self._open_spans) - 1, -1, -1):
                if self._open_spans[i][0] == "backward":
                    self._labels[self._open_spans[i][5]] = label
                    return

    def span_begin(self, name: str, microbatch: int, chunk: int) -> None:
        with self._lock:
            now = self._cut()
            self._labels.append(name)
            self._open_spans.append((name, microbatch, chunk, len(self._cur.nodes), now,
                                     len(self._labels) - 1, self._cur))

    def span_end(self) -> None:
        with self._lock:
            now = self._cut()
            name, microbatch, chunk, first, t0, depth, it = self._open_spans.pop()
            del self._labels[depth:]
            if it is self._cur:
                it.spans.append((name, microbatch, chunk, first, len(it.nodes) - 1, t0, now))

    def begin_iteration(self) -> None:
        with self._lock:
            now = self._cut()
            self._cur = _Iteration(origin=now)
            self.iterations.append(self._cur)
            self._pending = {}
            self._comm_ordinal = 0

    def inject_delays(self, delays: Sequence[float]) -> None:
        """Realtime emulation: hold the stream `delays[k]` seconds inside the k-th communication
        operation of every iteration (the wait for ghost peers and the modelled transfer that the
        replay computed), so the run has the production duty cycle."""
        self._delays = list(delays)

    def origin_s(self, iteration: int = -1) -> Optional[float]:
        """The host clock (perf_counter, one clock for every process of a machine) at the start of
        `iteration`, when the device clock is the host's; None otherwise."""
        origin = self.iterations[iteration].origin if self.iterations else None
        return float(origin) if isinstance(origin, float) else None

    @property
    def label(self) -> str:
        """The innermost open label (what a compute segment ending now is named)."""
        return self._labels[-1]

    @property
    def microbatch(self) -> tuple[int, int]:
        """(microbatch, chunk) of the innermost open span, (-1, -1) outside spans."""
        return self._open_spans[-1][1:3] if self._open_spans else (-1, -1)

    def moe_tokens(self, layer: int, tokens: list[int]) -> None:
        with self._lock:
            microbatch, chunk = self.microbatch
            self._cur.moe.append((layer, microbatch, chunk, list(tokens)))

    # -- communication -------------------------------------------------------------------------

    def comm_begin(self, *, op: str, dim: str, group: str, nbytes: int, dtype: str,
                   peer_delta: Optional[int]) -> None:
        with self._lock:
            now = self._cut()
            it, stream = self._cur, f"comm.{dim}"
            deps = [it.last[s] for s in (self.clock.stream(), stream) if s in it.last]
            it.last[stream] = len(it.nodes)
            it.nodes.append(_Node(NodeKind.COMM, op, stream, now, None, deps, op=op, dim=dim,
                                  group=group, nbytes=nbytes, dtype=dtype, peer_delta=peer_delta))

    def comm_issued(self, work: Any) -> None:
        """The backend returned `work` for the operation begun last; its time so far was the op's."""
        with self._lock:
            now = self.clock.mark()
            it = self._cur
            node = it.nodes[-1]
            if node.kind != NodeKind.COMM:
                return
            if self._delays is not None and it is not self.setup:
                k, self._comm_ordinal = self._comm_ordinal, self._comm_ordinal + 1
                if k < len(self._delays) and self._delays[k] > 0:
                    self.clock.delay(self._delays[k])
                    now = self.clock.mark()
            node.t1 = now
            self._seg_start = now
            if self.blocking and node.peer_delta is None:  # the call returned when the op was done
                self._pending.setdefault(self.clock.stream(), []).append(len(it.nodes) - 1)
            if work is not None:
                self._works[id(work)] = (work, it, len(it.nodes) - 1)

    def wait_begin(self, work: Any) -> Optional[tuple[_Iteration, int]]:
        with self._lock:
            entry = self._works.pop(id(work), None)
            if entry is None:
                return None
            self._cut()  # what ran since the issue (overlapped work, or just the call's return)
            return entry[1], entry[2]

    def wait_end(self, entry: Optional[tuple[_Iteration, int]]) -> None:
        if entry is None:
            return
        with self._lock:
            it, index = entry
            now = self.clock.mark()
            if it is self._cur:
                self._pending.setdefault(self.clock.stream(), []).append(index)
            self._seg_start = now

    # -- cross-stream synchronization (device events) -------------------------------------------

    def event_recorded(self, event: Any, stream: str) -> None:
        """`event` was recorded on `stream`: it completes with that stream's latest node."""
        with self._lock:
            if stream == self.clock.stream():
                self._cut()
            if stream in self._cur.last:
                self._events[id(event)] = (self._cur, self._cur.last[stream])

    def event_waited(self, event: Any, stream: str) -> None:
        """`stream` waits for `event`: its next node depends on the node the event marks."""
        with self._lock:
            entry = self._events.get(id(event))
            if entry is None or entry[0] is not self._cur:
                return
            if stream == self.clock.stream():
                self._cut()
            self._pending.setdefault(stream, []).append(entry[1])

    def stream_waited(self, waiting: str, waited: str) -> None:
        """`waiting.wait_stream(waited)`: the next node of `waiting` depends on `waited`'s latest."""
        with self._lock:
            if waiting == self.clock.stream() or waited == self.clock.stream():
                self._cut()
            if waited in self._cur.last and waited != waiting:
                self._pending.setdefault(waiting, []).append(self._cur.last[waited])

    # -- internals -----------------------------------------------------------------------------

    def _cut(self, sample_memory: bool = True) -> Any:
        """Close the compute segment that ends now; return the mark."""
        now = self.clock.mark()
        it, stream = self._cur, self.clock.stream()
        deps = ([it.last[stream]] if stream in it.last else []) + self._pending.pop(stream, [])
        it.last[stream] = len(it.nodes)
        it.nodes.append(_Node(NodeKind.COMPUTE, self._labels[-1], stream, self._seg_start, now, deps))
        if sample_memory:
            it.mem.append((now, self._allocated()))
        self._seg_start = now
        return now

    # -- output --------------------------------------------------------------------------------

    def build(self, role: Role, representative: int, strings: StringTable, *, iteration: int = -1,
              **memory: Any) -> RoleGraph:
        """The RoleGraph of training iteration `iteration` (python index; -1: the last)."""
        with self._lock:
            if not self.iterations:
                raise RecorderError("no training iteration was recorded: iterations are marked by "
                                    "megatron-core's forward_backward_func; call it through "
                                    "get_forward_backward_func() after prism_megatron.install")
            try:
                it = self.iterations[iteration]
            except IndexError:
                raise RecorderError(f"iteration {iteration} was not recorded; the run had "
                                    f"{len(self.iterations)}") from None
            # The last iteration ends at its last boundary: what follows (end-of-run logging,
            # summaries) is not part of a training iteration.
        marks = [n.t0 for n in it.nodes] + [n.t1 if n.t1 is not None else n.t0 for n in it.nodes]
        marks += [m[0] for m in it.mem] + [s[5] for s in it.spans] + [s[6] for s in it.spans]
        seconds = self.clock.seconds(marks, it.origin)
        n, m = len(it.nodes), len(it.mem)
        start, end = seconds[:n], seconds[n:2 * n]
        b = RoleGraphBuilder(role, representative, strings)
        seq: dict[str, int] = {}
        for i, node in enumerate(it.nodes):
            duration = max(0.0, float(end[i] - start[i]))
            if node.kind == NodeKind.COMPUTE:
                b.compute(node.name, stream=node.stream, start_s=float(start[i]), duration_s=duration,
                          deps=node.deps)
            else:
                seq[node.group] = seq.get(node.group, -1) + 1
                b.comm(node.op, dim=node.dim, nbytes=node.nbytes, dtype=node.dtype,
                       seq=seq[node.group], stream=node.stream, start_s=float(start[i]),
                       duration_s=duration, peer_delta=node.peer_delta, deps=node.deps)
        span_t = seconds[2 * n + m:]
        k = len(it.spans)
        for j, (name, microbatch, chunk, first, last, _, _) in enumerate(it.spans):
            b.span(name, microbatch=microbatch, chunk=chunk, first=first, last=last,
                   start_s=float(span_t[j]), end_s=float(span_t[k + j]))
        for layer, microbatch, chunk, tokens in it.moe:
            b.moe(layer=layer, microbatch=microbatch, chunk=chunk, tokens=tokens)
        mem_t = seconds[2 * n:2 * n + m]
        return b.build(mem_t_s=mem_t, mem_bytes=np.asarray([x[1] for x in it.mem], dtype="i8"),
                       **memory)
