"""GPU-free capture and simulation of the large jobs people train, at 8192 ranks, on this machine.

Two jobs, fake execution predicting the H200 (`emulation.execution=fake`):

- `gpt175b_vpp3`: GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048), TP8 PP16 DP64 with
  interleaving (VPP 3: 2 layers per chunk), SP, distributed optimizer, global batch 2048
  (32 microbatches of 1 per pipeline);
- `llama3_70b_cp2`: a LLaMA-3-70B (80 layers, hidden 8192, GQA 8, SwiGLU, RMSNorm, RoPE, seq 8192,
  flash attention), TP8 PP4 CP2 DP128, SP, distributed optimizer, global batch 1024 (8 microbatches).

For each: `prism-megatron capture` into a fresh folder (wall time, slices run, and the largest
resident set of any of its processes, the capture's own or a slice's: `ru_maxrss` of its waited-for
children), then `prism-megatron simulate` of the graph on `dgx_h200` (wall time, the predicted
iteration). Issue [M]'s goal: capture <= 10 min and <= 8 GiB, simulate <= 1 min.

    python benchmarks/large_capture.py [--cases gpt175b_vpp3,llama3_70b_cp2] [--workers 2] [--json PATH]

Writes benchmarks/results/large_capture.json unless --json says otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORLD = ["emulation.virtual_world_size=8192", "emulation.execution=fake", "emulation.target_gpu=h200",
         "parallel.sequence_parallel=true", "model.params_dtype=bf16", "train.micro_batch_size=1",
         "train.use_distributed_optimizer=true", "train.iters=2"]
CASES = {
    "gpt175b_vpp3": [*WORLD, "model=gpt3_175b", "parallel.tp=8", "parallel.pp=16", "parallel.vpp=3",
                     "train.global_batch_size=2048"],
    "llama3_70b_cp2": [*WORLD, "model=llama3_70b", "model.normalization=RMSNorm",
                       "model.position_embedding_type=rope", "model.rotary_base=500000",
                       "model.attention_backend=flash", "parallel.tp=8", "parallel.pp=4", "parallel.cp=2",
                       "train.global_batch_size=1024"],
}
CLUSTER = "dgx_h200"
GOALS = {"capture_s": 600, "max_rss_bytes": 8 * 2**30, "simulate_s": 60}


def _timed(argv: list[str]) -> tuple[float, int]:
    """Run `argv` to its end; its wall time and the largest resident set of it or any child of it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    run = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:5])} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return wall_s, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def _case(name: str, work: Path, workers: int) -> dict:
    cli = [sys.executable, "-m", "prism_megatron.cli"]
    out = work / name
    capture_s, rss = _timed([*cli, "capture", *CASES[name], "--workers", str(workers), "--out", str(out / "capture"),
                             "--json", str(out / "capture.json")])
    captured = json.loads((out / "capture.json").read_text())
    simulate_s, _ = _timed([*cli, "simulate", str(out / "capture" / "graph.prism"), f"cluster={CLUSTER}",
                            "--json", str(out / "simulate.json")])
    simulated = json.loads((out / "simulate.json").read_text())
    row = {"case": name, "capture_s": round(capture_s, 1), "slices_run": captured["slices_run"],
           "roles_total": captured["roles_total"], "max_rss_bytes": rss,
           "graph_bytes": captured["graph_bytes"], "simulate_s": round(simulate_s, 1),
           "iteration_ms": round(simulated["iteration_time_s"] * 1e3, 2),
           "overrides": " ".join(CASES[name])}
    row["within_goals"] = all(row[k] <= v for k, v in GOALS.items())
    return row


def main() -> int:
    from prism_megatron.util import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--workers", type=int, default=2, help="slices at once (default 2)")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "large_capture.json"))
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"--cases {unknown[0]}: expected some of {', '.join(CASES)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-large-capture-") as work:
        for name in names:  # ru_maxrss of children only grows: each case in a process of its own
            with multiprocessing.get_context("fork").Pool(1) as pool:
                rows.append(pool.apply(_case, (name, Path(work), args.workers)))
    print(f"{'case':<16}{'capture s':>10}{'slices':>8}{'max RSS GiB':>12}{'simulate s':>11}{'iteration ms':>13}")
    for r in rows:
        print(f"{r['case']:<16}{r['capture_s']:>10.1f}{r['slices_run']:>8}{r['max_rss_bytes'] / 2**30:>12.2f}"
              f"{r['simulate_s']:>11.1f}{r['iteration_ms']:>13.2f}")
    result = {"benchmark": "large_capture",
              "command": f"python benchmarks/large_capture.py --cases {args.cases} --workers {args.workers}",
              "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU",
              "columns": ["case", "capture_s", "slices_run", "roles_total", "max_rss_bytes", "simulate_s",
                          "iteration_ms", "within_goals"],
              "goals": GOALS, "cluster": CLUSTER, "rows": rows}
    atomic_write_text(args.json, json.dumps(result, indent=1))
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
