"""One sweep point, in its own process: validated, captured (through the content-addressed capture
cache), simulated on the cluster; its row written atomically to `<out>/points/<id>/row.json`.

The capture cache (`<out>/captures/<key>/`, or `sweep.captures=DIR`, which sweeps may share): a
capture's key is the SHA-256 of the config every slice runs (capture/run.py: faults removed) with
the global batch size set to the one the cache captures, so points that differ only in what the
replay can change share one capture: the cluster (never part of the capture), `faults.inject`
(replayed here on the clean job's graph, its first iteration), and, for a 1F1B or unpipelined
schedule (no interleaving) of the built-in example, the number of microbatches: the cache captures
pp + 2 of them (the least sim/reschedule.py rewrites from) and the replay rewrites the graph to the
point's count. A graph that does not rewrite (not periodic) is captured at the point's own batch.
Concurrent points that need one key take turns on a lock file: the second finds the slices done.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from prism_megatron.config.schema import ConfigError, PrismConfig
from prism_megatron.util import atomic_write_text


@dataclass
class SweepSettings:
    """What every point of one sweep shares (the Hydra app's `sweep:` section)."""

    out: str
    cluster: str = "dgx_h100"
    config_file: Optional[str] = None
    script: Optional[list[str]] = None
    """`SCRIPT ARGS` of the job (config/job.py); None: the built-in example."""
    workers: Optional[int] = None
    """Capture slices at once per point (None: the capture's default)."""
    executor: str = "local"
    executor_options: list[str] = field(default_factory=list)
    """What runs each capture's slices (capture/executors.py), and its KEY=VALUE options."""
    cwd: str = "."
    """Where the script's relative paths are read from (a SLURM job starts elsewhere)."""
    captures: Optional[str] = None
    """The capture cache's folder (None: `<out>/captures`); sweeps may share one (`sweep.captures=DIR`)."""
    share: bool = True
    """Share captures between points that differ only in what the replay changes."""

    def cache_dir(self) -> Path:
        return Path(self.captures) if self.captures else Path(self.out) / "captures"


@dataclass
class PointResult:
    """One point's row (row.json; results.csv adds a column per swept key)."""

    point: str
    overrides: list[str]
    status: str
    """ok | invalid: REASON | failed: REASON"""
    iteration_time_s: Optional[float] = None
    tokens_per_s_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    max_peak_bytes: Optional[int] = None
    stage_peak_bytes: list[int] = field(default_factory=list)
    """The highest peak of each pipeline stage's ranks, stage 0 first."""
    fits: Optional[bool] = None
    """max_peak_bytes <= the cluster's GPU memory."""
    exposed_comm_s: Optional[float] = None
    bubble_s: Optional[float] = None
    """Of the slowest class of ranks (the one that sets the iteration time)."""
    capture: str = ""
    """The capture cache key the point was simulated from."""
    wall_s: float = 0.0

    @staticmethod
    def of(data: dict) -> "PointResult":
        known = {k: data[k] for k in PointResult.__dataclass_fields__ if k in data}
        return PointResult(**known)


def finished(row: Optional[PointResult]) -> bool:
    """A row a rerun keeps: simulated, or an invalid layout; a failed point is tried again."""
    return row is not None and not row.status.startswith("failed")


def row_path(out: Path, pid: str) -> Path:
    return out / "points" / pid / "row.json"


def read_row(out: Path, pid: str) -> Optional[PointResult]:
    """The point's finished row, or None (absent, or not whole: then it is run again)."""
    path = row_path(out, pid)
    try:
        return PointResult.of(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_row(out: Path, row: PointResult) -> None:
    path = row_path(out, row.point)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(str(path), json.dumps(asdict(row), indent=1))


def point_config(settings: SweepSettings, overrides: list[str]) -> PrismConfig:
    """The point's validated config (ConfigError: the reason it is pruned before any capture)."""
    from prism_megatron.config.job import job_config

    cfg = job_config(["emulation.sandbox_ranks=[]", *overrides], settings.config_file, settings.script,
                     cwd=settings.cwd)
    cfg.emulation.sandbox_ranks = []
    if cfg.emulation.virtual_world_size is None:
        raise ConfigError("a sweep needs emulation.virtual_world_size=N")
    return cfg


def evaluate(settings: SweepSettings, pid: str, overrides: list[str]) -> PointResult:
    """The point's row: never raises (a failure is the row's status, with its reason)."""
    t0 = time.perf_counter()
    try:
        cfg = point_config(settings, overrides)
    except ConfigError as err:
        return PointResult(pid, overrides, f"invalid: {err}")
    try:
        row = _simulate(settings, cfg, pid, overrides)
    except Exception as err:  # noqa: BLE001 - any failure is this point's, recorded, the sweep goes on
        from prism_megatron.capture.run import CaptureFailed
        from prism_megatron.sim.des import SimulationError

        known = (CaptureFailed, SimulationError, ConfigError)
        reason = str(err) if isinstance(err, known) else \
            f"{type(err).__name__}: {err} ({traceback.extract_tb(err.__traceback__)[-1].filename})"
        row = PointResult(pid, overrides, f"failed: {reason.splitlines()[0] if reason else type(err).__name__}")
    row.wall_s = round(time.perf_counter() - t0, 2)
    return row


def _simulate(settings: SweepSettings, cfg: PrismConfig, pid: str, overrides: list[str]) -> PointResult:
    from prism_megatron.faults.impact import job_time, replay
    from prism_megatron.faults.spec import FaultSet
    from prism_megatron.graph import load_graph
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.sim.report import job_figures
    from prism_megatron.sim.reschedule import RescheduleError, with_microbatches

    out = Path(settings.out)
    plan = capture_plan(cfg, settings.share and not settings.script)
    graph = load_graph(_captured(settings, plan.cfg))
    key = plan.key
    if plan.microbatches is not None:
        try:
            graph = with_microbatches(graph, plan.microbatches)
        except RescheduleError:  # not periodic: this point is captured as it is
            exact = capture_plan(cfg, False)
            graph, key = load_graph(_captured(settings, exact.cfg)), exact.key
    cluster = load_cluster(settings.cluster)
    faults = FaultSet.parse(cfg.faults.inject, graph.world.world_size, graph.world.gpus_per_node).at(0, 0.0)
    sim = replay(graph, cluster.cost_model(), faults)  # the faults act here, never in the capture
    iteration_s = job_time(sim, faults)
    figures = job_figures(iteration_s, graph.world.world_size, str(graph.meta.get("config", "")), cluster)
    stages: dict[int, int] = {}
    for role, g in graph.roles.items():
        stages[role.pp] = max(stages.get(role.pp, 0), int(g.peak_bytes))
    peak = max(stages.values())
    slowest = max(sim.classes, key=lambda c: c.iteration_s)
    return PointResult(pid, overrides, "ok", iteration_time_s=iteration_s,
                       tokens_per_s_per_gpu=figures["tokens_per_s_per_gpu"], mfu=figures["mfu"],
                       max_peak_bytes=peak, stage_peak_bytes=[stages[s] for s in sorted(stages)],
                       fits=peak <= cluster.gpu_memory_bytes, exposed_comm_s=slowest.exposed_comm_s,
                       bubble_s=slowest.bubble_s, capture=key)


@dataclass
class CapturePlan:
    """What to capture for a point: `cfg` (its global batch possibly the cache's), the cache `key`,
    and `microbatches`: the point's count for the replay to rewrite to (None: as captured)."""

    cfg: PrismConfig
    key: str
    microbatches: Optional[int] = None


def capture_plan(cfg: PrismConfig, share: bool) -> CapturePlan:
    """The capture a point needs (see the module docstring)."""
    from prism_megatron.capture.run import microbatches_of, world_of
    from prism_megatron.config.loader import to_yaml

    world = world_of(cfg)
    mine = microbatches_of(cfg, world)
    job = copy.deepcopy(cfg)
    rewrite = None
    interleaved = (cfg.parallel.vpp or 1) > 1
    if share and not interleaved and cfg.train.script is None and mine >= world.pp + 1:
        job.train.global_batch_size = (world.pp + 2) * cfg.train.micro_batch_size * world.dp
        rewrite = mine
    slices = copy.deepcopy(job)  # what every slice runs, as capture/run.py writes it
    slices.emulation.sandbox_ranks, slices.trace.path, slices.faults.inject = [], None, None
    text = to_yaml(slices)
    return CapturePlan(job, hashlib.sha256(text.encode()).hexdigest()[:16], rewrite)


def _captured(settings: SweepSettings, cfg: PrismConfig) -> str:
    """The graph of `cfg` from the cache, captured first if it is not there (one capture per key)."""
    from prism_megatron.capture.executors import ExecutorSpec
    from prism_megatron.capture.run import Capture

    key = capture_plan(cfg, False).key
    where = settings.cache_dir() / key
    where.mkdir(parents=True, exist_ok=True)
    graph = where / "graph.prism"
    with open(settings.cache_dir() / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another point capturing this key: wait for it
        if not graph.exists():
            executor = ExecutorSpec.parse(settings.executor, settings.executor_options)
            Capture(cfg, str(where), workers=settings.workers, executor=executor, log=lambda s: None).run()
    return str(graph)
