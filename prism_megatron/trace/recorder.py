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

Two passes (`two_pass=True`): a module boundary costs host time (a hook, a device-clock mark), and
a launch-bound GPU run pays it as device idle that the clock records as compute (measured: a TP2
sandbox on an H200 ran 663-679 ms per iteration untraced, 912-993 ms with a mark at each of its
~4000 module boundaries). So iterations alternate: *labelled* ones (0, 2, ...) cut at every module
boundary, *timed* ones (1, 3, ...) cut only at the *anchors* the graph's dependencies need (spans,
iterations, communication issue and return, waits, cross-stream events) and read no memory; the
listeners in `mode_listeners` detach the module hooks meanwhile. `build` takes every time from a
timed iteration: anchors map one to one (their sequence is checked to be the same program), and the
labelled segments between two anchors are scaled into the timed interval between them. Nodes,
labels, spans, memory samples and MoE tokens come from the labelled neighbour. Without a matching
neighbour the requested iteration is built as recorded (`built` says which way).

Communication arrives live (a listener on the backend's log calls `comm_begin`, `comm_issued` and the
waits as they happen, under a Python clock) or from the backend's native trace, whose entries carry
the marks taken when each operation ran and are replayed at the recorder's next boundary
(trace/comm.py): the prism backend then spends no Python on an operation.

No torch.distributed here: the hooks (trace/attach.py) translate framework events into these calls.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from prism_megatron.graph.model import NodeKind, RoleGraph, RoleGraphBuilder, StringTable
from prism_megatron.trace.comm import CommSteps
from prism_megatron.trace.iterations import Iteration, Node, host_bound, mapped_seconds, same_program
from prism_megatron.world import Role


class RecorderError(RuntimeError):
    """The recording cannot become a graph (e.g. no iteration ran)."""


