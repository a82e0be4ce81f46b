"""Device clocks for the recorder: marks taken in program order, resolved to seconds at the end.

On GPU a host timestamp of an asynchronous launch says when the launch happened, not when the kernel
ran, so `CudaClock` records a CUDA event on the current stream at each mark and resolves all of them
once, after a synchronize, with `elapsed_time` relative to the first mark: every duration is measured
on the device's own clock. `CpuClock` uses `time.perf_counter`, where work is synchronous.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import numpy as np


class DelayAccount:
    """What the injected holds were asked for (their goal less the time they began) and what they
    lasted."""

    def __init__(self) -> None:
        self.count = 0
        self.planned_s = 0.0
        self.measured_s = 0.0

    def add(self, planned_s: float, measured_s: float) -> None:
        self.count += 1
        self.planned_s += planned_s
        self.measured_s += measured_s

    def report(self, accrued_s: float = 0.0, absorbed_s: float = 0.0) -> dict:
        """{"count", "planned_s", "measured_s", "error_pct", "overhead_accrued_s",
        "overhead_absorbed_s"}: the last two, the emulator's own time the holds ran up and paid back
        (emulate/holds.py), are the book's, given here."""
        return {"count": self.count, "planned_s": self.planned_s, "measured_s": self.measured_s,
                "error_pct": (self.measured_s / self.planned_s - 1) * 100 if self.planned_s > 0 else None,
                "overhead_accrued_s": accrued_s, "overhead_absorbed_s": absorbed_s}


def HoldBook(rows: Sequence[Optional[tuple]]) -> Any:  # noqa: N802 - it makes the native book
    """An iteration's holds on one clock: `rows[k]` = (self_s, terms[, transfer_s]) or (self_s, terms,
    at_wait, transfer_s) of the k-th communication operation, None where it is not held.

    Times are kept on the job's timeline: the clock's time less `debt`, the emulator's own time run
    up so far this iteration (emulate/holds.py). `plan` sets an operation's end to the latest of its
    own part (its stamped begin plus transfer_s, or without a stamp `now + self_s`) and each term
    (anchor, ghost_s) as (end of anchor + ghost_s), anchor -1 being the iteration's start; an
    operation issued past that end runs up the debt by the difference. `goal` is where a hold of
    `ordinals` spins to on the clock, after paying back what it can of the debt. The arithmetic is the
    native trace's (comm/native.py: one implementation for every host clock)."""
    from prism_megatron.comm import native

    def row(r):
        if r is None:
            return None
        if len(r) == 4:
            return (float(r[0]), tuple(r[1]), bool(r[2]), r[3])
        return (float(r[0]), tuple(r[1]), False, r[2] if len(r) > 2 else None)

    return native.load().HoldBook([row(r) for r in rows])


class HostHolds:
    """Holds on a clock whose stream is the calling thread (its `now()` and `wait_until()`)."""

    _book: Any = None

    def set_holds(self, rows: Sequence[Optional[tuple]]) -> None:
        self._book = HoldBook(rows)

    def hold_iteration(self) -> None:
        self._book.begin(self.now())

    def stamp(self, ordinal: int, idle: Optional[bool] = None) -> None:
        """The held operation `ordinal` begins now (`idle`: a device clock's probe, unused here)."""
        self._book.stamp(ordinal, self.now())

    def hold(self, ordinals, spin: bool) -> None:
        """Plan the ends of `ordinals` (held operations issued together) and, with `spin`, hold the
        stream until the latest of them."""
        now = self.now()
        self._book.plan(ordinals, now)
        if spin:
            self.wait_until(self._book.goal(ordinals, now))

    def hold_wait(self, ordinals) -> None:
        """Hold the stream until the planned ends of `ordinals` (an overlapped operation's wait)."""
        self.wait_until(self._book.goal(ordinals, self.now()))

    def delay_report(self) -> dict:
        book = self._book
        return self.delays.report() if book is None else self.delays.report(book.accrued_s, book.absorbed_s)


