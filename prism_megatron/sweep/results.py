"""The sweep's table: `<out>/results.csv` and `results.parquet`, one row per point in the sweep's order
(a search: trial order), one column per swept key, then the metrics; both rewritten atomically from
the points' rows (`points/<id>/row.json`), so the table never holds a partial or a duplicated row. The
ranking (rich), the best config, and the throughput-vs-memory plot with the feasible frontier."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from prism_megatron.sweep.evaluate import PointResult
from prism_megatron.sweep.points import values_of
from prism_megatron.util import atomic_write_bytes, atomic_write_text

METRICS = ("status", "iteration_time_s", "tokens_per_s_per_gpu", "mfu", "max_peak_bytes", "stage_peak_bytes",
           "fits", "exposed_comm_s", "bubble_s", "capture", "wall_s", "overrides")
"""The columns after the point id and the swept keys."""
_FLOATS = ("iteration_time_s", "tokens_per_s_per_gpu", "mfu", "exposed_comm_s", "bubble_s", "wall_s")


@dataclass
class Table:
    """The rows of one sweep and its swept keys (one column each)."""

    keys: list[str]
    rows: list[PointResult]
    trials: Optional[list[Optional[int]]] = None
    """A search's trial number per row (None: a grid)."""
    sibling_of: Optional[list[Optional[str]]] = None
    """A search's rows replayed from another trial's capture: that trial's point (None: a trial's own)."""

    def columns(self) -> list[str]:
        search = ["trial", "sibling_of"] if self.trials is not None else []
        return ["point", *search, *self.keys, *METRICS]

    def records(self) -> list[dict]:
        out = []
        for i, r in enumerate(self.rows):
            data = asdict(r)
            data["overrides"] = " ".join(r.overrides)
            data["stage_peak_bytes"] = " ".join(str(b) for b in r.stage_peak_bytes)
            record = {"point": r.point, **values_of(r.overrides, self.keys), **data}
            if self.trials is not None:
                record["trial"] = self.trials[i]
                record["sibling_of"] = self.sibling_of[i] if self.sibling_of else None
            out.append({c: record.get(c) for c in self.columns()})
        return out

    def ranked(self) -> list[PointResult]:
        """Simulated points by tokens/s/GPU, those that do not fit in memory after the others."""
        ok = [r for r in self.rows if r.status == "ok"]
        return sorted(ok, key=lambda r: (not r.fits, -(r.tokens_per_s_per_gpu or 0.0)))

    def best(self) -> Optional[PointResult]:
        fitting = [r for r in self.ranked() if r.fits]
        return fitting[0] if fitting else None


def write_table(out: Path, table: Table) -> None:
    """results.csv and results.parquet, each replaced atomically."""
    records = table.records()
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=table.columns())
    writer.writeheader()
    for rec in records:
        writer.writerow({k: "" if v is None else v for k, v in rec.items()})
    atomic_write_text(str(out / "results.csv"), buf.getvalue())
    _write_parquet(out / "results.parquet", table.columns(), records, table.keys)


def _write_parquet(path: Path, columns: list[str], records: list[dict], keys: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    kinds = {k: pa.float64() for k in _FLOATS}
    kinds.update(max_peak_bytes=pa.int64(), fits=pa.bool_(), trial=pa.int64())
    table = pa.table({c: pa.array([r[c] for r in records], type=kinds.get(c, pa.string())) for c in columns})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(str(path), sink.getvalue().to_pybytes())


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return [dict(r) for r in csv.DictReader(handle)]


def print_ranking(table: Table, out: Path, console=None) -> None:
    """The ranked table (rich): the swept settings, throughput, MFU, iteration time, peak, fits."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = console or Console(width=160)
    ranked = table.ranked()
    skipped = [r for r in table.rows if r.status != "ok"]
    console.print(f"{len(table.rows)} points: {len(ranked)} simulated, {len(skipped)} skipped or failed "
                  f"(results: {out / 'results.csv'})", highlight=False)
    grid = RichTable("rank", *table.keys, "tokens/s/GPU", "MFU %", "iteration ms", "peak MiB", "fits",
                     title="ranked by tokens/s/GPU (points that do not fit last)")
    for i, r in enumerate(ranked, start=1):
        shown = values_of(r.overrides, table.keys)
        grid.add_row(str(i), *(shown[k] for k in table.keys), f"{r.tokens_per_s_per_gpu:.1f}",
                     f"{r.mfu * 100:.2f}", f"{r.iteration_time_s * 1e3:.2f}", f"{r.max_peak_bytes / 2**20:.2f}",
                     "yes" if r.fits else "NO")
    console.print(grid)
    for r in skipped:
        shown = " ".join(f"{k}={v}" for k, v in values_of(r.overrides, table.keys).items())
        console.print(f"  skipped: {shown or ' '.join(r.overrides)}: {r.status}", highlight=False, markup=False)
    best = table.best()
    if best is not None:
        console.print(f"best: {' '.join(best.overrides)}", highlight=False, markup=False)
    elif ranked:
        console.print("best: none fits in the GPU's memory", highlight=False)


def frontier(rows: list[PointResult]) -> list[PointResult]:
    """The feasible frontier: fitting points that no other fitting point beats in throughput with no
    more memory, by peak memory."""
    fitting = sorted((r for r in rows if r.status == "ok" and r.fits),
                     key=lambda r: (r.max_peak_bytes, -r.tokens_per_s_per_gpu))
    front, top = [], float("-inf")
    for r in fitting:
        if r.tokens_per_s_per_gpu > top:
            front.append(r)
            top = r.tokens_per_s_per_gpu
    return front


def plot_frontier(path: Path, rows: list[PointResult], capacity_bytes: int) -> None:
    """tokens/s/GPU against peak memory per point (red: does not fit), the GPU's capacity, the frontier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.status == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for fits, colour, label in ((True, "#21918c", "fits"), (False, "#c81e1e", "does not fit")):
        mine = [r for r in ok if bool(r.fits) == fits]
        if mine:
            ax.scatter([r.max_peak_bytes / 2**20 for r in mine], [r.tokens_per_s_per_gpu for r in mine],
                       c=colour, label=label, s=24)
    front = frontier(ok)
    if front:
        ax.step([r.max_peak_bytes / 2**20 for r in front], [r.tokens_per_s_per_gpu for r in front],
                where="post", c="#440154", label="feasible frontier")
    ax.axvline(capacity_bytes / 2**20, ls="--", c="grey", label="GPU memory")
    ax.set_xscale("log")  # a tiny model's MiB and a GPU's GiB on one axis
    ax.set_xlabel("predicted peak memory per GPU (MiB, log scale)")
    ax.set_ylabel("tokens/s/GPU")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(str(path), buf.getvalue())


def summary_json(table: Table) -> str:
    best = table.best()
    return json.dumps({"keys": table.keys, "points": table.records(),
                       "ranked": [r.point for r in table.ranked()],
                       "best": asdict(best) if best else None}, indent=1)
