"""Training iterations as the hooks see them, whoever wrote the loop: their count, their wall time,
the prism backend's host time in each, and the stop after `emulation.stop_after` of them.

An iteration begins where megatron-core's forward-backward function is called (hooks/schedules.py),
where a DeepSpeed engine's first microbatch goes forward, or where its pipeline engine's
`train_batch` starts (hooks/deepspeed.py, hooks/deepspeed_pipe.py); it ends where the next one
begins, or where the script ends. So iteration k's wall time holds its forward-backward, its
optimizer step and what the loop does before the next (Megatron-LM's zero_grad, logging). On a GPU
the device is synchronized at each begin, as Megatron-LM's per-iteration loss logging makes it wait,
so a wall time is the device's, not the host's run ahead.

The stop: when iteration `stop_after + 1` would begin, `StopTraining` (a SystemExit with status 0)
is raised in its place, before anything of it runs. The script ends as if its own iteration count
had been `stop_after`: its N-th optimizer step is done, `launch` writes the summary and the recorder
its graph. A capture of a production script (`--train-iters 500000`) runs the iterations it records
and no more, without an edit to the script.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional


class StopTraining(SystemExit):
    """The script has run `emulation.stop_after` iterations; raised where the next would begin."""

    def __init__(self, iterations: int) -> None:
        super().__init__(0)
        self.iterations = iterations


class IterationCounter:
    """The iterations of one installation (module docstring)."""

    def __init__(self, stop_after: int = 0, *, backend_host_s: Callable[[], Optional[float]] = lambda: None,
                 synchronize: Optional[Callable[[], None]] = None) -> None:
        """`backend_host_s`: the prism backend's host seconds so far (None before its session);
        `synchronize`: waits for the device (CUDA), None on CPU."""
        self.stop_after = stop_after
        self.count = 0
        self._backend_host_s, self._synchronize = backend_host_s, synchronize
        self._starts: list[float] = []
        self._backend: list[Optional[float]] = []

    def begin(self) -> None:
        """Iteration `count + 1` begins; raises StopTraining instead when `stop_after` have run."""
        if self._synchronize is not None and self._starts:
            self._synchronize()
        if self.stop_after and self.count >= self.stop_after:
            self._close()
            print(f"prism: {self.count} iterations run (emulation.stop_after); ending the script",
                  file=sys.stderr, flush=True)
            raise StopTraining(self.count)
        self._starts.append(time.perf_counter())
        self._backend.append(self._backend_host_s())
        self.count += 1

    def _close(self) -> None:
        if len(self._starts) == self.count and self.count:
            self._starts.append(time.perf_counter())
            self._backend.append(self._backend_host_s())

    def figures(self) -> dict[str, Any]:
        """`iterations`, `iteration_times_ms` and `backend_host_s_per_iteration` (None where the
        backend had no session yet), the last iteration ending now if the script did not stop."""
        if self._synchronize is not None and self.count:
            self._synchronize()
        self._close()
        times = [(b - a) * 1e3 for a, b in zip(self._starts, self._starts[1:])]
        backend = [None if a is None or b is None else b - a for a, b in zip(self._backend, self._backend[1:])]
        return {"iterations": self.count, "iteration_times_ms": times,
                "backend_host_s_per_iteration": backend}
