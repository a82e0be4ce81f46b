"""A 48-point GPU-free tuning sweep of a GPT-3-like model at 1,024 ranks: wall time with 1 and 2 local
workers, the captures the cache actually ran, and how many Optuna trials reach the grid's best point.

The grid: a GPT-3 13B-shaped model (40 layers, hidden 5120, 40 heads, seq 2048) on 1,024 H200s
(`dgx_h200`), fake execution, TP 2/4/8 x PP 2/4 x micro-batch 1/2 x global batch 1024/1536/2048/3072:
48 points of 12 layouts, 14 captures: the global batch only changes the 1F1B micro-batch count, which
the replay rewrites (the capture cache), except for a point whose count is below pp + 1, which is
captured at its own batch. The sweep runs twice from nothing (each with its own empty cache),
`--jobs 1` and `--jobs 2` (joblib processes); both tables must agree point by point (predictions are
deterministic). Then the sweeper's Optuna search (`hydra.sweeper.search=optuna`) is replayed on the
measured grid (sweep/replay.py: the same search, each trial answered by the grid's row) for `--seeds`
seeds, `--trials` trials each (a trial is a capture, its points sharing it replayed beside it): the
trial at which each first evaluated the grid's fastest fitting point, and the captures run by then.

    python benchmarks/sweep_scale.py [--seeds N] [--trials N] [--keep DIR] [--json PATH]
    python benchmarks/sweep_scale.py --searches-from DIR [--seeds N] [--trials N] [--json PATH]

`--keep DIR` keeps the two sweeps' folders (their rows and captures) and their figures
(`sweeps.json`) there; `--searches-from DIR` replays the searches on such a kept grid, without
sweeping again (the search is the only part that changes with the sweeper's code).

Writes benchmarks/results/sweep_scale.json unless --json says otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CLUSTER = "dgx_h200"
GRID = ["emulation.virtual_world_size=1024", "emulation.execution=fake", "model.num_layers=40",
        "model.hidden_size=5120", "model.num_attention_heads=40", "model.seq_length=2048",
        "model.vocab_size=51200", "train.iters=2", "parallel.tp=2,4,8", "parallel.pp=2,4",
        "train.micro_batch_size=1,2", "train.global_batch_size=1024,1536,2048,3072"]
POINTS = 48


def _sweep(work: Path, jobs: int) -> dict:
    out, captures = work / f"jobs{jobs}", work / f"captures{jobs}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "sweep", "-m", *GRID, "--jobs", str(jobs),
                          f"sweep.captures={captures}", "--cluster", CLUSTER, "--out", str(out)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall_s = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"sweep --jobs {jobs} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    statuses = [r["status"] for r in rows]
    return {"jobs": jobs, "wall_s": round(wall_s, 1), "points": len(rows),
            "points_ok": statuses.count("ok"), "points_failed": sum(s.startswith("failed") for s in statuses),
            "points_invalid": sum(s.startswith("invalid") for s in statuses),
            "captures_run": len(list(captures.glob("*/graph.prism"))),
            "capture_keys_used": len({r["capture"] for r in rows if r["status"] == "ok"}),
            "fitting_points": sum(r["fits"] == "True" for r in rows),
            "_out": out, "_rows": rows}


def _agree(a: list[dict], b: list[dict]) -> float:
    """The largest relative tokens/s/GPU difference between two tables' same points (0: identical)."""
    other = {r["point"]: r for r in b}
    worst = 0.0
    for r in a:
        if r["status"] == "ok":
            x, y = float(r["tokens_per_s_per_gpu"]), float(other[r["point"]]["tokens_per_s_per_gpu"])
            worst = max(worst, abs(x - y) / x)
    return worst


