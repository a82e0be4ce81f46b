"""`prism-megatron sweep`: config-override sweeps for tuning, resumable, one row per finished point.

Overrides use Hydra's multirun grammar (Hydra's own parser): `parallel.tp=2,4,8`,
`parallel.pp=range(1,5)`, `model=choice(tiny,tiny_moe)`, `train.micro_batch_size=1,2`; quote values
that look like calls (`moe.imbalance='zipf(1.2)'`). The points are the cartesian product, in the order
given. Each point is validated first (an invalid combination is recorded with the reason and not
run), then captured (slices; `<out>/points/<id>/capture`) and simulated on the cluster; its row goes
to `<out>/results.csv` and `<out>/results.parquet` (typed columns, for pandas/polars/duckdb), both
rewritten atomically after every point, so a killed sweep loses nothing and a rerun skips every
point already there (the CSV is what a rerun reads). At the end: the table ranked by tokens/s/GPU (OOM points
last), the best config, and `ranking.png` (one bar per point, tokens/s/GPU, OOM points red).

Local parallel execution runs `--jobs` points at once in threads (each point's capture is its own
subprocesses). results.csv has one writer: cluster execution (Hydra's submitit launcher) is not wired
yet, and jobs sharing an output directory would overwrite each other's rows.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from prism_megatron import procs
from prism_megatron.config.schema import ConfigError
from prism_megatron.util import atomic_write_bytes, atomic_write_text

COLUMNS = ("point", "overrides", "status", "iteration_time_s", "tokens_per_s_per_gpu", "mfu",
           "max_peak_bytes", "oom", "wall_s")


def expand(overrides: list[str]) -> list[list[str]]:
    """The points of a multirun override list (cartesian product of the sweeps, in order)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    axes: list[list[str]] = []
    for item in overrides:
        try:
            (parsed,) = parser.parse_overrides([item])
        except HydraException:
            if "," in item.partition("=")[2]:
                raise ConfigError(f"sweep override {item!r} does not parse in Hydra's multirun grammar; "
                                  "quote values that look like calls: moe.imbalance='zipf(1.2)'") from None
            axes.append([item])  # a plain value Hydra would read as a call: passed as written
            continue
        key = parsed.key_or_group
        if parsed.is_sweep_override():
            axes.append([f"{key}={value}" for value in parsed.sweep_string_iterator()])
        else:
            axes.append([f"{key}={parsed.get_value_element_as_str()}"])
    return [list(p) for p in itertools.product(*axes)] if axes else [[]]


def point_id(overrides: list[str]) -> str:
    return hashlib.sha256("\x1f".join(overrides).encode()).hexdigest()[:12]


