"""Every operation the prism backend executes, as an event; and the per-(op, dim) counters.

`CommEvent` is what later stages (the recorder, the ghost oracle) subscribe to through
`CommLog.listeners` (called when an operation begins) and `CommLog.issue_listeners` (called with
the `Work` the backend returns for it, so that a later `wait()` on that work can be attributed).
Bytes follow nccl-tests' "size" convention: the local buffer of the operation
(all_reduce/broadcast/reduce: the tensor; all_gather/gather: the full output; reduce_scatter/scatter:
the full input; all_to_all: the local input; send/recv: the tensor).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional


class CommEvent(NamedTuple):
    """One operation on one sandbox rank, in issue order.

    A named tuple, not a dataclass: one is made per operation between a rank's kernels, where a
    frozen dataclass's per-field `object.__setattr__` costs several microseconds with cold caches."""

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


@dataclass
class CommLog:
    """Counts calls and bytes per (op, dim) and forwards each event to `listeners`."""

    listeners: list[Callable[[CommEvent], None]] = field(default_factory=list)
    issue_listeners: list[Callable[[object], None]] = field(default_factory=list)
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    """Calls per (op, dim), as of the last fold (`rows()` and `total_calls` fold first)."""
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    host_s: float = 0.0
    """Host time spent inside the backend's operations (ghost folding, logging, and any real
    exchange between sandboxes), for the emulator's overhead figure."""
    host_cpu_s: float = 0.0
    """The same operations' CPU time on their threads (what fake execution subtracts from the
    program's host work: unlike wall time, it does not grow while another process has the CPU).
    Counted only where `cpu_timed` (two clock reads of 0.5 us each per operation otherwise)."""
    cpu_timed: bool = False
    """Count `host_cpu_s` (fake execution sets it)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    running: threading.local = field(default_factory=threading.local, repr=False)
    """Per thread, `depth`: operations of this log now running on it (a coalesced one runs single
    ones inside; an autograd thread's collective is its own)."""

    _unfolded: list[CommEvent] = field(default_factory=list, repr=False)
    """Events not yet counted into `calls` and `bytes`: an append per operation instead of a lock
    and two counter updates (which showed in a py-spy profile of the VM's tiny rank, its caches cold
    between a rank's kernels); folded on every read and every `FOLD_EVERY` events."""

    FOLD_EVERY = 4096

    def record(self, event: CommEvent) -> None:
        unfolded = self._unfolded
        unfolded.append(event)
        if len(unfolded) >= self.FOLD_EVERY:
            self._fold()
        for listener in self.listeners:
            listener(event)

    def _fold(self) -> None:
        """Count the unfolded events. An event appended by another thread meanwhile lies past the
        length read here and stays for the next fold (the slice's deletion is one step under the
        GIL)."""
        with self._lock:
            unfolded = self._unfolded
            n = len(unfolded)
            calls, nbytes = self.calls, self.bytes
            for event in unfolded[:n]:
                key = (event.op, event.dim)
                calls[key] += 1
                nbytes[key] += event.nbytes
            del unfolded[:n]

    def issued(self, work: object) -> None:
        """The operations begun since the last announcement returned `work` (one operation, or the
        operations of a coalesced call; a completed Work if synchronous)."""
        for listener in self.issue_listeners:
            listener(work)

    @property
    def total_calls(self) -> int:
        self._fold()
        return sum(self.calls.values())

    def rows(self) -> list[dict]:
        """One row per (op, dim): {"op", "dim", "calls", "bytes"}, sorted."""
        self._fold()
        return [{"op": op, "dim": dim, "calls": self.calls[(op, dim)], "bytes": self.bytes[(op, dim)]}
                for op, dim in sorted(self.calls)]
