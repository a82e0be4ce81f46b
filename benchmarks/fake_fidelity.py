"""Fake execution on this CPU against real runs on the H200 machine: iteration time and memory.

For each [D] GPU config (benchmarks/fidelity.py's CONFIGS with its `cuda` shapes: 8 layers, hidden 4096,
seq 2048, bf16), one process on this CPU captures the job under fake tensors (`emulation.execution=fake`,
kernel costs of the shipped H200 calibration, the CUDA caching-allocator model) and emulates it with the
same network model and calibration as the GPU harness. The prediction is compared with figures measured
on the H200 machine and committed:

- iteration time: the real 2-GPU job's median (benchmarks/results/fidelity.json, fidelity-zero2.json and
  fidelity-moe_ep2.json; `--real FILE` names others);
- peak allocated and reserved memory: the caching allocator of the sandbox rank on one H200
  (benchmarks/results/gpu_memory_trace/<config>.npz from benchmarks/gpu_memory_trace.py; its
  allocated peak equals the real 2-GPU job's to the byte, checked in the table).

    python benchmarks/fake_fidelity.py [--configs tp2 pp2_1f1b dp2_distopt_overlap] [--json PATH]

Writes benchmarks/results/fake_fidelity.json unless --json says otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

RESULTS = REPO / "benchmarks" / "results"
REAL = {  # config -> committed real 2x H200 runs (benchmarks/fidelity.py)
    "tp2": ["fidelity.json", "fidelity-zero2.json"],
    "pp2_1f1b": ["fidelity.json"],
    "dp2_distopt_overlap": ["fidelity.json"],
    "moe_ep2": ["fidelity-moe_ep2.json"],
}
MEMORY = RESULTS / "gpu_memory_trace"
MEMORY_FILES = {"tp2": "tp2.npz", "pp2_1f1b": "pp2.npz", "dp2_distopt_overlap": "dp2.npz",
                "moe_ep2": "moe.npz"}


def real_figures(name: str, extra: list[str]) -> dict:
    runs = []
    for file in [*extra, *REAL.get(name, [])]:
        path = Path(file) if Path(file).is_absolute() else RESULTS / file
        for row in json.loads(path.read_text())["rows"]:
            if row["config"] == name:
                runs.append({"file": path.name, "iter_s": row["real_iter_s_median"],
                             "spread_pct": row["real_spread_pct"], "peak_bytes": row["real_peak_bytes"]})
    memory = {}
    if name in MEMORY_FILES and (MEMORY / MEMORY_FILES[name]).is_file():
        figures = json.loads(str(np.load(MEMORY / MEMORY_FILES[name])["figures"]))
        memory = {"allocated": figures["max_memory_allocated"], "reserved": figures["max_memory_reserved"]}
    return {"runs": runs, "memory": memory}


def predict(name: str, tmp: Path, calibration) -> dict:
    import fidelity

    from prism_megatron.capture.run import Capture
    from prism_megatron.config import load_config
    from prism_megatron.config.loader import to_yaml
    from prism_megatron.emulate.run import Emulation
    from prism_megatron.sim.cluster import load_cluster

    world, overrides, sandbox = fidelity.CONFIGS[name]
    cfg = load_config([*fidelity.SHAPES["cuda"], *overrides, "train.iters=3", "train.device=cpu",
                       "emulation.sandbox_ranks=[]", "emulation.execution=fake", "emulation.target_gpu=h200"])
    cfg.check_world(world)
    config = tmp / f"{name}.yaml"
    config.write_text(to_yaml(cfg))
    start = time.perf_counter()
    job = load_config([f"emulation.virtual_world_size={world}"], str(config))
    graph = Capture(job, str(tmp / f"{name}-capture"), workers=1, device="cpu", log=lambda s: None).run()
    capture_s = time.perf_counter() - start
    summary = Emulation(graph.graph_path, str(tmp / f"{name}-emu"), sandbox, load_cluster("h200x2"),
                        calibration, device="cpu").run()
    return {"capture_s": capture_s, "emulate_s": summary["wall_s"], "iter_s": summary["iteration_time_s"],
            "sandbox": summary["sandbox"][0], "compute_durations_from": summary["compute_durations_from"]}


def main() -> int:
    from prism_megatron.comm.cost import Calibration
    from prism_megatron.util import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(REAL))
    parser.add_argument("--real", nargs="*", default=[], help="more fidelity JSON files with real runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    unknown = [c for c in args.configs if c not in REAL]
    if unknown:
        print(f"error: configs {unknown}: expected some of {', '.join(REAL)}", file=sys.stderr)
        return 2
    calibration_path = RESULTS / "calibration-h200x2.json"
    calibration = Calibration.from_json(calibration_path.read_text())
    path = args.json or str(RESULTS / "fake_fidelity.json")
    rows = []
    print(f"{'config':>20}{'real ms':>10}{'fake ms':>10}{'error':>8}{'alloc err':>11}{'reserved err':>14}"
          f"{'capture s':>11}")
    with tempfile.TemporaryDirectory() as name:
        for config in args.configs:
            real = real_figures(config, args.real)
            fake = predict(config, Path(name), calibration)
            real_s = statistics.median(r["iter_s"] for r in real["runs"])
            mem = real["memory"]
            alloc, reserved = fake["sandbox"]["peak_allocated_bytes"], fake["sandbox"]["peak_reserved_bytes"]
            row = {"config": config, "real_iter_s": real_s, "real_runs": real["runs"],
                   "fake_iter_s": fake["iter_s"],
                   "iter_err_pct": (fake["iter_s"] / real_s - 1) * 100,
                   "real_peak_allocated": mem.get("allocated"), "fake_peak_allocated": alloc,
                   "alloc_err_pct": (alloc / mem["allocated"] - 1) * 100 if mem else None,
                   "real_peak_reserved": mem.get("reserved"), "fake_peak_reserved": reserved,
                   "reserved_err_pct": (reserved / mem["reserved"] - 1) * 100 if mem else None,
                   "real_2gpu_peak_allocated": [r["peak_bytes"] for r in real["runs"]],
                   "capture_s": fake["capture_s"], "emulate_s": fake["emulate_s"],
                   "compute_durations_from": fake["compute_durations_from"], "sandbox": fake["sandbox"]}
            rows.append(row)
            atomic_write_text(path, json.dumps({"machine": platform.node(), "date": str(date.today()),
                                                "network_calibration": calibration_path.name, "rows": rows},
                                               indent=1))
            nan = float("nan")
            print(f"{config:>20}{real_s * 1e3:>10.2f}{fake['iter_s'] * 1e3:>10.2f}"
                  f"{row['iter_err_pct']:>7.2f}%"
                  f"{row['alloc_err_pct'] or nan:>10.3f}%{row['reserved_err_pct'] or nan:>13.3f}%"
                  f"{fake['capture_s']:>11.1f}", flush=True)
    errors = [abs(r["iter_err_pct"]) for r in rows]
    print(f"mean |iteration error| {statistics.mean(errors):.2f}%, max {max(errors):.2f}%")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