def _searches(grid: Path, work: Path, seeds: int, trials: int) -> dict:
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.sweep.evaluate import read_row
    from prism_megatron.sweep.replay import captures_to_best, grid_best, replay_search, trials_to_best

    capacity = load_cluster(CLUSTER).gpu_memory_bytes
    rows = [r for r in (read_row(grid, p.name) for p in (grid / "points").iterdir()) if r is not None]
    best = grid_best(rows, capacity)
    reached, captures = [], []
    start = time.perf_counter()
    for seed in range(seeds):
        table = replay_search(grid, work / f"replay{seed}", GRID, CLUSTER, seed=seed, n_trials=trials)
        reached.append(trials_to_best(table, best))
        captures.append(captures_to_best(table, best))
    found = [c for c in captures if c is not None]
    return {"best_point": best.point, "best_overrides": " ".join(o for o in best.overrides if "," not in o),
            "best_tokens_per_s_per_gpu": round(best.tokens_per_s_per_gpu, 1),
            "seeds": seeds, "n_trials": trials, "seeds_finding_best": len(found),
            "captures_to_best_median": statistics.median(found) if found else None,
            "captures_to_best_max": max(found) if found else None,
            "trials_to_best_median": statistics.median(t for t in reached if t is not None) if found else None,
            "captures_to_best": captures, "trials_to_best": reached,
            "replay_s": round(time.perf_counter() - start, 1)}


def main() -> int:
    from prism_megatron.util import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="Optuna seeds replayed (default 20)")
    parser.add_argument("--trials", type=int, default=12, help="trials (captures) per search (default 12)")
    parser.add_argument("--keep", default=None, help="keep the sweeps' folders here (default: deleted)")
    parser.add_argument("--searches-from", default=None, metavar="DIR",
                        help="replay the searches on the grid kept in DIR (--keep) instead of sweeping")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "sweep_scale.json"))
    args = parser.parse_args()
    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        raise SystemExit(f"--keep {args.keep}: not empty; give a new folder")
    with tempfile.TemporaryDirectory(prefix="prism-sweep-scale-") as name:
        if args.searches_from:
            kept = Path(args.searches_from)
            swept = json.loads((kept / "sweeps.json").read_text())
            runs, difference = swept["rows"], swept["max_tokens_per_s_difference_between_runs"]
            search = _searches(kept / "jobs2", Path(name), args.seeds, args.trials)
        else:
            work = Path(args.keep or name)
            work.mkdir(parents=True, exist_ok=True)
            runs = [_sweep(work, 1), _sweep(work, 2)]
            for run in runs:
                if run["points"] != POINTS or run["points_failed"]:
                    raise SystemExit(f"sweep --jobs {run['jobs']}: {run['points']} rows, {run['points_failed']} failed")
            difference = _agree(runs[0]["_rows"], runs[1]["_rows"])
            search = _searches(runs[1]["_out"], Path(name), args.seeds, args.trials)
            for run in runs:
                del run["_out"], run["_rows"]
            atomic_write_text(str(work / "sweeps.json"), json.dumps(
                {"rows": runs, "max_tokens_per_s_difference_between_runs": difference}, indent=1))
    print(f"{'jobs':>4}{'wall s':>9}{'points':>8}{'ok':>5}{'captures':>10}{'fit':>5}")
    for run in runs:
        print(f"{run['jobs']:>4}{run['wall_s']:>9.1f}{run['points']:>8}{run['points_ok']:>5}"
              f"{run['captures_run']:>10}{run['fitting_points']:>5}")
    print(f"speedup with 2 workers: {runs[0]['wall_s'] / runs[1]['wall_s']:.2f}x; "
          f"largest tokens/s difference between the two: {difference:.2e}")
    print(f"optuna ({args.trials} trials): {search['seeds_finding_best']} of {args.seeds} seeds reach the grid's "
          f"best, at trial {search['trials_to_best_median']} (median), after {search['captures_to_best_median']} "
          f"captures (median), {search['captures_to_best_max']} at most")
    result = {"benchmark": "sweep_scale",
              "command": (f"python benchmarks/sweep_scale.py --keep DIR; python benchmarks/sweep_scale.py "
                          f"--searches-from DIR --seeds {args.seeds} --trials {args.trials}" if args.searches_from else
                          f"python benchmarks/sweep_scale.py --seeds {args.seeds} --trials {args.trials}"),
              "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU",
              "columns": ["jobs", "wall_s", "points", "points_ok", "points_invalid", "captures_run",
                          "capture_keys_used", "fitting_points"],
              "grid": GRID, "cluster": CLUSTER, "rows": runs,
              "speedup_2_workers": round(runs[0]["wall_s"] / runs[1]["wall_s"], 3),
              "max_tokens_per_s_difference_between_runs": difference, "optuna": search}
    atomic_write_text(args.json, json.dumps(result, indent=1))
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
