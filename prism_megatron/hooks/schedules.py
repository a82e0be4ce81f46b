"""The pipeline-schedule hook: megatron-core's `forward_step`, `backward_step` and
`get_forward_backward_func`, the functions every schedule (no pipelining, 1F1B, interleaved) passes
through.

- The memory tracker learns the phase (forward allocations are activations, the rest temporaries).
- The recorder, when there is one, gets one span per forward and per backward of each microbatch and
  model chunk (virtual stage), and an iteration mark each time the forward-backward function runs.
- The installation's iteration counter (hooks/iterations.py) counts each training pass, times it,
  and ends the script after `emulation.stop_after` of them.
- An injected compute fault on this process (faults.inject) stretches each step (faults/inject.py).
  The backward of a microbatch is matched to its forward by the output tensor the schedule hands back.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Optional

from prism_megatron.hooks.iterations import IterationCounter
from prism_megatron.runtime.memory import StorageTracker
from prism_megatron.runtime.patching import PatchSet
from prism_megatron.trace.recorder import Recorder


def _first_tensor(value: Any) -> Any:
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value


class ScheduleHooks:
    """State shared by the wrapped schedule functions of one installation."""

    def __init__(self, tracker: Optional[StorageTracker], recorder: Optional[Recorder],
                 faults: Optional[Any] = None, counter: Optional[IterationCounter] = None) -> None:
        """`faults`: a faults/inject.ComputeFaults that slows this process's steps, or None;
        `counter`: the installation's training iterations (hooks/iterations.py)."""
        self.tracker, self.recorder, self.faults = tracker, recorder, faults
        self.counter = counter or IterationCounter()
        self._forwards: dict[int, int] = {}     # chunk -> forwards seen this iteration
        self._backwards: dict[int, int] = {}
        self._by_output: dict[int, tuple[int, int]] = {}  # id(output tensor) -> (microbatch, chunk)

    def install(self, patches: PatchSet) -> None:
        try:
            from megatron.core import pipeline_parallel
            from megatron.core.pipeline_parallel import schedules
        except ImportError:
            return
        patches.patch(schedules, "forward_step", self._wrap_forward(schedules.forward_step))
        patches.patch(schedules, "backward_step", self._wrap_backward(schedules.backward_step))
        # each module's own binding is wrapped, so a getter the program wrapped itself stays in the chain
        for module in (schedules, pipeline_parallel):
            patches.patch(module, "get_forward_backward_func",
                          self._wrap_getter(module.get_forward_backward_func))

    @contextlib.contextmanager
    def _span(self, phase: str, microbatch: int, chunk: int):
        """The tracker's phase and the recorder's span for one forward or backward step."""
        previous = self.tracker.phase if self.tracker is not None else None
        if self.tracker is not None:
            self.tracker.set_phase(phase)
        if self.recorder is not None:
            self.recorder.span_begin(phase, microbatch, chunk)
        factor = self.faults.factor() if self.faults is not None else 1.0
        start = time.perf_counter()
        try:
            yield
            if factor != 1.0:  # an injected compute fault: the step lasts factor times as long
                self.faults.after_step(time.perf_counter() - start, factor)
        finally:
            if self.recorder is not None:
                self.recorder.span_end()
            if self.tracker is not None:
                self.tracker.set_phase(previous)

    def _wrap_forward(self, original):
        @functools.wraps(original)
        def forward_step(*args, **kwargs):
            chunk = kwargs.get("vp_stage") or 0
            microbatch = kwargs.get("current_microbatch")
            if microbatch is None:
                microbatch = self._forwards.get(chunk, 0)
            self._forwards[chunk] = self._forwards.get(chunk, 0) + 1
            with self._span("forward", microbatch, chunk):
                result = original(*args, **kwargs)
            output = _first_tensor(result[0]) if isinstance(result, tuple) else None
            if output is not None:
                self._by_output[id(output)] = (microbatch, chunk)
            return result

        return forward_step

    def _wrap_backward(self, original):
        @functools.wraps(original)
        def backward_step(*args, **kwargs):
            output = _first_tensor(args[1] if len(args) > 1 else kwargs.get("output_tensor"))
            microbatch, chunk = self._by_output.pop(id(output), (None, 0))
            if microbatch is None:
                microbatch = self._backwards.get(chunk, 0)
            self._backwards[chunk] = self._backwards.get(chunk, 0) + 1
            with self._span("backward", microbatch, chunk):
                return original(*args, **kwargs)

        return backward_step

    def _wrap_getter(self, original):
        @functools.wraps(original)
        def get_forward_backward_func(*args, **kwargs):
            schedule = original(*args, **kwargs)

            @functools.wraps(schedule)
            def forward_backward(*a, **k):
                if not k.get("forward_only"):  # a training iteration (evaluation is forward-only)
                    self.counter.begin()
                self._forwards.clear()
                self._backwards.clear()
                self._by_output.clear()
                if self.recorder is None:
                    return schedule(*a, **k)
                self.recorder.begin_iteration()
                self.recorder.enter("forward_backward")
                try:
                    return schedule(*a, **k)
                finally:
                    self.recorder.exit()

            return forward_backward

        return get_forward_backward_func
