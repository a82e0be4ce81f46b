"""A real straggler against its emulation: per-rank iteration times, side by side.

Real: P data-parallel gloo processes of examples/pretrain_gpt.py, rank 1 slowed for real by the
injected fault (faults.inject, faults/inject.py). Emulated: the clean job captured once, then one
sandbox (rank 0) with the same fault injected into the replay's ghost rank 1. Each repetition runs
both; the per-rank medians (after 2 warm-up iterations) and their errors are printed, then per rank
the median over the repetitions of each side, its run-to-run spread and their error (a CPU process's
compute moves by about 5 % from one process to the next on the 2-core VM, captures and real runs
alike, so one repetition's error carries that noise); all written to
benchmarks/results/straggler_fidelity.json (or --json PATH).

CPU processes are not GPUs: the P processes of the real job share one host, and a lone capture
slice's compute need not be theirs (on the 16-core H200 host, P = 4, the emulation from lone
captures was 14 % faster than the real job in 5 of 6 repetitions). Two controls:
`--graph recorded` takes the clean job's graph from rank 0 of the clean job run for real on the P
processes (every rank recording itself, `--prism-trace-path`), just before the faulted run, so the
ghosts' compute is the job's own under the same sharing, and the comparison tests the fault's
modelling alone; `--co-load` runs the capture slice and the emulation's sandbox beside P - 1 plain
one-process runs of the same model.

    python benchmarks/straggler_fidelity.py [--nproc 2] [--reps 3] [--fault "slow(1, 1.5)"]
        [--graph capture|recorded] [--co-load]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    from prism_megatron.capture.run import Capture
    from prism_megatron.comm.cost import Calibration
    from prism_megatron.config import load_config
    from prism_megatron.config.loader import to_yaml
    from prism_megatron.emulate.run import Emulation
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.util import atomic_write_text, free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fault", default="slow(1, 1.5)")
    parser.add_argument("--calibration", default=str(REPO / "benchmarks" / "results" /
                                                     "calibration-cpu4.json"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--graph", choices=("capture", "recorded"), default="capture",
                        help="capture: the clean job's graph from `Capture` (one lone slice process); "
                             "recorded: from rank 0 of the clean job run for real on P processes")
    parser.add_argument("--co-load", action="store_true",
                        help="capture and emulate beside P - 1 processes training the same model")
    args = parser.parse_args()
    n = args.nproc
    shape = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=8",
             "model.seq_length=128", "train.micro_batch_size=2", f"train.global_batch_size={4 * n}",
             "train.iters=8", "train.device=cpu", "emulation.sandbox_ranks=[]"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    calibration = Calibration.from_json(Path(args.calibration).read_text())
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        config = tmp / "real.yaml"
        config.write_text(to_yaml(load_config([*shape, f"faults.inject={args.fault}"])))
        clean = tmp / "clean.yaml"
        clean.write_text(to_yaml(load_config(shape)))
        load = tmp / "load.yaml"
        load.write_text(to_yaml(load_config([*shape, "train.iters=1000000"])))
        beside = (lambda: _co_load(load, n - 1, env)) if args.co_load else contextlib.nullcontext
        print(f"{'rep':>4}{'rank':>6}{'real ms':>10}{'emulated ms':>13}{'error':>9}")
        script = REPO / "examples" / "pretrain_gpt.py"

        def real_run(yaml: Path, tag: str, *extra: str) -> list[float]:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                                   "--master-port", str(free_port()), str(script), "--prism-config", str(yaml),
                                   "--prism-summary-json", str(tmp / f"{tag}-{{rank}}.json"), *extra],
                                  capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
            if proc.returncode:
                raise RuntimeError(f"the real {tag} run failed: {proc.stderr[-3000:]}")
            return [statistics.median(json.loads((tmp / f"{tag}-{r}.json").read_text())
                                      ["iteration_times_ms"][2:]) * 1e-3 for r in range(n)]

        for rep in range(args.reps):  # real, capture and emulation interleaved: drift reaches both
            if args.graph == "recorded":  # the clean job on n processes, every rank recording itself
                real_run(clean, f"clean{rep}", "--prism-trace-path", str(tmp / f"rec{rep}" / "rank{rank}.prism"),
                         "--prism-trace-selection", "node-median")
                graph = str(tmp / f"rec{rep}" / "rank0.prism")
            real = real_run(config, f"real{rep}")
            if args.graph == "capture":
                job = load_config([*shape, f"emulation.virtual_world_size={n}"])
                with beside():
                    graph = Capture(job, str(tmp / f"capture{rep}"), workers=1, device="cpu",
                                    log=lambda s: None).run().graph_path
            with beside():
                emu = Emulation(graph, str(tmp / f"emu{rep}"), ["0"], load_cluster("cpu_host"), calibration,
                                device="cpu", faults=args.fault).run()["rank_iteration_time_s"]
            for rank in range(n):
                err = (emu[rank] / real[rank] - 1) * 100
                rows.append({"rep": rep, "rank": rank, "real_s": real[rank], "emulated_s": emu[rank],
                             "err_pct": err})
                print(f"{rep:>4}{rank:>6}{real[rank] * 1e3:>10.2f}{emu[rank] * 1e3:>13.2f}{err:>8.2f}%",
                      flush=True)
    errors = [abs(r["err_pct"]) for r in rows]
    print(f"per repetition: mean |error| {statistics.mean(errors):.2f}%, max {max(errors):.2f}%")
    print(f"{'rank':>6}{'real median ms':>16}{'spread':>8}{'emulated median ms':>20}{'spread':>8}{'error':>9}")
    medians = []
    for rank in range(n):
        real_s = [r["real_s"] for r in rows if r["rank"] == rank]
        emu_s = [r["emulated_s"] for r in rows if r["rank"] == rank]
        row = {"rank": rank, "real_median_s": statistics.median(real_s), "real_spread_pct": _spread(real_s),
               "emulated_median_s": statistics.median(emu_s), "emulated_spread_pct": _spread(emu_s)}
        row["err_pct"] = (row["emulated_median_s"] / row["real_median_s"] - 1) * 100
        medians.append(row)
        print(f"{rank:>6}{row['real_median_s'] * 1e3:>16.2f}{row['real_spread_pct']:>7.1f}%"
              f"{row['emulated_median_s'] * 1e3:>20.2f}{row['emulated_spread_pct']:>7.1f}%{row['err_pct']:>8.2f}%")
    errors = [abs(r["err_pct"]) for r in medians]
    print(f"medians over {args.reps} repetitions: mean |error| {statistics.mean(errors):.2f}%, "
          f"max {max(errors):.2f}%")
    path = args.json or str(REPO / "benchmarks" / "results" / "straggler_fidelity.json")
    atomic_write_text(path, json.dumps({"nproc": n, "fault": args.fault, "calibration": args.calibration,
                                        "cores": os.cpu_count(), "graph": args.graph, "co_load": args.co_load, "rows": rows,
                                        "medians": medians},
                                       indent=1))
    print(f"results: {path}")
    return 0


@contextlib.contextmanager
def _co_load(config: Path, count: int, env: dict):
    """`count` plain one-process runs of the job's model (`config`) training while the block runs:
    the load the real job's other processes put on the host. They get a head start past their
    imports, so the block's timed iterations run beside their training."""
    script = REPO / "examples" / "pretrain_gpt.py"
    procs = [subprocess.Popen([sys.executable, str(script), "--prism-config", str(config)], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]
    try:
        time.sleep(LOAD_HEAD_START_S if count else 0.0)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


LOAD_HEAD_START_S = 8.0


def _spread(values: list[float]) -> float:
    """(max - min) / median, in percent."""
    return (max(values) - min(values)) / statistics.median(values) * 100


if __name__ == "__main__":
    sys.exit(main())