class CpuClock(HostHolds):
    """perf_counter marks; the CPU runs everything on the calling thread's one stream. The backend's
    operations mark the native trace (comm/native.py) on the same clock (CLOCK_MONOTONIC)."""

    kind = "cpu"

    def __init__(self) -> None:
        from prism_megatron.comm import native

        self.delays = DelayAccount()
        self._overshoot_s = 0.0
        self.trace = native.load().Trace("cpu")

    def mark(self) -> float:
        return time.perf_counter()

    now = mark

    def wait_until(self, goal: float) -> None:
        """Sleep until `goal` (perf_counter seconds). A sleep overshoots by the kernel's timer slack
        and the wake-up (tens of microseconds); the overshoot measured so far (a moving average) is
        taken off the next sleeps."""
        start = time.perf_counter()
        seconds = goal - start
        if seconds <= 0:
            return
        asked = max(0.0, seconds - self._overshoot_s)
        time.sleep(asked)
        took = time.perf_counter() - start
        self.delays.add(seconds, took)
        self._overshoot_s = 0.8 * self._overshoot_s + 0.2 * max(0.0, took - asked)

    def stream(self) -> str:
        return "compute"

    def stream_name(self, stream_id: int) -> str:
        return "compute"

    def seconds(self, marks: Sequence[Any], origin: Any) -> np.ndarray:
        return np.asarray(marks, dtype="f8") - float(origin)

    def delay_report(self) -> dict:
        """What the holds were asked for and what they lasted: the native trace's, where the backend
        held the operations, else this clock's own (holds made through it)."""
        native = self.trace.hold_report()
        return native if native["count"] else HostHolds.delay_report(self)


class CudaClock:
    """Marks on the device: CUDA events of the native trace's pool, recorded on the current stream and
    resolved in one synchronize at the end (comm/native.py). The backend's operations mark the same
    trace, so the recorder reads them in program order with its own boundaries."""

    kind = "cuda"

    def __init__(self) -> None:
        import torch

        from prism_megatron.comm import native

        self._torch = torch
        self.trace = native.load().Trace("cuda")
        self._default = torch.cuda.default_stream()
        self._current = getattr(torch._C, "_cuda_getCurrentStream", None)

    def mark(self) -> int:
        return self.trace.mark()

    def set_holds(self, rows: Sequence[Optional[tuple]]) -> None:
        """The iteration's holds go to the device: kernels on the current stream (csrc/holds.cu)."""
        self.trace.set_holds(rows)

    @property
    def own_device_bytes(self) -> int:
        """The caching allocator's bytes that the holds' plan holds on the device (0 without one): the
        emulator's, not the rank's; live from the install to the end, so in every allocated figure
        after it, the peak included."""
        return self.trace.own_device_bytes

    def device_idle(self, mark: int) -> bool:
        """Whether the device has run everything queued on the stream before `mark`, this clock's
        latest mark (an event: nothing was queued after it): the device waits for the host now (the
        recorder counts the operations that begin so: trace/iterations.py `host_bound`)."""
        return self.trace.idle(mark)

    def delay_report(self) -> dict:
        """What the holds were asked for and what they lasted, on the device's global timer."""
        return self.trace.hold_report()

    def stream(self) -> str:
        if self._current is None:
            return self.name_of(self._torch.cuda.current_stream())
        return self.stream_name(self._current(self._torch.cuda.current_device())[0])

    def name_of(self, stream: Any) -> str:
        """The graph's name of a CUDA stream: `compute` for the (current device's) default one."""
        return self.stream_name(stream.stream_id)

    def stream_name(self, stream_id: int) -> str:
        return "compute" if stream_id == self._default.stream_id else f"cuda_stream{stream_id}"

    def seconds(self, marks: Sequence[Any], origin: Any) -> np.ndarray:
        return self.trace.seconds([int(m) for m in marks], int(origin))
