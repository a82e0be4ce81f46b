"""Device clocks for the recorder: marks taken in program order, resolved to seconds at the end.

On GPU a host timestamp of an asynchronous launch says when the launch happened, not when the kernel
ran, so `CudaClock` records a CUDA event on the current stream at each mark and resolves all of them
once, after a synchronize, with `elapsed_time` relative to the first mark: every duration is measured
on the device's own clock. `CpuClock` uses `time.perf_counter`, where work is synchronous.
"""

from __future__ import annotations

import math
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


class HoldBook:
    """An iteration's holds on one clock (emulate/holds.py): `rows[k]` = (self_s, terms[, transfer_s])
    of the k-th communication operation, None where it is not held.

    Times are kept on the job's timeline: the clock's time less `debt`, the emulator's own time run
    up so far this iteration (emulate/holds.py). `plan` sets an operation's end to the latest of its
    own part (its stamped begin plus transfer_s, or without a stamp `now + self_s`) and each term
    (anchor, ghost_s) as (end of anchor + ghost_s), anchor -1 being the iteration's start; an
    operation issued past that end runs up the debt by the difference. `goal` is where a hold of
    `ordinals` spins to on the clock, after paying back what it can of the debt."""

    def __init__(self, rows: Sequence[Optional[tuple]]) -> None:
        self.rows = [None if row is None else (row[0], row[1], row[2] if len(row) > 2 else None)
                     for row in rows]
        self.ends: dict[int, float] = {}
        self.begins: dict[int, float] = {}
        self.start = 0.0
        self.debt = 0.0
        self.accrued_s = 0.0
        self.absorbed_s = 0.0

    def begin(self, now: float) -> None:
        self.start = now
        self.debt = 0.0
        self.ends.clear()
        self.begins.clear()

    def stamp(self, k: int, now: float) -> None:
        """Operation k began at `now` (on the clock)."""
        self.begins[k] = now

    def plan(self, ordinals, now: float) -> float:
        """Plan the ends of `ordinals` (issued together at `now`); returns the latest, on the clock
        (before any payback: `goal` gives where a hold spins to). The group is planned against the
        debt it found, and runs it up once, by how far its issue is past the latest of its ends."""
        entry = now - self.debt  # on the job's timeline
        latest = -math.inf
        for k in ordinals:
            self_s, terms, transfer_s = self.rows[k]
            begin = self.begins.pop(k, None)
            end = entry + self_s if begin is None or transfer_s is None else begin - self.debt + transfer_s
            for anchor, ghost_s in terms:
                base = self.start if anchor < 0 else self.ends.get(anchor)
                if base is not None:
                    end = max(end, base + ghost_s)
            self.ends[k] = end
            latest = max(latest, end)
        if entry > latest:  # the backend's own work ran past the group's end: the emulator's time
            self.debt += entry - latest
            self.accrued_s += entry - latest
        return latest + self.debt

    def goal(self, ordinals, now: float) -> float:
        """The clock time to hold `ordinals` to from `now`: their latest end, less what of the debt
        the hold pays back (all of it, or the whole hold)."""
        goal = max((self.ends.get(k, -math.inf) for k in ordinals), default=-math.inf)
        slack = goal - (now - self.debt)
        if slack > 0 and self.debt > 0:
            paid = min(self.debt, slack)
            self.debt -= paid
            self.absorbed_s += paid
        return goal + self.debt


class HostHolds:
    """Holds on a clock whose stream is the calling thread (its `now()` and `wait_until()`)."""

    _book: Optional[HoldBook] = None

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
    """perf_counter marks; the CPU runs everything on the calling thread's one stream."""

    kind = "cpu"

    def __init__(self) -> None:
        self.delays = DelayAccount()
        self._overshoot_s = 0.0

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

    def seconds(self, marks: Sequence[Any], origin: Any) -> np.ndarray:
        return np.asarray(marks, dtype="f8") - float(origin)


class CudaClock:
    """CUDA-event marks on the current stream, resolved in one synchronize at the end."""

    kind = "cuda"

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._default = torch.cuda.default_stream()
        self._record = torch.cuda.Event.record  # before the recorder's own hook wraps it
        # current_stream() builds a Stream object per call and Event.record asks for it; a mark is
        # taken at every anchor, so the raw event is recorded on a cached Stream of the current id
        self._current = getattr(torch._C, "_cuda_getCurrentStream", None)
        self._event = getattr(torch._C, "_CudaEventBase", None)
        self._streams: dict[int, Any] = {}
        self._holds = None  # trace/cuda_hold.py's DeviceHolds, made by `set_holds`

    def mark(self) -> Any:
        if self._current is None or self._event is None:
            event = self._torch.cuda.Event(enable_timing=True)
            self._record(event)
            return event
        event = self._event(enable_timing=True)
        self._event.record(event, self._current_stream())
        return event

    def _current_stream(self) -> Any:
        """The current stream, as a Stream object cached per stream id."""
        if self._current is None:
            return self._torch.cuda.current_stream()
        stream_id, device, device_type = self._current(self._torch.cuda.current_device())
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = self._torch.cuda.Stream(
                stream_id=stream_id, device_index=device, device_type=device_type)
        return stream

    def set_holds(self, rows: Sequence[Optional[tuple]]) -> None:
        """The iteration's holds go to the device: they run as kernels on the current stream
        (trace/cuda_hold.py)."""
        from prism_megatron.trace.cuda_hold import DeviceHolds

        self._holds = DeviceHolds(rows)

    @property
    def own_device_bytes(self) -> int:
        """The caching allocator's bytes that the holds' plan holds on the device (0 without one): the
        emulator's, not the rank's; live from the install to the end, so in every allocated figure
        after it, the peak included."""
        return self._holds.device_bytes if self._holds is not None else 0

    def hold_iteration(self) -> None:
        self._holds.begin()

    def device_idle(self, mark: Any) -> bool:
        """Whether the device has run everything queued on the stream before `mark`, this clock's
        latest mark (an event: nothing was queued after it): the device waits for the host now (the
        recorder counts the operations that begin so: trace/iterations.py `host_bound`)."""
        return mark.query()

    def stamp(self, ordinal: int, idle: Optional[bool] = None) -> None:
        """The held operation `ordinal` begins now: stamped on the device where the current stream has
        nothing queued (`idle`, probed here when not given: the operation begins there now, and the
        host's work in the backend is device idle time); elsewhere its begin is taken as its issue
        less its recorded local part."""
        if idle is None:
            idle = self._current_stream().query()
        if self._holds is not None and idle:
            self._holds.stamp(ordinal)

    def hold(self, ordinals, spin: bool) -> None:
        self._holds.hold(ordinals, spin)

    def hold_wait(self, ordinals) -> None:
        self._holds.wait(ordinals)

    def delay_report(self) -> dict:
        """What the holds were asked for and what they lasted, on the device's global timer."""
        return self._holds.report() if self._holds is not None else DelayAccount().report()

    def stream(self) -> str:
        if self._current is None:
            return self.name_of(self._torch.cuda.current_stream())
        return self._name(self._current(self._torch.cuda.current_device())[0])

    def name_of(self, stream: Any) -> str:
        """The graph's name of a CUDA stream: `compute` for the (current device's) default one."""
        return self._name(stream.stream_id)

    def _name(self, stream_id: int) -> str:
        return "compute" if stream_id == self._default.stream_id else f"cuda_stream{stream_id}"

    def seconds(self, marks: Sequence[Any], origin: Any) -> np.ndarray:
        self._torch.cuda.synchronize()
        return np.asarray([origin.elapsed_time(m) * 1e-3 for m in marks], dtype="f8")