class Recorder(CommSteps):
    """Collects one rank's events; `build` turns one iteration into a RoleGraph."""

    def __init__(self, clock: Any, allocated_bytes: Callable[[], int],
                 blocking_collectives: Optional[bool] = None,
                 memory_at_module_boundaries: bool = True, two_pass: bool = False) -> None:
        """`blocking_collectives`: the host thread is held until a collective completes (gloo on
        CPU: the next compute depends on the collective itself); default: when the clock is the
        host's. On GPU a collective only joins the compute stream where it is waited for.
        `memory_at_module_boundaries`: sample `allocated_bytes` at every module boundary too, not
        only at spans, communication and waits (on GPU reading the allocator costs host time that a
        launch-bound run pays as device idle; its peak comes from the allocator anyway).
        `two_pass`: alternate labelled and timed iterations (module docstring)."""
        self.clock = clock
        self._device_idle = getattr(clock, "device_idle", None)  # a device clock's probe (build)
        self.blocking = (clock.kind == "cpu") if blocking_collectives is None else blocking_collectives
        self._allocated = allocated_bytes
        self._fine_memory = memory_at_module_boundaries
        self.two_pass = two_pass
        self.mode_listeners: list[Callable[[bool], None]] = []
        """Called with True when labelled iterations begin and False when timed ones do."""
        self.built: dict[str, Any] = {}
        """How the last `build` was made: timing, timed_iteration, labelled_iteration (1-based)."""
        self.iteration_durations: Optional[tuple[list[int], np.ndarray]] = None
        """After a `build`: the iterations (1-based) its durations came from (the pooled ones, or the
        timed one alone) and, per iteration, every node's own duration in it (rows in that order,
        columns the built graph's nodes): each iteration as it ran, where a pooled graph holds the
        median (a realtime run's wall, iteration by iteration, against the replay of that iteration's
        own compute; emulate/run.py)."""
        self._holds: Optional[list] = None  # emulate/holds.py's Hold per ordinal (None: not held)
        self._comm_ordinal = 0
        self._after_issue = -1  # the mark that ended the last operation's issue (and injected wait)
        self._unissued: list[tuple[Iteration, int]] = []  # comm nodes begun, their Work not yet returned
        self._real_peer = False  # one of those has another sandbox among its members
        self._lock = threading.RLock()
        self.setup = Iteration(labelled=True)
        self.iterations: list[Iteration] = []
        self._cur = self.setup
        self._seg_start = self.setup.add(clock.mark(), "iteration")
        self._labels: list[str] = ["host"]
        self._open_spans: list[tuple] = []
        self._pending: dict[str, list[int]] = {}  # stream -> deps of its next compute node
        self._events: dict[int, tuple[Iteration, int]] = {}  # id(device event) -> node it marks
        self._works: dict[int, tuple] = {}  # work key -> (iteration, its nodes, their ordinals, real peer)
        self._waiting: dict[int, Optional[tuple]] = {}  # work key -> its wait's entry, until the wait ends
        self._native: Any = None  # a native trace this recorder reads (`attach_native`)
        self._describe: Optional[Callable[[int], tuple[str, str]]] = None
        self._dtypes: dict[int, str] = {}
        self._replaying = False
        self._taken = 0  # the native trace's entries read so far
        self._deferred: list[tuple] = []  # (entries recorded before it, step, its arguments)

    @property
    def labelling(self) -> bool:
        """Whether module boundaries are cut now (the current iteration is a labelled one)."""
        return self._cur.labelled

    # -- labels and spans ----------------------------------------------------------------------

    def enter(self, label: str) -> None:
        with self._lock:
            if not self._later(self._enter, label):
                self._enter(label)

    def _enter(self, label: str) -> None:
        if self._cur.labelled:
            self._cut(self._fine_memory, None)
        self._labels.append(label)

    def exit(self) -> None:
        with self._lock:
            if not self._later(self._exit):
                self._exit()

    def _exit(self) -> None:
        if self._cur.labelled:
            self._cut(self._fine_memory, None)
        if len(self._labels) > 1:
            self._labels.pop()

    def backward_at(self, label: str) -> None:
        """Autograd reached `label`'s backward: what follows in the open backward span is its."""
        with self._lock:
            if not self._later(self._backward_at, label):
                self._backward_at(label)

    def _backward_at(self, label: str) -> None:
        if self._cur.labelled:
            self._cut(self._fine_memory, None)
        for i in range(len(self._open_spans) - 1, -1, -1):
            if self._open_spans[i][0] == "backward":
                self._labels[self._open_spans[i][5]] = label
                return

    def span_begin(self, name: str, microbatch: int, chunk: int) -> None:
        with self._lock:
            if not self._later(self._span_begin, name, microbatch, chunk, *self._now()):
                self._span_begin(name, microbatch, chunk)

    def _span_begin(self, name: str, microbatch: int, chunk: int, mark: Any = None,
                    stream: Optional[str] = None) -> None:
        now = self._cut(anchor=f"span:{name}", mark=mark, stream=stream)
        self._labels.append(name)
        self._open_spans.append((name, microbatch, chunk, len(self._cur.nodes), now,
                                 len(self._labels) - 1, self._cur))

    def span_end(self) -> None:
        with self._lock:
            if not self._later(self._span_end, *self._now()):
                self._span_end()

    def _span_end(self, mark: Any = None, stream: Optional[str] = None) -> None:
        now = self._cut(anchor="span_end", mark=mark, stream=stream)
        name, microbatch, chunk, first, m0, depth, it = self._open_spans.pop()
        del self._labels[depth:]
        if it is self._cur:
            it.spans.append((name, microbatch, chunk, first, len(it.nodes) - 1, m0, now))

    def begin_iteration(self) -> None:
        with self._lock:
            # the mark first: what the recorder then does with the last iteration's operations is
            # host time of the next iteration (a labelled one, after a timed one)
            early = self.clock.mark() if self._native is not None else None
            self._sync()
            mark = self._cur.marks[self._cut(anchor="iteration", mark=early)]  # ends one, begins the next
            labelled = not self.two_pass or len(self.iterations) % 2 == 0
            self._cur = Iteration(labelled=labelled)
            self._seg_start = self._cur.add(mark, "iteration")
            self.iterations.append(self._cur)
            self._pending = {}
            self._comm_ordinal = 0
            if self._native is not None:
                self._native.begin_iteration(labelled)
            elif self._holds is not None:
                self.clock.hold_iteration()
            previous = self.iterations[-2].labelled if len(self.iterations) > 1 else self.setup.labelled
        if labelled != previous:
            for listener in self.mode_listeners:
                listener(labelled)

    def inject_holds(self, holds: Sequence) -> None:
        """Realtime emulation (and pacing): hold the stream for the k-th communication operation of
        every iteration as `holds[k]` says (emulate/holds.py: until the later of the sandbox's own
        arrival and its ghost peers' arrival, plus the modelled transfer; a synchronous operation at
        its issue, an overlapped one where it is waited for), so the run has the production duty
        cycle. The clock holds its stream and decides the ends on its own timeline."""
        from prism_megatron.comm.native import hold_rows

        self._holds = list(holds)
        (self._native or self.clock).set_holds(hold_rows(self._holds))

    def origin_s(self, iteration: int = -1) -> Optional[float]:
        """The host clock (perf_counter, one clock for every process of a machine) at the start of
        `iteration`, when the device clock is the host's; None otherwise."""
        origin = self.iterations[iteration].marks[0] if self.iterations else None
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
            tokens = list(tokens)
            if not self._later(self._moe_tokens, layer, tokens):
                self._moe_tokens(layer, tokens)

    def _moe_tokens(self, layer: int, tokens: list[int]) -> None:
        microbatch, chunk = self.microbatch
        self._cur.moe.append((layer, microbatch, chunk, tokens))

    # -- cross-stream synchronization (device events) -------------------------------------------

    def event_recorded(self, event: Any, stream: str) -> None:
        """`event` was recorded on `stream`: it completes with that stream's latest node."""
        with self._lock:
            current = self.clock.stream()
            mark = self.clock.mark() if stream == current and self._deferring() else None
            if not self._later(self._event_recorded, event, stream, current, mark):
                self._event_recorded(event, stream, current)

    def _event_recorded(self, event: Any, stream: str, current: str, mark: Any = None) -> None:
        if stream == current:
            self._cut(anchor="event_recorded", stream=current, mark=mark)
        if stream in self._cur.last:
            self._events[id(event)] = (self._cur, self._cur.last[stream], event)

    def event_waited(self, event: Any, stream: str) -> None:
        """`stream` waits for `event`: its next node depends on the node the event marks."""
        with self._lock:
            current = self.clock.stream()
            mark = self.clock.mark() if stream == current and self._deferring() else None
            if not self._later(self._event_waited, event, stream, current, mark):
                self._event_waited(event, stream, current)

    def _event_waited(self, event: Any, stream: str, current: str, mark: Any = None) -> None:
        entry = self._events.get(id(event))
        if entry is None or entry[0] is not self._cur:
            return
        if stream == current:
            self._cut(anchor="event_waited", stream=current, mark=mark)
        self._pending.setdefault(stream, []).append(entry[1])

    def stream_waited(self, waiting: str, waited: str) -> None:
        """`waiting.wait_stream(waited)`: the next node of `waiting` depends on `waited`'s latest."""
        with self._lock:
            current = self.clock.stream()
            cuts = waiting == current or waited == current
            mark = self.clock.mark() if cuts and self._deferring() else None
            if not self._later(self._stream_waited, waiting, waited, current, mark):
                self._stream_waited(waiting, waited, current)

    def _stream_waited(self, waiting: str, waited: str, current: str, mark: Any = None) -> None:
        if waiting == current or waited == current:
            self._cut(anchor="stream_waited", stream=current, mark=mark)
        if waited in self._cur.last and waited != waiting:
            self._pending.setdefault(waiting, []).append(self._cur.last[waited])

    # -- internals -----------------------------------------------------------------------------

    def _cut(self, sample_memory: bool = True, anchor: Optional[str] = "cut",
             stream: Optional[str] = None, mark: Any = None, mem: Optional[int] = None) -> int:
        """Close the compute segment that ends now; return the mark's index. `anchor`: what the mark
        is when it is one (None: a module boundary, cut only in labelled iterations). `stream`: the
        clock's current stream, when the caller has it. `mark`, `mem`: taken earlier (a native
        trace's), instead of now."""
        it = self._cur
        if stream is None:
            stream = self.clock.stream()
        now = it.add(self.clock.mark() if mark is None else mark, anchor)
        last = it.last
        deps = [last[stream]] if stream in last else []
        pending = self._pending.pop(stream, None)
        if pending:
            deps += pending
        last[stream] = len(it.nodes)
        it.nodes.append(Node(NodeKind.COMPUTE, self._labels[-1], stream, self._seg_start, now, deps))
        if sample_memory and it.labelled:
            it.mem.append((now, self._allocated() if mem is None else mem))
        self._seg_start = now
        return now

    # -- output --------------------------------------------------------------------------------

    def build(self, role: Role, representative: int, strings: StringTable, *, iteration: int = -1,
              pool: Sequence[int] = (), **memory: Any) -> RoleGraph:
        """The RoleGraph of training iteration `iteration` (python index; -1: the last).

        `pool`: timed iterations (python indices) whose times are pooled: each interval between two
        consecutive marks of the built iteration lasts the median of that interval over the pool's
        iterations that ran the same program (mapped like a timed neighbour, module docstring). One
        slow moment of the device or the host (a hiccup of another process, a clock dip) then moves
        no node, where a single iteration would carry it into the graph."""
        with self._lock:
            self._sync()
            if not self.iterations:
                raise RecorderError("no training iteration was recorded: iterations are marked by "
                                    "megatron-core's forward_backward_func; call it through "
                                    "get_forward_backward_func() after prism_megatron.install")
            n_it = len(self.iterations)
            if not -n_it <= iteration < n_it:
                raise RecorderError(f"iteration {iteration} was not recorded; the run had {n_it}")
            k = iteration % n_it
            timed, labelled = self._pair(k)
            # The last iteration ends at its last boundary: what follows (end-of-run logging,
            # summaries) is not part of a training iteration.
        it, timed_it = self.iterations[labelled], self.iterations[timed]
        seconds = mapped_seconds(self.clock, it, timed_it)
        timed_seconds = seconds if timed_it is it else None  # its own marks' seconds, when it is one
        pooled = [j for j in pool if j != timed and 0 <= j < n_it and not self.iterations[j].labelled
                  and same_program(it, self.iterations[j], self.iterations[-1])]
        each = [seconds] + [mapped_seconds(self.clock, it, self.iterations[j]) for j in pooled]
        t0 = np.fromiter((n.t0 for n in it.nodes), dtype=np.int64, count=len(it.nodes))
        t1 = np.fromiter((n.t0 if n.t1 is None else n.t1 for n in it.nodes), dtype=np.int64,
                         count=len(it.nodes))
        order = np.argsort([timed, *pooled], kind="stable")
        self.iteration_durations = ([[timed, *pooled][i] + 1 for i in order],
                                    np.maximum(0.0, np.stack([each[i][t1] - each[i][t0] for i in order])))
        if pooled:
            steps = [np.diff(s) for s in each]
            seconds = np.concatenate([seconds[:1], seconds[0] + np.cumsum(np.median(steps, axis=0))])
        self.built = {"timing": "two-pass" if timed != labelled else "single-pass",
                      "timed_iteration": timed + 1, "labelled_iteration": labelled + 1,
                      "pooled_iterations": sorted(j + 1 for j in {timed, *pooled}) if pooled else []}
        if self._device_idle is not None:
            if timed_seconds is None:
                timed_seconds = self.clock.seconds(timed_it.marks, timed_it.marks[0])
            self.built["host_bound"] = host_bound(timed_it, timed_seconds)
        b = RoleGraphBuilder(role, representative, strings)
        seq: dict[str, int] = {}
        for node in it.nodes:
            start = float(seconds[node.t0])
            duration = max(0.0, float(seconds[node.t1 if node.t1 is not None else node.t0]) - start)
            if node.kind == NodeKind.COMPUTE:
                b.compute(node.name, stream=node.stream, start_s=start, duration_s=duration,
                          deps=node.deps)
            else:
                seq[node.group] = seq.get(node.group, -1) + 1
                b.comm(node.op, dim=node.dim, nbytes=node.nbytes, dtype=node.dtype,
                       seq=seq[node.group], stream=node.stream, start_s=start,
                       duration_s=duration, peer_delta=node.peer_delta, deps=node.deps)
        for name, microbatch, chunk, first, last, m0, m1 in it.spans:
            b.span(name, microbatch=microbatch, chunk=chunk, first=first, last=last,
                   start_s=float(seconds[m0]), end_s=float(seconds[m1]))
        for layer, microbatch, chunk, tokens in it.moe:
            b.moe(layer=layer, microbatch=microbatch, chunk=chunk, tokens=tokens)
        mem_t = np.asarray([seconds[m] for m, _ in it.mem], dtype="f8")
        return b.build(mem_t_s=mem_t, mem_bytes=np.asarray([x[1] for x in it.mem], dtype="i8"),
                       **memory)

    def steady_iterations(self) -> list[int]:
        """The timed full iterations (python indices) of the steady state: after the first two (the
        first allocates and warms up, the second often still settles) when at least two remain, else
        after the first; never the last, which has no end."""
        its = self.iterations
        timed = [k for k in range(1, len(its) - 1) if not (self.two_pass and its[k].labelled)]
        later = [k for k in timed if k >= 2]
        return later if len(later) >= 2 else timed

    def median_iteration(self) -> Optional[int]:
        """The steady timed iteration (python index) of median length (`steady_iterations`); None
        when there are fewer than two to choose from."""
        its = self.iterations
        candidates = self.steady_iterations()
        if len(candidates) < 2:
            return None
        spans = {k: float(self.clock.seconds([its[k].marks[-1]], its[k].marks[0])[0]) for k in candidates}
        ordered = sorted(candidates, key=lambda k: spans[k])
        return ordered[(len(ordered) - 1) // 2]

    def _pair(self, k: int) -> tuple[int, int]:
        """(timed, labelled) iteration indices for building iteration `k`."""
        its = self.iterations
        if not self.two_pass:
            return k, k
        timed = k if not its[k].labelled else next(
            (j for j in (k - 1, k + 1) if 0 <= j < len(its) and not its[j].labelled), None)
        if timed is None:
            return k, k
        for j in (k, timed - 1, timed + 1):
            if 0 <= j < len(its) and its[j].labelled and same_program(its[j], its[timed], its[-1]):
                return timed, j
        return (k, k) if its[k].labelled else (timed, timed)

