"""The sweep's Hydra sweeper (`hydra/sweeper=prism`, the app's default): a grid or an Optuna search,
each point a job of the configured Hydra launcher (`hydra/launcher=joblib|submitit_local|
submitit_slurm|ray`), so each runs in its own process (joblib with n_jobs=1 runs them in this one).

Before any job starts, every point of the grid is validated (`evaluate.point_config`): a layout that
does not divide (heads % tp, layers % (pp * vpp), experts % ep, the batch by micro-batch x DP) is
recorded as `invalid: REASON` and never captured. A point whose row (`points/<id>/row.json`, written
by its job as it ends) is already there is not run again: a sweep killed at any point and run again
reruns only the points that had not finished (and those that failed: a failure may be the node's).
The table (results.py) is rewritten from the rows after every launched batch (`batch` points: the
launcher's n_jobs for joblib, else all of them at once).

search=optuna: an Optuna study (multivariate TPE, `seed`) over the swept keys' values (a numeric key
as the index of its value in numeric order, so the sampler sees the order; others as categories),
maximizing tokens/s/GPU, the predicted peak memory at most the GPU's capacity as its constraint
(`Trial.set_constraint`; a point over it is told 0 tokens/s, else TPE is drawn to the fast layouts
that do not fit); a proposal that is an invalid layout is told pruned at once (no capture, not a
trial), one already evaluated is told its row again. The last quarter of the trials polish: each is
a neighbour of the best fitting point so far (one key one step along its numeric order, or another
category), enqueued to the study, while one is left. `n_trials` points are evaluated at most, one at
a time (`batch=N`: N at once, at some cost in trials: the sampler learns after each batch). The
study lives in `<out>/optuna.db` (SQLite), so a rerun continues it; its trials are the table's rows,
in trial order.

Trials are counted in captures, what a search costs (minutes each, against seconds for a replay):
after a trial, every valid point that shares its capture (evaluate.capture_plan: it differs only in
what the replay rewrites, the global batch of a 1F1B schedule) is evaluated too, from the cache, and
told to the study as a trial of its own (`sibling_of` in the table names the trial whose capture it
replayed), not counted in `n_trials` (`siblings=false`: off). The sampler then learns the batch axis
of every layout it tries at no capture's cost, and spends its trials on layouts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra.plugins.sweeper import Sweeper

from prism_megatron.config.schema import ConfigError
from prism_megatron.sweep.evaluate import (PointResult, SweepSettings, finished, point_config, read_row,
                                           write_row)
from prism_megatron.sweep.points import is_app_key, parse_space, point_id
from prism_megatron.sweep.results import Table, write_table

SEARCHES = ("grid", "optuna")


@dataclass
class PrismSweeperConf:
    _target_: str = "hydra_plugins.prism_megatron_sweeper.PrismSweeper"
    search: str = "grid"
    """grid: every point; optuna: a search of at most n_trials points."""
    n_trials: int = 12
    seed: int = 0
    batch: Optional[int] = None
    """Points per launch (None: a grid, joblib's n_jobs, else all; a search, 1)."""
    siblings: bool = True
    """optuna: after each trial, evaluate the points sharing its capture (not counted in n_trials)."""


class SweepDriver(Sweeper):
    """See the module docstring."""

    def __init__(self, search: str = "grid", n_trials: int = 12, seed: int = 0,
                 batch: Optional[int] = None, siblings: bool = True) -> None:
        if search not in SEARCHES:
            raise ConfigError(f"hydra.sweeper.search={search}: expected one of {', '.join(SEARCHES)}")
        if n_trials < 1 or (batch is not None and batch < 1):
            raise ConfigError(f"hydra.sweeper.n_trials={n_trials} / batch={batch}: expected 1 or more")
        self.search, self.n_trials, self.seed, self.batch = search, n_trials, seed, batch
        self.siblings = siblings
        self.launcher = None
        self.job_idx = 0
        self.app_args: list[str] = []

    def setup(self, *, hydra_context, task_function, config) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    # -- the sweep -----------------------------------------------------------------------------

    def sweep(self, arguments: list[str]) -> Table:
        from omegaconf import OmegaConf

        from prism_megatron.config.loader import MODEL_PRESETS

        given = OmegaConf.to_container(self.config.sweep, resolve=True)
        self.settings = SweepSettings(**{k: v for k, v in given.items() if k in SweepSettings.__dataclass_fields__})
        self.out = Path(self.settings.out)
        # the app's settings given on the command line (sweep.captures=DIR) hold for every job too
        self.app_args = [a for a in arguments if is_app_key(a)]
        space = parse_space([a for a in arguments if not is_app_key(a)], sorted(MODEL_PRESETS))
        self.keys = space.swept_keys()
        points = space.points()
        self._overrides = {point_id(p, self.settings.script): p for p in points}
        if self.search == "grid":
            return self._grid(points)
        return self._optuna(space, points)

    def _batch_size(self, default_all: int) -> int:
        if self.batch:
            return self.batch
        n_jobs = self.config.hydra.launcher.get("n_jobs")
        if isinstance(n_jobs, int) and n_jobs > 0:
            return n_jobs
        return default_all

    def _launch(self, todo: list[tuple[str, list[str]]]) -> dict[str, PointResult]:
        """Run `todo` (id, overrides) as one launch; each point's row (a lost job: failed, with why)."""
        from hydra.core.utils import JobStatus

        jobs = [[*self.app_args, *(_hydra_safe(o) for o in ov), f"sweep.point={pid}"] for pid, ov in todo]
        try:
            returns = self.launcher.launch(jobs, initial_job_idx=self.job_idx)
            lost = {}
            for (pid, _), ret in zip(todo, returns):
                if ret.status != JobStatus.COMPLETED:
                    try:
                        ret.return_value  # a failed job's property raises the exception it ended with
                        lost[pid] = f"status {ret.status}"
                    except Exception as err:  # noqa: BLE001 - whatever the job raised is its reason
                        lost[pid] = f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - the launcher lost the batch: its points fail, with why
            lost = {pid: f"{type(err).__name__}: {err}" for pid, _ in todo}
        self.job_idx += len(jobs)
        rows = {}
        for pid, ov in todo:
            row = read_row(self.out, pid)
            if row is None:
                reason = lost.get(pid, "its job ended without a row")
                row = PointResult(pid, ov, f"failed: the launcher's job: {reason.splitlines()[0]}")
                write_row(self.out, row)
            rows[pid] = row
        return rows

    def _validate(self, pid: str, overrides: list[str]) -> Optional[PointResult]:
        """The point's `invalid` row if its layout does not hold, before any capture."""
        try:
            point_config(self.settings, overrides)
        except ConfigError as err:
            return PointResult(pid, overrides, f"invalid: {err}")
        return None

    def _grid(self, points: list[list[str]]) -> Table:
        ids = [point_id(p, self.settings.script) for p in points]
        rows: dict[str, PointResult] = {}
        for pid, p in zip(ids, points):
            row = read_row(self.out, pid)
            row = row if finished(row) else self._validate(pid, p)
            if row is not None:
                rows[pid] = row
        todo = [(pid, p) for pid, p in zip(ids, points) if pid not in rows]
        done = sum(1 for r in rows.values() if not r.status.startswith("invalid"))
        if done:
            print(f"sweep: {done} of {len(points)} points already done ({self.out / 'points'}); "
                  f"running {len(todo)}", file=sys.stderr, flush=True)

        def table() -> Table:
            return Table(self.keys, [rows[pid] for pid in ids if pid in rows])

        write_table(self.out, table())
        size = self._batch_size(max(1, len(todo)))
        for start in range(0, len(todo), size):
            rows.update(self._launch(todo[start:start + size]))
            write_table(self.out, table())
            print(f"sweep: {min(start + size, len(todo))}/{len(todo)} points run", file=sys.stderr, flush=True)
        return table()

    def _optuna(self, space, points: list[list[str]]) -> Table:
        import optuna

        from prism_megatron.sim.cluster import load_cluster

        import warnings

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # multivariate
        capacity = load_cluster(self.settings.cluster).gpu_memory_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=min(3, self.n_trials),
                                             multivariate=True)
        study = optuna.create_study(study_name="prism-sweep", direction="maximize", sampler=sampler,
                                    storage=f"sqlite:///{self.out / 'optuna.db'}", load_if_exists=True)
        axes = [a for a in space.axes if a.swept]
        fixed = [a.values[0] for a in space.axes if not a.swept]
        order = [a.key for a in space.axes]
        keys = self._capture_keys(points)  # every valid point: its capture's key
        history: list[tuple[int, str, Optional[str]]] = []  # (trial, point, sibling of) evaluated, in order
        rows: dict[str, PointResult] = {}
        asked: set[str] = set()  # the points the sampler chose (n_trials counts them)
        for t in study.get_trials(deepcopy=False):  # a rerun: the study's trials so far
            pid = t.user_attrs.get("point")
            row = read_row(self.out, pid) if pid else None
            if t.state == optuna.trial.TrialState.RUNNING:  # asked by a killed run: told now
                if row is None:
                    study.tell(t.number, state=optuna.trial.TrialState.FAIL)
                else:
                    self._tell(study, t.number, row, capacity)
            if row is not None and t.state != optuna.trial.TrialState.PRUNED and pid not in rows:
                rows[pid] = row  # a point's first trial (a later one was told its row again)
                history.append((t.number, pid, t.user_attrs.get("sibling_of")))
                if t.user_attrs.get("sibling_of") is None:
                    asked.add(pid)
        if history:
            print(f"sweep: the study has {len(rows)} points evaluated ({self.out / 'optuna.db'})",
                  file=sys.stderr, flush=True)

        def table() -> Table:
            return Table(self.keys, [rows[pid] for _, pid, _ in history], trials=[n for n, _, _ in history],
                         sibling_of=[s for _, _, s in history])

        self._expand(study, axes, list(asked), keys, rows, history, capacity)  # a killed run's siblings
        asks = 0
        while len(asked) < self.n_trials and len(rows) < len(keys) and asks < 50 * self.n_trials:
            pending, fresh = [], []  # to launch; every point the sampler chose this round
            while len(pending) + len(fresh) < (self.batch or 1) and len(asked) + len(pending) < self.n_trials:
                asks += 1
                if len(asked) + len(pending) >= self.n_trials - max(1, self.n_trials // 4):
                    taken = set(rows) | {p for _, p, _ in pending}
                    params = self._neighbour(axes, list(rows.values()), taken, set(keys), capacity)
                    if params is not None:  # the last quarter: next to the best, if any is left
                        study.enqueue_trial(params)
                trial = study.ask()
                chosen = {a.key: _suggest(trial, a) for a in axes}
                overrides = sorted([*fixed, *chosen.values()], key=lambda o: order.index(o.partition("=")[0]))
                pid = point_id(overrides, self.settings.script)
                trial.set_user_attr("point", pid)
                if pid not in keys:  # an invalid layout: pruned, no capture, not a trial
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                elif pid in rows or pid in {p for _, p, _ in pending}:
                    known = rows.get(pid)
                    if known is not None:
                        self._tell(study, trial, known, capacity)
                    else:
                        study.tell(trial, state=optuna.trial.TrialState.PRUNED)  # in this batch already
                else:
                    row = read_row(self.out, pid)
                    if finished(row):  # evaluated by an earlier, killed run before its trial was told
                        rows[pid] = row
                        asked.add(pid)
                        fresh.append(pid)
                        history.append((trial.number, pid, None))
                        self._tell(study, trial, row, capacity)
                    else:
                        pending.append((trial, pid, overrides))
                if asks >= 50 * self.n_trials:
                    break
            if pending:
                got = self._launch([(pid, ov) for _, pid, ov in pending])
                for trial, pid, _ in pending:
                    rows[pid] = got[pid]
                    asked.add(pid)
                    fresh.append(pid)
                    history.append((trial.number, pid, None))
                    self._tell(study, trial, got[pid], capacity)
            self._expand(study, axes, fresh, keys, rows, history, capacity)
            write_table(self.out, table())
            best = table().best()
            print(f"sweep: {len(asked)}/{self.n_trials} trials, {len(rows)} points evaluated ({asks} proposed); "
                  f"best {best.tokens_per_s_per_gpu:.1f} tokens/s/GPU" if best else
                  f"sweep: {len(asked)}/{self.n_trials} trials, {len(rows)} points evaluated, none fits yet",
                  file=sys.stderr, flush=True)
        write_table(self.out, table())
        return table()

    def _capture_keys(self, points: list[list[str]]) -> dict[str, str]:
        """Point id -> the key of the capture it replays (evaluate.capture_plan), for every valid point."""
        from prism_megatron.sweep.evaluate import capture_plan

        keys = {}
        for p in points:
            try:
                cfg = point_config(self.settings, p)
            except ConfigError:
                continue
            keys[point_id(p, self.settings.script)] = capture_plan(
                cfg, self.settings.share and not self.settings.script).key
        return keys

    def _expand(self, study, axes, parents: list[str], keys: dict[str, str], rows: dict[str, PointResult],
                history: list, capacity: int) -> None:
        """Evaluate the valid points not yet evaluated that share a capture with one of `parents`
        (rows already there are read, the others launched at once), each told as its own trial."""
        if not self.siblings:
            return
        import optuna

        want: dict[str, str] = {}  # sibling -> the trial's point whose capture it replays
        for parent in parents:
            row = rows.get(parent)
            if row is None or row.status != "ok":
                continue
            for pid, key in keys.items():
                if key == row.capture and pid not in rows and pid not in want:
                    want[pid] = parent
        if not want:
            return
        got = {pid: row for pid in want if finished(row := read_row(self.out, pid))}
        todo = [(pid, self._overrides[pid]) for pid in want if pid not in got]
        if todo:
            got.update(self._launch(todo))
        distributions = {a.key: _distribution(a) for a in axes}
        for pid, parent in want.items():
            row = got[pid]
            rows[pid] = row
            current = {o.partition("=")[0]: o for o in row.overrides}
            params = {a.key: _param(a, current[a.key]) for a in axes}
            attrs = {"point": pid, "sibling_of": parent}
            score = _score(row, capacity)
            if score is None:
                frozen = optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, params=params,
                                                   distributions=distributions, user_attrs=attrs)
            else:
                frozen = optuna.trial.create_trial(value=score[0], params=params, distributions=distributions,
                                                   user_attrs=attrs, constraints={CONSTRAINT: score[1]})
            study.add_trial(frozen)
            history.append((study.get_trials(deepcopy=False)[-1].number, pid, parent))

    def _neighbour(self, axes, rows: list[PointResult], taken: set[str], valid: set[str],
                   capacity: int) -> Optional[dict]:
        """The study's parameters of a valid point not yet evaluated next to the best fitting one (one
        swept key one step along its numeric order, or another of its categories); None: none left."""
        fitting = [r for r in rows if r.status == "ok" and r.max_peak_bytes <= capacity]
        if not fitting:
            return None
        best = max(fitting, key=lambda r: r.tokens_per_s_per_gpu)
        current = {o.partition("=")[0]: o for o in best.overrides}
        params = {a.key: _param(a, current[a.key]) for a in axes}
        for axis in axes:
            options = list(axis.values)
            here = options.index(current[axis.key])
            if _ordered(axis) is not None:
                order = _ordered(axis)
                at = order.index(here)
                steps = [order[i] for i in (at + 1, at - 1) if 0 <= i < len(order)]
            else:
                steps = [i for i in range(len(options)) if i != here]
            for step in steps:
                overrides = [options[step] if o == current[axis.key] else o for o in best.overrides]
                pid = point_id(overrides, self.settings.script)
                if pid not in taken and pid in valid:
                    return {**params, axis.key: _param(axis, options[step])}
        return None

    @staticmethod
    def _tell(study, trial, row: PointResult, capacity: int) -> None:
        import optuna

        score = _score(row, capacity)
        if score is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return
        value, over = score
        if isinstance(trial, int):  # asked by a killed run (a number: no constraint to set), so a point
            if over > 0:            # that does not fit is told failed rather than feasible
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            else:
                study.tell(trial, value)
            return
        trial.set_constraint(CONSTRAINT, over)
        study.tell(trial, value)


