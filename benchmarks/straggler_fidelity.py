"""A real straggler against its emulation: per-rank iteration times, side by side.

Real: P data-parallel gloo processes of examples/pretrain_gpt.py, rank 1 slowed for real by the
injected fault (faults.inject, faults/inject.py). Emulated: the clean job captured once, then one
sandbox (rank 0) with the same fault injected into the replay's ghost rank 1. Each repetition runs
both; the per-rank medians (after 2 warm-up iterations) and their errors are printed and written to
benchmarks/results/straggler_fidelity-<machine>-<date>.json.

    python benchmarks/straggler_fidelity.py [--nproc 2] [--reps 3] [--fault "slow(1, 1.5)"]
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
                                                     "calibration-cpu4-vm-2026-11-30.json"))
    parser.add_argument("--json", default=None)
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
        print(f"{'rep':>4}{'rank':>6}{'real ms':>10}{'emulated ms':>13}{'error':>9}")
        for rep in range(args.reps):  # real, capture and emulation interleaved: drift reaches both
            script = REPO / "examples" / "pretrain_gpt.py"
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                                   "--master-port", str(free_port()), str(script),
                                   "--prism-config", str(config), "--prism-summary-json",
                                   str(tmp / f"real{rep}-{{rank}}.json")],
                                  capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
            job = load_config([*shape, f"emulation.virtual_world_size={n}"])
            graph = Capture(job, str(tmp / f"capture{rep}"), workers=1, device="cpu",
                            log=lambda s: None).run().graph_path
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            real = [statistics.median(json.loads((tmp / f"real{rep}-{r}.json").read_text())
                                      ["iteration_times_ms"][2:]) * 1e-3 for r in range(n)]
            emu = Emulation(graph, str(tmp / f"emu{rep}"), ["0"], load_cluster("cpu_host"), calibration,
                            device="cpu", faults=args.fault).run()["rank_iteration_time_s"]
            for rank in range(n):
                err = (emu[rank] / real[rank] - 1) * 100
                rows.append({"rep": rep, "rank": rank, "real_s": real[rank], "emulated_s": emu[rank],
                             "err_pct": err})
                print(f"{rep:>4}{rank:>6}{real[rank] * 1e3:>10.2f}{emu[rank] * 1e3:>13.2f}{err:>8.2f}%",
                      flush=True)
    errors = [abs(r["err_pct"]) for r in rows]
    print(f"mean |error| {statistics.mean(errors):.2f}%, max {max(errors):.2f}%")
    path = args.json or str(REPO / "benchmarks" / "results" /
                            f"straggler_fidelity-{platform.node()}-{date.today()}.json")
    atomic_write_text(path, json.dumps({"nproc": n, "fault": args.fault, "calibration": args.calibration,
                                        "cores": os.cpu_count(), "rows": rows}, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
