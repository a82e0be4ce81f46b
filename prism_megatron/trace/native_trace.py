"""The recorder's reading of a native trace (comm/native.py): the operations the prism backend recorded,
replayed into the recorder at its next boundary through the same steps as live calls.

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

    def _sync(self) -> None:
        """A boundary of the recorder's own: first take in the operations the native trace recorded
        since the last one (which also tells the trace that a boundary came, for its waits)."""
        native = self._native
        if native is None or self._replaying:
            return
        if native.boundary():
            self._replay(native.take())

    def _replay(self, data: bytes) -> None:
        from prism_megatron.comm import native as n

        ops, name_of = n.load().OP_NAMES, self.clock.stream_name
        self._replaying = True
        try:
            for (kind, op, flags, dtype, group, peer_delta, ordinal, value, mark, t, mark2, t2, stream,
                 mem) in np.frombuffer(data, dtype=n.ENTRY_DTYPE).tolist():
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
        finally:
            self._replaying = False

    def _recorded(self, at: Any, flags: int) -> Callable[[], Any]:
        """A recorded mark (a wait's), or, where the trace took none, the latest mark: the trace
        takes one wherever the recorder's rule needs one, so the fallback is for safety only."""
        from prism_megatron.comm.native import HAS_MARK

        return (lambda: at) if flags & HAS_MARK else (lambda: self._cur.marks[-1])
