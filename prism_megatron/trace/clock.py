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

from prism_megatron.runtime.holds import DelayAccount, HoldBook, HostHolds  # noqa: F401 - re-exported


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