@dataclass
class Sweep:
    """One sweep into `out` (see the module docstring)."""

    out: Path
    base: list[str]
    """Overrides of every point (before the swept ones)."""
    points: list[list[str]]
    config_file: Optional[str]
    cluster: str = "dgx_h100"
    jobs: int = 1
    workers: Optional[int] = None
    script: Optional[list[str]] = None
    """`SCRIPT ARGS` of the job (config/job.py: a point's overrides rewrite the script's flags); None:
    the built-in example."""

    def _id(self, swept: list[str]) -> str:
        """A point's id: its overrides, and the script when there is one (another script's rows are
        not this sweep's)."""
        return point_id([*swept, "--", *self.script] if self.script else swept)

    def run(self, stream=sys.stderr) -> list[dict]:
        procs.guard()  # the points' slices start from pool threads, which cannot set signal handlers
        self.out.mkdir(parents=True, exist_ok=True)
        rows = {r["point"]: r for r in read_results(self.out / "results.csv")}
        todo = [p for p in self.points if self._id(p) not in rows]
        if len(todo) < len(self.points):
            print(f"sweep: {len(self.points) - len(todo)} of {len(self.points)} points already done "
                  f"({self.out / 'results.csv'}); running {len(todo)}", file=stream)
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, self.jobs)) as pool:
            for done, row in enumerate(pool.map(self._point, todo), start=1):
                rows[row["point"]] = row
                write_results(self.out / "results.csv", [rows[self._id(p)] for p in self.points
                                                          if self._id(p) in rows])
                elapsed = time.perf_counter() - start
                eta = elapsed / done * (len(todo) - done)
                bar = "#" * (24 * done // max(1, len(todo)))
                print(f"sweep [{bar:<24}] {done}/{len(todo)} | {elapsed:.0f}s elapsed, ETA {eta:.0f}s | "
                      f"{row['overrides']}: {row['status']}", file=stream, flush=True)
        return [rows[self._id(p)] for p in self.points]

    def _point(self, swept: list[str]) -> dict:
        from prism_megatron.capture.run import Capture, CaptureFailed
        from prism_megatron.config.job import job_config
        from prism_megatron.graph import load_graph
        from prism_megatron.sim.cluster import load_cluster
        from prism_megatron.sim.des import SimulationError, Simulator
        from prism_megatron.sim.report import job_figures

        row = {"point": self._id(swept), "overrides": " ".join(swept)}
        t0 = time.perf_counter()
        try:
            cfg = job_config(["emulation.sandbox_ranks=[]", *self.base, *swept], self.config_file, self.script)
            cfg.emulation.sandbox_ranks = []
            if cfg.emulation.virtual_world_size is None:
                raise ConfigError("a sweep needs emulation.virtual_world_size")
        except ConfigError as err:
            return {**row, "status": f"invalid: {err}", "wall_s": 0.0}
        try:
            result = Capture(cfg, str(self.out / "points" / row["point"] / "capture"), workers=self.workers,
                             log=lambda s: None).run()
            graph = load_graph(result.graph_path)
            cluster = load_cluster(self.cluster)
            sim = Simulator(graph, cluster.cost_model()).run()
        except (CaptureFailed, SimulationError, ConfigError) as err:
            return {**row, "status": f"failed: {err}", "wall_s": round(time.perf_counter() - t0, 2)}
        figures = job_figures(sim.iteration_s, graph.world.world_size, str(graph.meta.get("config", "")),
                              cluster)
        peak = max(g.peak_bytes for g in graph.roles.values())
        return {**row, "status": "ok", "iteration_time_s": sim.iteration_s,
                "tokens_per_s_per_gpu": figures["tokens_per_s_per_gpu"], "mfu": figures["mfu"],
                "max_peak_bytes": peak, "oom": peak > cluster.gpu_memory_bytes,
                "wall_s": round(time.perf_counter() - t0, 2)}


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return [dict(r) for r in csv.DictReader(handle)]


def write_results(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: r.get(k, "") for k in COLUMNS})
    atomic_write_text(str(path), buf.getvalue())
    write_parquet(path.with_suffix(".parquet"), rows)


# results.parquet column types (the CSV's strings, typed; empty -> null)
_TYPES = {"iteration_time_s": float, "tokens_per_s_per_gpu": float, "mfu": float, "max_peak_bytes": int,
          "oom": lambda v: str(v) in ("True", "true", "1"), "wall_s": float}


def write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def typed(key: str, value):
        if value in ("", None):
            return None
        return _TYPES.get(key, str)(value)

    columns = {k: [typed(k, r.get(k)) for r in rows] for k in COLUMNS}
    kinds = {k: pa.float64() for k in ("iteration_time_s", "tokens_per_s_per_gpu", "mfu", "wall_s")}
    kinds.update(max_peak_bytes=pa.int64(), oom=pa.bool_())
    table = pa.table({k: pa.array(v, type=kinds.get(k, pa.string())) for k, v in columns.items()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(str(path), sink.getvalue().to_pybytes())


def ranked(rows: list[dict]) -> list[dict]:
    """Finished points by tokens/s/GPU, the ones that run out of memory after the others."""
    ok = [r for r in rows if r.get("status") == "ok"]
    return sorted(ok, key=lambda r: (is_oom(r), -float(r["tokens_per_s_per_gpu"])))


def is_oom(row: dict) -> bool:
    """The row's OOM flag (a bool fresh, a string read back from the CSV)."""
    return str(row.get("oom")) in ("True", "true", "1")


def ranking_png(path: Path, rows: list[dict]) -> None:
    """One bar per ranked point (height: tokens/s/GPU); bars of OOM points red, others viridis green."""
    import numpy as np

    from prism_megatron.moe.pictures import write_rgb_png

    values = [float(r["tokens_per_s_per_gpu"]) for r in rows] or [0.0]
    top = max(values) or 1.0
    height, bar, gap = 120, 16, 4
    img = np.full((height, len(values) * (bar + gap) + gap, 3), 255, dtype=np.uint8)
    for i, (v, r) in enumerate(zip(values, rows or [{}])):
        h = int(round(v / top * (height - 4)))
        colour = (200, 30, 30) if is_oom(r) else (33, 145, 140)
        x = gap + i * (bar + gap)
        img[height - h:, x:x + bar] = colour
    write_rgb_png(str(path), img)


def summary_json(rows: list[dict]) -> str:
    best = ranked(rows)[:1]
    return json.dumps({"points": rows, "ranked": ranked(rows), "best": best[0] if best else None}, indent=1)
