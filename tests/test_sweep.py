"""`prism-megatron sweep`: Hydra's multirun grammar; a Hydra app whose points run as jobs of Hydra's
launchers (joblib processes, submitit's local executor); a killed sweep rerun recomputes no finished
point and its table has every point once; invalid layouts pruned before any capture; the capture
cache; an Optuna search that finds the grid's best point; the ranked table, best config and plot."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prism_megatron.config import ConfigError
from prism_megatron.moe.pictures import read_png_size
from prism_megatron.sweep.evaluate import PointResult, SweepSettings, capture_plan, point_config
from prism_megatron.sweep.points import expand, parse_space, split_hydra
from prism_megatron.sweep.results import Table, frontier, write_table

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
           PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
CLI = [sys.executable, "-m", "prism_megatron.cli", "sweep", "-m"]
TINY = ["model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
        "train.micro_batch_size=1", "train.iters=2", "train.device=cpu", "parallel.sequence_parallel=false"]
# Six points, two captures: tp=1,2 differ in the capture; the global batch only in the microbatch
# count, which the replay rewrites (the capture cache).
SWEEP6 = ["emulation.virtual_world_size=16", "parallel.tp=1,2", "parallel.pp=2", *TINY,
          "train.global_batch_size=32,48,64"]


def test_multirun_grammar_expands_to_the_cartesian_product():
    points = expand(["parallel.tp=2,4", "parallel.pp=range(1,4)", "model=choice(tiny,tiny_moe)",
                     "moe.imbalance='zipf(1.2)'", "train.iters=2"])
    assert len(points) == 2 * 3 * 2
    assert points[0] == ["parallel.tp=2", "parallel.pp=1", "model=tiny", "moe.imbalance='zipf(1.2)'",
                         "train.iters=2"]
    assert expand(["moe.imbalance=zipf(1.2)"]) == [["moe.imbalance=zipf(1.2)"]]  # passed as written
    with pytest.raises(ConfigError, match="quote values"):
        expand(["moe.imbalance=zipf(1.2),uniform"])
    assert expand(["model=glob(llama3_*)"], ["llama3_8b", "llama3_70b", "tiny"]) == [
        ["model=llama3_70b"], ["model=llama3_8b"]]
    with pytest.raises(ConfigError, match="glob"):
        expand(["parallel.tp=glob(*)"], ["tiny"])
    assert parse_space(["parallel.tp=1,2", "parallel.pp=2"]).swept_keys() == ["parallel.tp"]
    assert split_hydra(["parallel.tp=1,2", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
                        "sweep.captures=/c"]) == (["parallel.tp=1,2"], ["hydra/launcher=submitit_slurm",
                                                                       "hydra.launcher.partition=gpu",
                                                                       "sweep.captures=/c"])


def test_the_installed_command_finds_the_sweeper_from_any_folder(tmp_path):
    # `prism-megatron` (the console script) run outside the checkout: Hydra's plugin scan does not
    # see an editable install's `hydra_plugins`, so the app registers its sweeper itself
    command = Path(sys.executable).parent / "prism-megatron"
    if not command.exists():
        pytest.skip("the console script is not installed beside this interpreter")
    out = tmp_path / "sweep"
    run = subprocess.run([str(command), "sweep", "-m", "emulation.virtual_world_size=2", *TINY, "parallel.pp=1",
                          "parallel.tp=1,8", "train.global_batch_size=2", "--cluster", "cpu_host", "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={k: v for k, v in ENV.items() if k != "PYTHONPATH"})  # as a user runs it
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["parallel.tp"]: r for r in _csv(out)}  # 4 heads do not split 8 ways: tp=8 invalid
    assert rows["1"]["status"] == "ok" and float(rows["1"]["tokens_per_s_per_gpu"]) > 0
    assert rows["8"]["status"].startswith("invalid") and "num_attention_heads(4)" in rows["8"]["status"]


def test_a_layout_that_cannot_divide_is_pruned_with_its_reason():
    settings = SweepSettings(out="unused")
    base = ["emulation.virtual_world_size=16", *TINY]
    for bad, reason in (("parallel.pp=3", "num_layers(4) is not divisible by parallel.pp(3)"),
                        ("parallel.tp=8", "num_attention_heads(4) is not divisible")):
        with pytest.raises(ConfigError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            point_config(settings, [*base, "parallel.pp=1", "train.global_batch_size=16", bad])


def test_points_that_differ_in_the_microbatch_count_share_one_capture():
    settings = SweepSettings(out="unused")
    plans = {}
    for point in expand(SWEEP6):
        given = dict(o.split("=", 1) for o in point)
        plans[(given["parallel.tp"], given["train.global_batch_size"])] = \
            capture_plan(point_config(settings, point), share=True)
    assert len({p.key for p in plans.values()}) == 2  # one capture per tp
    assert {k: p.microbatches for k, p in plans.items()} == {  # the replay's count: batch / (1 x dp)
        ("1", "32"): 4, ("1", "48"): 6, ("1", "64"): 8, ("2", "32"): 8, ("2", "48"): 12, ("2", "64"): 16}
    assert all(p.cfg.train.global_batch_size == 4 * 16 // (2 * int(tp)) for (tp, _), p in plans.items())
    exact = capture_plan(point_config(settings, expand(SWEEP6)[2]), share=False)  # tp=1, batch 64
    assert exact.microbatches is None and exact.key != plans[("1", "64")].key


def _row(pid: str, tp: str, tokens: float, peak: int, fits: bool) -> PointResult:
    return PointResult(pid, [f"parallel.tp={tp}", "train.iters=2"], "ok", iteration_time_s=1.0,
                       tokens_per_s_per_gpu=tokens, mfu=0.1, max_peak_bytes=peak, stage_peak_bytes=[peak],
                       fits=fits, exposed_comm_s=0.0, bubble_s=0.0, capture="k", wall_s=1.0)


def test_the_table_has_a_column_per_swept_key_and_typed_parquet(tmp_path):
    import pyarrow.parquet as pq

    rows = [_row("a", "1", 10.0, 300, False), _row("b", "2", 8.0, 200, True), _row("c", "4", 9.0, 100, True),
            PointResult("d", ["parallel.tp=3", "train.iters=2"], "invalid: heads")]
    table = Table(["parallel.tp"], rows)
    write_table(tmp_path, table)
    with open(tmp_path / "results.csv", newline="") as handle:
        got = list(csv.DictReader(handle))
    assert [r["parallel.tp"] for r in got] == ["1", "2", "4", "3"]
    assert got[3]["status"] == "invalid: heads" and got[3]["tokens_per_s_per_gpu"] == ""
    typed = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert typed[0]["fits"] is False and isinstance(typed[1]["tokens_per_s_per_gpu"], float)
    assert [r.point for r in table.ranked()] == ["c", "b", "a"]  # fitting first, by throughput
    assert table.best().point == "c"
    assert [r.point for r in frontier(rows)] == ["c"]  # b needs more memory for less
    assert [r.point for r in frontier([*rows, _row("e", "8", 12.0, 250, True)])] == ["c", "e"]


def _csv(out: Path) -> list[dict]:
    path = out / "results.csv"
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _finished(out: Path) -> dict[str, float]:
    """Point id -> mtime of its row, for every point whose job finished."""
    return {p.parent.name: p.stat().st_mtime for p in (out / "points").glob("*/row.json")
            if json.loads(p.read_text())["status"] == "ok"}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
                                      ["hydra/launcher=submitit_local", "hydra.sweeper.batch=3"],
                                      pytest.param(["hydra/launcher=ray", "hydra.sweeper.batch=3"],
                                                   marks=pytest.mark.ray)],  # the [ray] extra's local Ray
                         ids=["joblib", "submitit_local", "ray"])
def test_a_killed_sweep_reruns_only_unfinished_points(launcher, tmp_path):
    out = tmp_path / "sweep"
    cmd = [*CLI, *SWEEP6, *launcher, "--cluster", "cpu_host", "--out", str(out)]
    t0 = time.time()
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=REPO,
                             start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline and len(_finished(out)) < 2:
        assert first.poll() is None, "the sweep ended before it could be killed"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # mid-sweep: the sweep, its point processes, their slices
    first.wait()
    time.sleep(1)
    done = _finished(out)
    assert 2 <= len(done) < 6, done
    second = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    print(f"{launcher[0]}: killed after {len(done)} points, whole sweep {time.time() - t0:.0f} s")
    assert f"{len(done)} of 6 points already done" in second.stderr
    for pid, stamp in done.items():  # finished points were not run again
        assert (out / "points" / pid / "row.json").stat().st_mtime == stamp
    rows = _csv(out)
    assert len(rows) == 6 and len({r["point"] for r in rows}) == 6  # every point once, none partial
    assert all(r["status"] == "ok" and float(r["tokens_per_s_per_gpu"]) > 0 for r in rows), rows
    assert {r["parallel.tp"] for r in rows} == {"1", "2"}
    assert {r["train.global_batch_size"] for r in rows} == {"32", "48", "64"}
    assert len({r["capture"] for r in rows}) == 2  # the cache: one capture per tp
    assert len(list((out / "captures").glob("*/graph.prism"))) == 2
    assert "best:" in second.stdout and "tokens/s/GPU" in second.stdout
    import pyarrow.parquet as pq

    table = pq.read_table(out / "results.parquet").to_pylist()  # the same rows, typed
    assert [r["point"] for r in table] == [r["point"] for r in rows]
    assert all(isinstance(r["tokens_per_s_per_gpu"], float) and isinstance(r["fits"], bool) for r in table)
    assert read_png_size(str(out / "frontier.png"))[0] > 0


# 256 ranks of a tiny model: tp x pp x micro-batch size x the global batch, 36 points of 18 captures
# (the cache: the global batch only changes the microbatch count, which the replay rewrites). Fake
# execution: the grid's figures are the cost model's, not this host's timing, so its best point is
# the same on every run, however loaded the machine.
SEARCH = ["emulation.virtual_world_size=256", "emulation.execution=fake", "parallel.tp=1,2,4", "parallel.pp=1,2,4",
          *[o for o in TINY if not o.startswith("train.micro_batch_size=")],
          "train.micro_batch_size=1,2", "train.global_batch_size=2048,4096"]
SEEDS = 10


@pytest.mark.slow
def test_an_optuna_search_of_12_trials_finds_the_grids_best_point(tmp_path):
    from prism_megatron.sweep.replay import captures_to_best, replay_search

    captures = tmp_path / "captures"
    common = ["--jobs", "2", f"sweep.captures={captures}"]
    t0 = time.time()
    grid = subprocess.run([*CLI, *SEARCH, *common, "--cluster", "cpu_host", "--out", str(tmp_path / "grid")],
                          capture_output=True, text=True, env=ENV, cwd=REPO, timeout=3000)
    assert grid.returncode == 0, grid.stderr[-3000:]
    t1 = time.time()
    rows = _csv(tmp_path / "grid")
    assert len(rows) == 36 and all(r["status"] == "ok" for r in rows), rows
    assert len(list(captures.glob("*/graph.prism"))) == 18
    # a GPU just too small for the fastest layout (its tp, pp and micro-batch, any batch): the
    # constraint decides
    layout = ("parallel.tp", "parallel.pp", "train.micro_batch_size")
    fastest = max(rows, key=lambda r: float(r["tokens_per_s_per_gpu"]))
    capacity = min(int(r["max_peak_bytes"]) for r in rows
                   if all(r[k] == fastest[k] for k in layout)) - 1
    fitting = [r for r in rows if int(r["max_peak_bytes"]) <= capacity]
    assert fitting, "no layout is smaller than the fastest one"
    best = max(fitting, key=lambda r: float(r["tokens_per_s_per_gpu"]))
    cluster = tmp_path / "small.yaml"
    text = (REPO / "prism_megatron" / "configs" / "cluster" / "cpu_host.yaml").read_text()
    cluster.write_text(text.replace("gpu_memory_bytes: 25769803776", f"gpu_memory_bytes: {capacity}"))
    out = tmp_path / "search"
    search = subprocess.run([*CLI, *SEARCH, *common, "--cluster", str(cluster), "hydra.sweeper.search=optuna",
                             "hydra.sweeper.n_trials=12", "hydra.sweeper.seed=0", "--out", str(out)],
                            capture_output=True, text=True, env=ENV, cwd=REPO, timeout=1800)
    assert search.returncode == 0, search.stderr[-3000:]
    t2 = time.time()
    evaluated = _csv(out)
    trials = [r for r in evaluated if not r["sibling_of"]]
    assert 0 < len(trials) <= 12 and len({r["point"] for r in evaluated}) == len(evaluated)
    assert len({r["capture"] for r in evaluated}) == len(trials)  # one capture per trial, the rest replays
    assert len(list(captures.glob("*/graph.prism"))) == 18  # the search captured nothing new
    found = max((r for r in evaluated if r["fits"] == "True"), key=lambda r: float(r["tokens_per_s_per_gpu"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["point"] == found["point"] == best["point"]  # the search's answer is the grid's
    assert float(found["tokens_per_s_per_gpu"]) == pytest.approx(float(best["tokens_per_s_per_gpu"]))
    reached = {}
    for seed in range(SEEDS):  # TPE is stochastic: the same search replayed on the grid, seed by seed
        replayed = replay_search(tmp_path / "grid", tmp_path / f"replay{seed}", SEARCH, str(cluster), seed)
        if seed == 0:
            assert [r.point for r in replayed.rows] == [r["point"] for r in evaluated]  # the search itself
        asked = [r for r, parent in zip(replayed.rows, replayed.sibling_of) if parent is None]
        assert len(asked) <= 12
        mine = [r for r in replayed.rows if r.point == best["point"]]
        reached[seed] = captures_to_best(replayed, mine[0]) if mine else None  # = trials: 1 capture each
    print(f"grid: 36 points in {t1 - t0:.0f} s; search: {len(trials)} trials, {len(evaluated)} points in "
          f"{t2 - t1:.0f} s; trials to the grid's best by seed: {reached}")
    missed = [seed for seed, n in reached.items() if n is None]
    assert not missed, f"seeds {missed} of {SEEDS} did not find the grid's best point"


class _Launcher:
    """A Hydra launcher stand-in: a job of parallel.tp=2 dies (its exception is the JobReturn's), the
    others write their rows as `run_point` would."""

    def __init__(self, out: Path) -> None:
        self.out, self.launched = out, []

    def launch(self, job_overrides, initial_job_idx):
        from hydra.core.utils import JobReturn, JobStatus

        from prism_megatron.sweep.evaluate import write_row

        returns = []
        for overrides in job_overrides:
            self.launched.append(list(overrides))
            pid = next(o.partition("=")[2] for o in overrides if o.startswith("sweep.point="))
            ret = JobReturn()
            if "parallel.tp=2" in overrides:
                ret.status, ret._return_value = JobStatus.FAILED, RuntimeError("node lost")
            else:
                write_row(self.out, _row(pid, "1", 5.0, 100, True))
                ret.status, ret._return_value = JobStatus.COMPLETED, {}
            returns.append(ret)
        return returns


def test_a_failed_job_is_its_points_row_with_the_reason_and_the_others_finish(tmp_path):
    from omegaconf import OmegaConf

    from prism_megatron.sweep.sweeper import SweepDriver

    driver = SweepDriver(batch=2)
    driver.config = OmegaConf.create({"sweep": {"out": str(tmp_path), "cluster": "cpu_host"},
                                      "hydra": {"launcher": {"n_jobs": 2}}})
    driver.launcher = _Launcher(tmp_path)
    points = ["emulation.virtual_world_size=16", "parallel.tp=1,2,8", "parallel.pp=1", *TINY,
              "train.global_batch_size=16", "sweep.captures=/shared"]
    table = driver.sweep(points)
    status = {dict(o.split("=", 1) for o in r.overrides)["parallel.tp"]: r.status for r in table.rows}
    assert status["1"] == "ok" and "node lost" in status["2"] and status["8"].startswith("invalid:")
    assert len(driver.launcher.launched) == 2  # the invalid layout never reached the launcher
    assert all("sweep.captures=/shared" in job for job in driver.launcher.launched)
    assert len(_csv(tmp_path)) == 3
    again = SweepDriver(batch=2)  # a rerun: only the failed point is tried again
    again.config, again.launcher = driver.config, _Launcher(tmp_path)
    again.sweep(points)
    assert [dict(o.split("=", 1) for o in job)["parallel.tp"] for job in again.launcher.launched] == ["2"]
    assert len(_csv(tmp_path)) == 3


class _Objective(_Launcher):
    """A launcher stand-in whose jobs score a point without a capture (its row names the capture it
    would replay): throughput grows with the batch and falls with tp and pp; tp=1 with pp=1 does not
    fit a 24 GiB GPU."""

    def launch(self, job_overrides, initial_job_idx):
        from hydra.core.utils import JobReturn, JobStatus

        from prism_megatron.sweep.evaluate import SweepSettings, capture_plan, point_config, write_row

        returns = []
        for overrides in job_overrides:
            self.launched.append(list(overrides))
            given = dict(o.split("=", 1) for o in overrides)
            tp, pp, gbs = (int(given[k]) for k in ("parallel.tp", "parallel.pp", "train.global_batch_size"))
            peak = 30 * 2**30 // (tp * pp)
            row = _row(given["sweep.point"], str(tp), gbs / 1024 * 8 / tp * 0.6 ** (pp - 1), peak, peak <= 24 * 2**30)
            row.overrides = [o for o in overrides if not o.startswith("sweep.")]
            row.capture = capture_plan(point_config(SweepSettings(str(self.out)), row.overrides), True).key
            write_row(self.out, row)
            ret = JobReturn()
            ret.status, ret._return_value = JobStatus.COMPLETED, {}
            returns.append(ret)
        return returns


def test_the_search_evaluates_at_most_n_trials_valid_points_and_resumes(tmp_path):
    from omegaconf import OmegaConf

    from prism_megatron.sweep.sweeper import SweepDriver

    space = ["emulation.virtual_world_size=256", "parallel.tp=1,2,4,8", "parallel.pp=1,2", *TINY,
             "train.global_batch_size=1024,2048,3072,4096"]  # tp=8: 4 heads do not divide, pruned

    def search(out: Path, siblings: bool) -> SweepDriver:
        made = SweepDriver(search="optuna", n_trials=12, seed=0, siblings=siblings)
        made.config = OmegaConf.create({"sweep": {"out": str(out), "cluster": "cpu_host"}, "hydra": {"launcher": {}}})
        made.launcher = _Objective(out)
        return made

    alone = search(tmp_path / "alone", siblings=False)  # each trial one point
    table = alone.sweep(space)
    launched = [dict(o.split("=", 1) for o in job) for job in alone.launcher.launched]
    assert 0 < len(launched) <= 12 and all(j["parallel.tp"] != "8" for j in launched)
    assert len({j["sweep.point"] for j in launched}) == len(launched)  # no point twice
    assert [r.point for r in table.rows] == [j["sweep.point"] for j in launched]  # trial order
    assert table.sibling_of == [None] * len(table.rows)

    driver = search(tmp_path / "shared", siblings=True)  # each trial its capture's points
    table = driver.sweep(space)
    launched = [dict(o.split("=", 1) for o in job) for job in driver.launcher.launched]
    assert len({j["sweep.point"] for j in launched}) == len(launched) == len(table.rows) == 24
    assert [r.point for r in table.rows] == [j["sweep.point"] for j in launched]
    trials = [r for r, parent in zip(table.rows, table.sibling_of) if parent is None]
    assert len(trials) == 6  # the 6 layouts (tp x pp); each capture's 4 batches: 1 trial, 3 siblings
    captures = {r.point: r.capture for r in table.rows}
    assert all(captures[r.point] == captures[p] for r, p in zip(table.rows, table.sibling_of) if p)
    assert len({r.capture for r in trials}) == 6
    best = dict(o.split("=", 1) for o in table.best().overrides)
    assert (best["parallel.tp"], best["parallel.pp"], best["train.global_batch_size"]) == ("1", "2", "4096")
    assert (tmp_path / "shared" / "optuna.db").exists()
    csv_rows = _csv(tmp_path / "shared")
    assert [r["sibling_of"] for r in csv_rows] == [p or "" for p in table.sibling_of]
    again = search(tmp_path / "shared", siblings=True)  # the study continues: every point is done
    resumed = again.sweep(space)
    assert [r.point for r in resumed.rows] == [r.point for r in table.rows]
    assert resumed.sibling_of == table.sibling_of and again.launcher.launched == []


def test_a_search_replayed_on_a_measured_grid_is_the_search_itself_with_no_job(tmp_path):
    from omegaconf import OmegaConf

    from prism_megatron.sweep.evaluate import read_row
    from prism_megatron.sweep.replay import (ReplayError, captures_to_best, grid_best, replay_search,
                                             trials_to_best)
    from prism_megatron.sweep.sweeper import SweepDriver

    space = ["emulation.virtual_world_size=256", "parallel.tp=1,2,4,8", "parallel.pp=1,2", *TINY,
             "train.global_batch_size=1024,2048,3072,4096"]

    def driver(out: Path, **search) -> SweepDriver:
        made = SweepDriver(**search)
        made.config = OmegaConf.create({"sweep": {"out": str(out), "cluster": "cpu_host"}, "hydra": {"launcher": {}}})
        made.launcher = _Objective(out)
        return made

    grid = tmp_path / "grid"  # the measured grid: every point scored by _Objective
    rows = [read_row(grid, r.point) for r in driver(grid).sweep(space).rows if r.status == "ok"]
    direct = driver(tmp_path / "search", search="optuna", n_trials=12, seed=3).sweep(space)
    replayed = replay_search(grid, tmp_path / "replay", space, "cpu_host", seed=3)
    assert [r.point for r in replayed.rows] == [r.point for r in direct.rows]  # the same trials, in order
    best = grid_best(rows, 24 * 2**30)
    assert dict(o.split("=", 1) for o in best.overrides)["parallel.pp"] == "2"  # tp=1, pp=1 does not fit
    points = [r.point for r in replayed.rows]
    assert best.point in points  # the grid's 6 captures are fewer than 12 trials
    at = points.index(best.point)
    assert trials_to_best(replayed, best) == sum(1 for s in replayed.sibling_of[:at + 1] if s is None)
    assert captures_to_best(replayed, best) == len({r.capture for r in replayed.rows[:at + 1]})
    assert trials_to_best(replayed, best) == captures_to_best(replayed, best)  # one capture per trial
    with pytest.raises(ReplayError, match="no row"):  # a point outside the grid is not made up
        replay_search(grid, tmp_path / "wider", [*space[:-1], "train.global_batch_size=1024,8192"],
                      "cpu_host", seed=0)
