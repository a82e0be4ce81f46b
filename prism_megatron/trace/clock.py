"""Device clocks for the recorder: marks taken in program order, resolved to seconds at the end.

On GPU a host timestamp of an asynchronous launch says when the launch happened, not when the kernel
ran, so `CudaClock` records a CUDA event on the current stream at each mark and resolves all of them
once, after a synchronize, with `elapsed_time` relative to the first mark: every duration is measured
on the device's own clock. `CpuClock` uses `time.perf_counter`, where work is synchronous.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np


class CpuClock:
    """perf_counter marks; the CPU runs everything on the calling thread's one stream."""

    kind = "cpu"

    def mark(self) -> float:
        return time.perf_counter()

    def delay(self, seconds: float) -> None:
        """Hold this stream (the host thread) for `seconds` (realtime emulation's waits)."""
        time.sleep(seconds)

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
        self._cycles_per_s = None

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
        collective waiting for its peers holds it; the host is not blocked."""
        if self._cycles_per_s is None:
            self._cycles_per_s = self._measure_sleep_rate()
        self._torch.cuda._sleep(max(1, int(seconds * self._cycles_per_s)))

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
