"""`prism-megatron sweep`: Hydra multirun grammar, invalid points skipped with the reason, a killed
sweep resumes without rerunning finished points, ranked table, best config and plot."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prism_megatron.config import ConfigError
from prism_megatron.moe.pictures import read_png_size
from prism_megatron.sweep.points import expand

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
SWEEP = ["emulation.virtual_world_size=16", "parallel.tp=1,2", "parallel.pp=range(1,4)", "model.num_layers=4",
         "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
         "train.global_batch_size=16", "train.micro_batch_size=1", "train.iters=2", "train.device=cpu"]


def test_multirun_grammar_expands_to_the_cartesian_product():
    points = expand(["parallel.tp=2,4", "parallel.pp=range(1,4)", "model=choice(tiny,tiny_moe)",
                     "moe.imbalance='zipf(1.2)'", "train.iters=2"])
    assert len(points) == 2 * 3 * 2
    assert points[0] == ["parallel.tp=2", "parallel.pp=1", "model=tiny", "moe.imbalance='zipf(1.2)'",
                         "train.iters=2"]
    assert expand(["moe.imbalance=zipf(1.2)"]) == [["moe.imbalance=zipf(1.2)"]]  # passed as written
    with pytest.raises(ConfigError, match="quote values"):
        expand(["moe.imbalance=zipf(1.2),uniform"])


def _rows(out: Path) -> list[dict]:
    path = out / "results.csv"
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_a_killed_sweep_resumes_without_rerunning_finished_points(tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "prism_megatron.cli", "sweep", "-m", *SWEEP, "--cluster", "cpu_host",
           "--out", str(out)]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=REPO,
                             start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and len([r for r in _rows(out) if r["status"] == "ok"]) < 2:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # halfway: the sweep and its capture slices
    first.wait()
    done = {r["point"]: r for r in _rows(out) if r["status"] == "ok"}
    assert 2 <= len(done) < 4
    stamps = {p: (out / "points" / p / "capture" / "graph.prism").stat().st_mtime for p in done}
    second = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "already done" in second.stderr
    for p, stamp in stamps.items():  # finished points were not captured again
        assert (out / "points" / p / "capture" / "graph.prism").stat().st_mtime == stamp
    rows = _rows(out)
    assert len(rows) == 6 and sum(r["status"] == "ok" for r in rows) == 4
    invalid = [r for r in rows if r["status"].startswith("invalid")]
    assert len(invalid) == 2 and all("parallel.pp(3)" in r["status"] for r in invalid)
    assert "best:" in second.stdout and "rank  tokens/s/GPU" in second.stdout
    import pyarrow.parquet as pq

    table = pq.read_table(out / "results.parquet").to_pylist()  # the same rows, typed
    assert [r["point"] for r in table] == [r["point"] for r in rows]
    assert all(isinstance(r["tokens_per_s_per_gpu"], float) and isinstance(r["oom"], bool)
               for r in table if r["status"] == "ok")
    assert read_png_size(str(out / "ranking.png"))[0] > 0
