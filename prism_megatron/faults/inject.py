"""Faults injected into a real process: its compute slowed for real (a plain run's rank or a sandbox).

A compute fault (`slow`, `throttle`, `periodic`) that names this process's virtual rank makes each
forward and backward step of a microbatch, and each optimizer step, last `factor` times as long: after
the step, the process sleeps (factor - 1) times the step's duration, so the whole loop of a slow GPU
is slowed, as the replay slows every compute node of the rank. The step's duration is host time,
which on CPU is the compute; the sleep is inside the step, so a recorder counts it as the step's
compute and the memory tracker sees no change. Time-varying factors are read at the step's start,
with the job's time counted from the first step. Link faults and host stalls act in the replay only.

Known limitations: communication inside a stretched step is stretched with it. A data-parallel job
without overlapped communication has none in its forward and backward steps, and its optimizer step's
one collective is the gradient norm's all-reduce over the model-parallel group (one rank in pure DP);
tensor-parallel all-reduces, a distributed optimizer's all-gather and any wait for a peer inside a
step are slowed too. Work outside these steps (zeroing the gradient buffers, the schedule's glue)
is not slowed: a few percent of a CPU iteration. On a GPU the host time is not the compute.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

from prism_megatron.config.schema import ConfigError
from prism_megatron.faults.spec import FaultError, FaultSet, parse_faults


class ComputeFaults:
    """`after_step(seconds)` for the schedule hooks (hooks/schedules.py) of one installation."""

    def __init__(self, text: str, gpus_per_node: int, rank: Callable[[], int],
                 world_size: Callable[[], int]) -> None:
        self.faults = parse_faults(text)
        self._gpus_per_node, self._rank, self._world_size = gpus_per_node, rank, world_size
        self._set: Optional[FaultSet] = None
        self._origin: Optional[float] = None
        self.slept_s = 0.0

    def factor(self) -> float:
        now = time.perf_counter()
        if self._set is None:
            try:
                self._set = FaultSet(self.faults, self._world_size(), self._gpus_per_node)
            except FaultError as err:
                raise ConfigError(f"faults.inject: {err}") from None
            self._origin = now
        return self._set.at(0, now - self._origin).compute.get(self._rank(), 1.0)

    def stretch_step(self, optimizer: Any) -> None:
        """Slow `optimizer.step` (megatron's, made by get_megatron_optimizer) like a schedule step."""
        step = optimizer.step

        @functools.wraps(step)
        def slowed_step(*args, **kwargs):
            factor = self.factor()
            start = time.perf_counter()
            result = step(*args, **kwargs)
            self.after_step(time.perf_counter() - start, factor)
            return result

        optimizer.step = slowed_step

    def after_step(self, seconds: float, factor: float) -> None:
        if factor > 1.0 and seconds > 0:
            delay = (factor - 1.0) * seconds
            time.sleep(delay)
            self.slept_s += delay