CONSTRAINT = "peak_over_capacity_bytes"
"""The study's constraint: predicted peak minus the GPU's capacity (feasible at <= 0)."""


def _score(row: PointResult, capacity: int) -> Optional[tuple[float, float]]:
    """(value, constraint) a row tells the study; None: the point failed. A point that does not fit
    scores nothing: its throughput would draw the sampler to it."""
    if row.status != "ok":
        return None
    over = float(row.max_peak_bytes - capacity)
    return (row.tokens_per_s_per_gpu if over <= 0 else 0.0), over


def _ordered(axis) -> Optional[list[int]]:
    """The indices of `axis`'s values in numeric order; None where a value is not a number."""
    values = [v.partition("=")[2] for v in axis.values]
    try:
        return sorted(range(len(values)), key=lambda i: float(values[i]))
    except ValueError:
        return None


def _suggest(trial, axis) -> str:
    """The trial's value of `axis` (an override string): an index in numeric order where every value
    is a number (tp, pp, batch sizes: the sampler then sees their order), else a category."""
    ordered = _ordered(axis)
    if ordered is None:
        return trial.suggest_categorical(axis.key, list(axis.values))
    return axis.values[ordered[trial.suggest_int(axis.key, 0, len(axis.values) - 1)]]


def _distribution(axis):
    """The study's distribution of `axis`, as `_suggest` asks it."""
    import optuna

    if _ordered(axis) is None:
        return optuna.distributions.CategoricalDistribution(list(axis.values))
    return optuna.distributions.IntDistribution(0, len(axis.values) - 1)


def _param(axis, override: str):
    """The study's parameter for `override`, a value of `axis` (the inverse of `_suggest`)."""
    ordered = _ordered(axis)
    here = list(axis.values).index(override)
    return override if ordered is None else ordered.index(here)


def _hydra_safe(override: str) -> str:
    """`key=value` as Hydra's parser takes it: a value it reads as a call is quoted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_overrides([override])
        return override
    except HydraException:
        key, _, value = override.partition("=")
        return f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'

