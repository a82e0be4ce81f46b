"""How communication reaches the recorder (trace/recorder.py, whose state these steps change; a mixin
of `Recorder`, kept apart so each module stays one concern).

Live: the public methods are called as each operation happens (a listener on the backend's log, under
a Python clock), take their marks now and hold through the clock. Native: the backend recorded each
operation's marks in a native trace (comm/native.py), and the recorder replays its entries through the
same steps, with the marks recorded and the holds already made. In a labelled iteration it reads them
at each of its own boundaries. In a timed one (two-pass recording) its own boundaries are kept too,
with their marks, and everything is replayed in program order when the next iteration begins: a timed
iteration then spends no Python on an operation and only a mark and an append on a boundary of the
recorder's, and the reading's host time falls in the labelled iteration that follows, whose times are
not used.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from prism_megatron.graph.model import NodeKind
from prism_megatron.trace.iterations import Node


class CommSteps:
    """The recorder's communication steps, live and replayed (module docstring)."""

    def comm_begin(self, op: str, dim: str, group: str, nbytes: int, dtype: str,
                   peer_delta: Optional[int], real_peer: bool = False) -> None:
        """An operation begins. `real_peer`: another sandbox takes part, so completion can take real
        time after the backend returns (a wait then always takes its mark; see `wait_begin`)."""
        with self._lock:
            self._sync()
            ordinal, idle = self._begin_comm(op, dim, group, nbytes, dtype, peer_delta, real_peer,
                                             self.clock.stream())
            holds = self._holds
            if (ordinal >= 0 and holds is not None and ordinal < len(holds) and holds[ordinal] is not None
                    and holds[ordinal].transfer_s is not None):
                self.clock.stamp(ordinal, idle)  # its begin: the backend's own work is the emulator's

    def _begin_comm(self, op, dim, group, nbytes, dtype, peer_delta, real_peer, stream,
                    mark=None, idle=None, mem=None) -> tuple[int, Optional[bool]]:
        now = self._cut(anchor=f"comm:{op}:{group}", stream=stream, mark=mark, mem=mem)
        it, comm_stream = self._cur, "comm." + dim
        if idle is None and self._device_idle is not None:
            idle = self._device_idle(it.marks[now])
        if idle:
            it.idle.append(now)
        last = it.last
        deps = [last[stream]]  # the compute segment `_cut` just closed
        if comm_stream in last:
            deps.append(last[comm_stream])
        last[comm_stream] = len(it.nodes)
        ordinal = -1
        if it is not self.setup:
            ordinal, self._comm_ordinal = self._comm_ordinal, self._comm_ordinal + 1
        if self._unissued and self._unissued[0][0] is not it:
            self._unissued = []
        self._unissued.append((it, len(it.nodes)))
        self._real_peer = self._real_peer or real_peer
        it.nodes.append(Node(NodeKind.COMM, op, comm_stream, now, None, deps, op, dim, group, nbytes,
                             dtype, peer_delta, ordinal))
        return ordinal, idle

    def comm_event(self, event: Any) -> None:
        """`comm_begin` for a `CommEvent` of the prism backend (a `CommLog` listener)."""
        self.comm_begin(event.op, event.dim, event.group_id, event.nbytes, event.dtype,
                        event.peer_delta, event.real_peer)

    def comm_issued(self, work: Any) -> None:
        """The backend returned `work` (its id, or the Work) for the operations begun since its last
        return (one, or those of a coalesced call); their time so far was theirs (the last one's end
        is now)."""
        with self._lock:
            self._sync()
            self._issue(work, self.clock.mark(), self._hold_at_issue)

    def _hold_at_issue(self, ordinals: list[int]) -> Any:
        """Hold the operations issued now (live): returns the mark after a hold that spun, or None."""
        held = [k for k in ordinals if 0 <= k < len(self._holds) and self._holds[k] is not None]
        if not held:
            return None
        spin = any(not self._holds[k].at_wait for k in held)
        self.clock.hold(held, spin)
        return self.clock.mark() if spin else None

    def _issue(self, work: Any, mark: Any, after: Callable[[list[int]], Any]) -> None:
        it = self._cur
        group = [i for owner, i in self._unissued if owner is it]
        self._unissued = []
        real_peer, self._real_peer = self._real_peer, False
        if not group:
            return
        now = it.add(mark, "issued")
        it.nodes[group[-1]].t1 = now
        self._seg_start = now
        ordinals = [it.nodes[i].ordinal for i in group]
        if self._holds is not None and it is not self.setup:
            delayed = after(ordinals)
            if delayed is not None:  # the hold belongs to no node, as a blocked wait does not: the
                # replay computes it; the operation's own (local) part is what ran before it
                self._seg_start = it.add(delayed, "delayed")
        self._after_issue = self._seg_start
        if self.blocking:  # the call returned when the operations were done
            self._pending.setdefault(self.clock.stream(), []).extend(
                i for i in group if it.nodes[i].peer_delta is None)
        if work is not None:
            self._works[_key(work)] = (it, group, ordinals, real_peer)

    def wait_begin(self, work: Any) -> Optional[tuple]:
        with self._lock:
            self._sync()
            return self._wait_begin(work, self.clock.mark)

    def _wait_begin(self, work: Any, mark: Callable[[], Any]) -> Optional[tuple]:
        entry = self._works.pop(_key(work), None)
        if entry is None:
            return None
        it, group, ordinals, real_peer = entry
        # Waited right after its issue (a synchronous call): nothing ran in between, so no node
        # and no mark; the wait itself only ends when the work is done, which `blocking` covers.
        at_once = (it is self._cur and group[-1] == len(it.nodes) - 1
                   and self._seg_start == self._after_issue)
        if not at_once:
            self._cut(anchor="wait", mark=mark())  # what ran since the issue (overlapped work)
        return it, group, at_once, ordinals, real_peer

    def wait_end(self, entry: Optional[tuple]) -> None:
        with self._lock:
            self._sync()
            self._wait_end(entry, self.clock.mark, self.clock.hold_wait)

    def _wait_end(self, entry: Optional[tuple], mark: Callable[[], Any],
                  hold: Optional[Callable[[list[int]], None]]) -> None:
        if entry is None:
            return
        it, group, at_once, ordinals, real_peer = entry
        if it is self._cur:
            self._pending.setdefault(self.clock.stream(), []).extend(group)
        held = [k for k in ordinals if 0 <= k < len(self._holds) and self._holds[k] is not None
                and self._holds[k].at_wait] if self._holds is not None and it is self._cur else ()
        if held:  # the replay's stream waits here: belongs to no node
            if hold is not None:
                hold(held)
        elif at_once and not real_peer:
            return  # the issue's mark stands: what follows is the next segment's
        # (with another sandbox in the operation a real transfer can run after the backend
        # returned, and the waiting stream stalls for it: that stall belongs to no node, so the
        # next segment starts at the wait's end, not at the issue)
        self._seg_start = self._cur.add(mark(), "waited")

    def wait_event(self, work: Any, phase: int) -> None:
        """A work's wait begins (phase 0) or ends (1): a `CommLog` wait listener (live)."""
        with self._lock:
            if phase == 0:
                self._waiting[_key(work)] = self.wait_begin(work)
            else:
                self.wait_end(self._waiting.pop(_key(work), None))

    # -- the native trace ------------------------------------------------------------------------


    def attach_native(self, trace: Any, describe: Callable[[int], tuple[str, str]],
                      dtypes: dict[int, str]) -> None:
        """Read the operations from `trace` (comm/native.py `Trace`, on this recorder's clock):
        `describe(group index)` gives a group's (dim, group id), `dtypes` the dtype names by code."""
        with self._lock:
            self._native, self._describe, self._dtypes = trace, describe, dtypes
            trace.set_memory_reader(self._allocated)

    def _deferring(self) -> bool:
        return self._native is not None and not self._cur.labelled and not self._replaying

    def _later(self, step: Callable, *args: Any) -> bool:
        """In a timed iteration with a native trace, keep `step(*args)` for the next reading, in program
        order with the backend's operations (True); else first read what the trace holds (False)."""
        if self._deferring():
            self._deferred.append((self._native.boundary(), step, args))
            return True
        self._sync()
        return False

    def _now(self) -> tuple:
        """(mark, stream) now for a boundary kept for later; nothing for one that runs at once."""
        return (self.clock.mark(), self.clock.stream()) if self._deferring() else ()

    def _sync(self) -> None:
        """Read the operations the native trace recorded since the last reading, and run the boundaries
        kept meanwhile, in program order (a boundary also tells the trace that one came, for its
        waits)."""
        native = self._native
        if native is None or self._replaying:
            return
        total = native.boundary()
        if total == self._taken and not self._deferred:
            return
        from prism_megatron.comm import native as n

        entries = np.frombuffer(native.take(), dtype=n.ENTRY_DTYPE).tolist() if total > self._taken else []
        first, self._taken = self._taken, self._taken + len(entries)
        kept, self._deferred = self._deferred, []
        self._replaying = True
        try:
            done = 0
            for position, step, args in kept:
                self._replay(entries[done:position - first])
                done = max(done, position - first)
                step(*args)
            self._replay(entries[done:])
        finally:
            self._replaying = False

    def _replay(self, entries: list) -> None:
        from prism_megatron.comm import native as n

        ops, name_of = n.load().OP_NAMES, self.clock.stream_name
        for (kind, op, flags, dtype, group, peer_delta, ordinal, value, mark, t, mark2, t2, stream,
             mem) in entries:
            at = mark if mark >= 0 else t
            if kind == n.BEGIN:
                dim, group_id = self._describe(group)
                self._begin_comm(ops[op], dim, group_id, value, self._dtypes.get(dtype, str(dtype)),
                                 None if peer_delta == n.NO_PEER_DELTA else peer_delta,
                                 bool(flags & n.REAL_PEER), name_of(stream), mark=at,
                                 idle=bool(flags & n.IDLE) if self._device_idle is not None else None,
                                 mem=mem if flags & n.HAS_MEM else None)
            elif kind == n.ISSUE:
                delayed = (mark2 if mark2 >= 0 else t2) if flags & n.HAS_MARK2 else None
                self._issue(value, at, lambda ordinals, delayed=delayed: delayed)
            elif kind == n.WAIT_BEGIN:
                self._waiting[value] = self._wait_begin(value, self._recorded(at, flags))
            else:
                self._wait_end(self._waiting.pop(value, None), self._recorded(at, flags), None)

    def _recorded(self, at: Any, flags: int) -> Callable[[], Any]:
        """A recorded mark (a wait's), or, where the trace took none, the latest mark: the trace
        takes one wherever the recorder's rule needs one, so the fallback is for safety only."""
        from prism_megatron.comm.native import HAS_MARK

        return (lambda: at) if flags & HAS_MARK else (lambda: self._cur.marks[-1])


def _key(work: Any) -> int:
    """A work's key: its native id, or the object's identity."""
    return work if isinstance(work, int) else id(work)
