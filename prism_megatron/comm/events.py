"""Every operation the prism backend executes, as an event; and the per-(op, dim) counters.

The backend (comm/native.py) counts every operation natively; `CommLog.rows()` reads those counters.
Listeners hear each operation as it happens, from the native path into Python (so a listener costs
Python per operation: tests and recorders on a Python clock use them; a recorder on a device or host
clock reads the native trace in batches instead, trace/recorder.py `attach_native`):

- `listeners`: called with a `CommEvent` when an operation begins;
- `issue_listeners`: called with the operation's work id when the backend returns its Work (for a
  coalesced call: once, for all the operations it ran);
- `wait_listeners`: called with (work id, 0) when that work's first `wait()` begins and (work id, 1)
  when it ends.

Bytes follow nccl-tests' "size" convention: the local buffer of the operation
(all_reduce/broadcast/reduce: the tensor; all_gather/gather: the full output; reduce_scatter/scatter:
the full input; all_to_all: the local input; send/recv: the tensor).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional


class CommEvent(NamedTuple):
    """One operation on one sandbox rank, in issue order."""

    op: str
    """Operation name: all_reduce, all_gather, reduce_scatter, broadcast, reduce, gather, scatter,
    all_to_all, send, recv, barrier."""
    dim: str
    """Group dim (tp, pp, dp, ...; `world` for the default group; `other` if no megatron dim)."""
    group_id: str
    nbytes: int
    dtype: str
    seq: int
    """Sequence number of this call on its group (same on every real member)."""
    members: tuple[int, ...]
    ghosts: int
    """How many members of the group are ghosts."""
    peer: Optional[int] = None
    """Virtual rank of the p2p peer (send/recv only)."""
    reduce_op: Optional[str] = None
    peer_delta: Optional[int] = None
    """p2p only: the peer's signed distance from this rank along the group, in (-n/2, n/2]
    (+1: the next member, -1: the previous)."""
    real_peer: bool = False
    """Another sandbox takes part: the p2p peer is one, or the group has more than one."""


class GroupInfo(NamedTuple):
    """What the log says of one group of the session (its index is the native backend's)."""

    dim: str
    group_id: str
    members: tuple[int, ...]
    ghosts: int


class _Watched(list):
    """A list of callables that tells its owner when it becomes empty or not (the native path asks
    Python only while someone listens)."""

    def __init__(self, changed: Callable[[], None]) -> None:
        super().__init__()
        self._changed = changed

    def _after(self, result: Any) -> Any:
        self._changed()
        return result

    def append(self, item: Any) -> None:
        self._after(super().append(item))

    def extend(self, items: Any) -> None:
        self._after(super().extend(items))

    def insert(self, index: Any, item: Any) -> None:
        self._after(super().insert(index, item))

    def remove(self, item: Any) -> None:
        self._after(super().remove(item))

    def pop(self, *args: Any) -> Any:
        return self._after(super().pop(*args))

    def clear(self) -> None:
        self._after(super().clear())

    def __delitem__(self, key: Any) -> None:
        self._after(super().__delitem__(key))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._after(super().__setitem__(key, value))


class CommLog:
    """The session's operations: counters per (op, dim) and the listeners (module docstring)."""

    def __init__(self) -> None:
        self.listeners = _Watched(self._rewire)
        self.issue_listeners = _Watched(self._rewire)
        self.wait_listeners = _Watched(self._rewire)
        self._native: Any = None
        self._groups: list[GroupInfo] = []
        self._ops: tuple[str, ...] = ()
        self._dtypes: dict[int, str] = {}
        self._cpu_timed = False

    def bind(self, native: Any, groups: list[GroupInfo], ops: tuple[str, ...], dtypes: dict[int, str]) -> None:
        """Count through `native` (the session's native half) with `groups` its group table."""
        self._native, self._groups, self._ops, self._dtypes = native, groups, ops, dtypes
        native.cpu_timed = self._cpu_timed
        self._rewire()

    def _rewire(self) -> None:
        if self._native is None:
            return
        if self.listeners or self.issue_listeners or self.wait_listeners:
            self._native.set_listeners(self._emit, self._issued, self._waited)
        else:
            self._native.set_listeners(None, None, None)

    def _emit(self, group: int, op: int, nbytes: int, dtype: int, seq: int, peer: int, reduce: int,
              peer_delta: Optional[int], real_peer: bool) -> None:
        from prism_megatron.comm.native import REDUCE_NAMES

        info = self._groups[group]
        event = CommEvent(self._ops[op], info.dim, info.group_id, nbytes, self._dtypes.get(dtype, str(dtype)), seq,
                          info.members, info.ghosts, None if peer < 0 else peer,
                          None if reduce < 0 else REDUCE_NAMES[reduce], peer_delta, real_peer)
        for listener in tuple(self.listeners):
            listener(event)

    def _issued(self, work_id: int) -> None:
        for listener in tuple(self.issue_listeners):
            listener(work_id)

    def _waited(self, work_id: int, phase: int) -> None:
        for listener in tuple(self.wait_listeners):
            listener(work_id, phase)

    @property
    def cpu_timed(self) -> bool:
        """Count `host_cpu_s` (fake execution sets it: two clock reads per operation otherwise)."""
        return self._cpu_timed

    @cpu_timed.setter
    def cpu_timed(self, value: bool) -> None:
        self._cpu_timed = bool(value)
        if self._native is not None:
            self._native.cpu_timed = self._cpu_timed

    @property
    def host_s(self) -> float:
        """Host time spent inside the backend's operations (ghost folding, recording, any real exchange
        between sandboxes; not the holds), for the emulator's overhead figure."""
        return self._native.host_s if self._native is not None else 0.0

    @property
    def host_cpu_s(self) -> float:
        """The same operations' CPU time on their threads (what fake execution subtracts from the
        program's host work: unlike wall time, it does not grow while another process has the CPU)."""
        return self._native.host_cpu_s if self._native is not None else 0.0

    @property
    def total_calls(self) -> int:
        return sum(row["calls"] for row in self.rows())

    def rows(self) -> list[dict]:
        """One row per (op, dim): {"op", "dim", "calls", "bytes"}, sorted."""
        if self._native is None:
            return []
        calls: dict[tuple[str, str], int] = {}
        nbytes: dict[tuple[str, str], int] = {}
        for group, op, count, size in self._native.counts():
            key = (self._ops[op], self._groups[group].dim)
            calls[key] = calls.get(key, 0) + count
            nbytes[key] = nbytes.get(key, 0) + size
        return [{"op": op, "dim": dim, "calls": calls[(op, dim)], "bytes": nbytes[(op, dim)]}
                for op, dim in sorted(calls)]
