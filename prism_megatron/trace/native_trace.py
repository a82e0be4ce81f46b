"""The recorder's reading of a native trace (comm/native.py): the operations the prism backend recorded,
replayed into the recorder through the same steps as live calls.

In a labelled iteration the recorder reads them at each of its own boundaries. In a timed one (two-pass
recording) its own boundaries are kept too, with their marks, and everything is replayed in program
order when the next iteration begins: a timed iteration then spends no Python on an operation and only
a mark and an append on a boundary of the recorder's, and the reading's host time falls in the
labelled iteration that follows, whose times are not used.

A mixin of `Recorder` (trace/recorder.py), which owns the state these steps change; kept apart so that
the recorder's own module stays one screenful of semantics per concern.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


class NativeTraceReader:
    """`attach_native` and what it needs (module docstring)."""

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
