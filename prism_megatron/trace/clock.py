"""Device clocks for the recorder: marks taken in program order, resolved to seconds at the end.

On GPU a host timestamp of an asynchronous launch says when the launch happened, not when the kernel
ran, so `CudaClock` records a CUDA event on the current stream at each mark and resolves all of them
once, after a synchronize, with `elapsed_time` relative to the first mark: every duration is measured
on the device's own clock. `CpuClock` uses `time.perf_counter`, where work is synchronous.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Sequence

import numpy as np


RATE_DECAY = 0.9
"""Weight per later sleep of what earlier ones measured, in the GPU's sleep-rate estimate."""
RATE_MIN_S = 100e-6
"""Sleeps shorter than this do not re-rate the GPU's sleep: a few microseconds of launch and event
spacing per sleep would read as a slower clock and cut the long waits short."""


class DelayAccount:
    """What the injected waits were asked for and what the clock measured them to last."""

    def __init__(self) -> None:
        self.count = 0
        self.planned_s = 0.0
        self.measured_s = 0.0

    def add(self, planned_s: float, measured_s: float) -> None:
        self.count += 1
        self.planned_s += planned_s
        self.measured_s += measured_s

    def report(self) -> dict:
        """{"count", "planned_s", "measured_s", "error_pct"}."""
        return {"count": self.count, "planned_s": self.planned_s, "measured_s": self.measured_s,
                "error_pct": (self.measured_s / self.planned_s - 1) * 100 if self.planned_s > 0 else None}


class CpuClock:
    """perf_counter marks; the CPU runs everything on the calling thread's one stream."""

    kind = "cpu"

    def __init__(self) -> None:
        self.delays = DelayAccount()
        self._overshoot_s = 0.0

    def mark(self) -> float:
        return time.perf_counter()

    def delay(self, seconds: float) -> None:
        """Hold this stream (the host thread) for `seconds` (realtime emulation's waits). A sleep
        overshoots by the kernel's timer slack and the wake-up (tens of microseconds, per wait); the
        overshoot measured so far (an exponential moving average) is taken off the next sleeps."""
        asked = max(0.0, seconds - self._overshoot_s)
        start = time.perf_counter()
        time.sleep(asked)
        took = time.perf_counter() - start
        self.delays.add(seconds, took)
        self._overshoot_s = 0.8 * self._overshoot_s + 0.2 * max(0.0, took - asked)

    def delay_report(self) -> dict:
        return self.delays.report()

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
        self._cycles_per_s = self._first_rate = None
        self.delays = DelayAccount()
        self._sleeps: deque = deque()  # (start event, end event, cycles, planned seconds), in order
        self._rate_cycles = self._rate_s = 0.0

    def mark(self) -> Any:
        if self._current is None or self._event is None:
            event = self._torch.cuda.Event(enable_timing=True)
            self._record(event)
            return event
        stream_id, device, device_type = self._current(self._torch.cuda.current_device())
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = self._torch.cuda.Stream(
                stream_id=stream_id, device_index=device, device_type=device_type)
        event = self._event(enable_timing=True)
        self._event.record(event, stream)
        return event

    def delay(self, seconds: float) -> None:
        """Hold the current stream for `seconds` with a spinning kernel (torch.cuda._sleep), as a
        collective waiting for its peers holds it; the host is not blocked.

        The kernel spins for a number of SM clock cycles, and the SM clock moves with the device's
        power and thermal state (by several percent through a run). Each sleep is therefore timed by
        a pair of events, and the completed sleeps of at least RATE_MIN_S (asked without blocking) set
        the rate the next ones use: over a run the injected time tracks the planned one, in sum,
        whatever the clock does. The report compares sums: a few microseconds of fixed cost per
        sleep are in the measured side of short waits."""
        if self._cycles_per_s is None:
            self._cycles_per_s = self._first_rate = self._measure_sleep_rate()
        self._settle()
        cycles = max(1, round(seconds * self._cycles_per_s))
        start = self.mark()
        self._torch.cuda._sleep(cycles)
        end = self.mark()
        self._sleeps.append((start, end, cycles, seconds))

    def _settle(self, block: bool = False) -> None:
        """Account the completed sleeps, oldest first; their cycles over their measured seconds (a
        decaying sum, so the estimate follows the clock) become the sleep rate."""
        while self._sleeps and (block or self._sleeps[0][1].query()):
            start, end, cycles, seconds = self._sleeps.popleft()
            if block:
                end.synchronize()
            took = start.elapsed_time(end) * 1e-3
            self.delays.add(seconds, took)
            if took >= RATE_MIN_S:
                self._rate_cycles = RATE_DECAY * self._rate_cycles + cycles
                self._rate_s = RATE_DECAY * self._rate_s + took
                self._cycles_per_s = self._rate_cycles / self._rate_s

    def delay_report(self) -> dict:
        """The DelayAccount's report, with the sleep rate (cycles per second) first and last."""
        self._settle(block=True)
        out = self.delays.report()
        if self._cycles_per_s is not None:
            out["cycles_per_s_first"], out["cycles_per_s_last"] = self._first_rate, self._cycles_per_s
        return out

    def _measure_sleep_rate(self) -> float:
        cuda = self._torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        cycles = 20_000_000
        self._record(start)
        cuda._sleep(cycles)
        self._record(end)
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1e-3)

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
