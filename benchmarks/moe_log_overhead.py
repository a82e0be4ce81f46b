"""Benchmark: the MoE load log's cost: iteration time with `moe.log_path` on against off, one run.

A sandbox of an EP4 MoE job (8 experts, top-2, zipf(1.2) routing) trains `--iters` iterations with
the log off and on, alternating, `--reps` times each; per side the median iteration time after the
first two iterations of every run. Issue [E]'s goal: on / off <= 1.02.

    python benchmarks/moe_log_overhead.py [--reps 3] [--iters 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JOB = ["--device", "cpu", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
       "--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "2",
       "--expert-model-parallel-size", "4", "--global-batch-size", "16", "--micro-batch-size", "2",
       "--prism-moe-imbalance", "zipf(1.2)",
       "--prism-virtual-world-size", "4", "--prism-sandbox-ranks", "1"]


def run(tmp: str, iters: int, log: bool, tag: str) -> list[float]:
    summary = os.path.join(tmp, f"{tag}.json")
    extra = ["--prism-moe-log-path", os.path.join(tmp, f"{tag}{{rank}}.jsonl")] if log else []
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), *JOB,
                           "--train-iters", str(iters), "--prism-summary-json", summary, *extra],
                          capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(Path(summary).read_text())["iteration_times_ms"][2:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    times = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for side in ("off", "on"):
                times[side] += run(tmp, args.iters, side == "on", f"{side}{rep}")
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"iteration ms (median of {len(times['off'])}): log off {off:.2f}, log on {on:.2f}, "
          f"ratio {on / off:.4f} (goal <= 1.02)")
    if args.json:
        from prism_megatron.util import atomic_write_text

        atomic_write_text(args.json, json.dumps({"date": str(date.today()), "machine": platform.node(),
                                                 "job": JOB, "iteration_ms": times, "median_off_ms": off,
                                                 "median_on_ms": on, "ratio": on / off}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
