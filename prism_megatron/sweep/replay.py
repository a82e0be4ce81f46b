"""A search replayed on a measured grid: the sweeper's Optuna search (sweeper.py) run in this process
over the rows a grid sweep wrote (`<grid>/points/<id>/row.json`), launching no job. Predictions are
deterministic, so a replay is what the same search would find on the real sweep, at the cost of the
sampler alone: what tunes the search (and measures how many trials it needs) over many seeds.

`replay_search` gives the search's table (its trials in order, each followed by the points replayed
from its capture); `trials_to_best` the trials a search had asked for when it first evaluated the
grid's best fitting point, and `captures_to_best` the captures it had run by then, None where it
never did.

Known limitations: a point the grid does not hold (outside its axes) fails the replay (ReplayError).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from prism_megatron.sweep.evaluate import PointResult
from prism_megatron.sweep.results import Table


class ReplayError(RuntimeError):
    """The search asked for a point the measured grid does not hold."""


class _NoLaunch:
    """A launcher stand-in: every point the search evaluates must already be a row of the grid."""

    def launch(self, job_overrides, initial_job_idx):
        points = [next(o for o in job if o.startswith("sweep.point=")) for job in job_overrides]
        raise ReplayError(f"the measured grid has no row for {', '.join(points)}")


def replay_search(grid: Path, out: Path, overrides: list[str], cluster: str, seed: int,
                  n_trials: int = 12, config: Optional[str] = None) -> Table:
    """The Optuna search of `overrides` (the grid's, in Hydra's grammar) with `seed`, its study in
    `out/optuna.db`, every trial answered by the grid's row of that point; `cluster` sets the
    capacity the constraint holds (it may differ from the grid's). `config`: the grid's `--config`
    (None: the default one, as `sweep` reads it), which the points' capture keys depend on."""
    from omegaconf import OmegaConf

    from prism_megatron.config.job import config_file
    from prism_megatron.sweep.sweeper import SweepDriver

    for row in Path(grid, "points").glob("*/row.json"):  # linked one by one: the grid is never written
        mine = out / "points" / row.parent.name / "row.json"
        mine.parent.mkdir(parents=True, exist_ok=True)
        if not mine.exists():
            os.symlink(row.resolve(), mine)
    driver = SweepDriver(search="optuna", n_trials=n_trials, seed=seed)
    settings = {"out": str(out), "cluster": cluster, "config_file": config_file(config)}
    driver.config = OmegaConf.create({"sweep": settings, "hydra": {"launcher": {}}})
    driver.launcher = _NoLaunch()
    table = driver.sweep(list(overrides))
    lost = [r for r in table.rows if ReplayError.__name__ in r.status]  # the sweeper records a lost job
    if lost:
        raise ReplayError(lost[0].status.partition(f"{ReplayError.__name__}: ")[2])
    return table


def grid_best(rows: list[PointResult], capacity_bytes: int) -> Optional[PointResult]:
    """The grid's answer: its fastest point whose predicted peak fits `capacity_bytes`."""
    fitting = [r for r in rows if r.status == "ok" and r.max_peak_bytes <= capacity_bytes]
    return max(fitting, key=lambda r: r.tokens_per_s_per_gpu) if fitting else None


def trials_to_best(table: Table, best: PointResult) -> Optional[int]:
    """The number of trials the search had asked its sampler for when it first evaluated `best` (None:
    never); a point replayed from a trial's capture (`sibling_of`) is not a trial of its own."""
    siblings = table.sibling_of or [None] * len(table.rows)
    for i, row in enumerate(table.rows):
        if row.point == best.point:
            return sum(1 for s in siblings[:i + 1] if s is None) or None
    return None


def _rows_to_best(table: Table, best: PointResult) -> Optional[int]:
    for i, row in enumerate(table.rows, start=1):
        if row.point == best.point:
            return i
    return None


def captures_to_best(table: Table, best: PointResult) -> Optional[int]:
    """The number of captures the search had run when it first evaluated `best` (None: never)."""
    reached = _rows_to_best(table, best)
    return None if reached is None else len({r.capture for r in table.rows[:reached]})
