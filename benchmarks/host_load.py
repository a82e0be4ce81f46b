"""A GPU-free prediction on an idle and on a loaded CPU: the same figures.

Runs the default job (`prism-megatron train`: rank 4711 of GPT-175B, TP8 PP16 DP64 over 8192 ranks,
fake execution predicting the H200) twice in one go: alone, then beside `--burners` processes that
keep every core of this machine busy. A prediction depends on the config and the calibrations, not on
the CPU or its load (runtime/fake.py: nothing of the host time is measured here), so the modelled
iteration times and the predicted peak must agree; the wall time of the run shows the load.

    python benchmarks/host_load.py [--burners N] [--json PATH] [key=value ...]

Writes benchmarks/results/host_load.json unless --json says otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _burn() -> None:
    while True:  # a core's worth of Python until terminated
        sum(i * i for i in range(10_000))


def _predict(overrides: list[str], work: Path, name: str) -> dict:
    summary = work / f"{name.split()[0]}.json"
    load_1min = os.getloadavg()[0]  # what else ran: the "idle" run is only as idle as the machine
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "prism_megatron.cli", "train", *overrides, "--json", str(summary)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall_s = time.perf_counter() - start
    data = json.loads(summary.read_text())
    return {"load": name, "load_avg_1min_before": round(load_1min, 2), "wall_s": round(wall_s, 1), "iteration_times_ms": data["iteration_times_ms"],
            "peak_allocated_bytes": data["memory"]["peak_allocated_bytes"],
            "device_s": data["execution"]["device_s"]}


def main() -> int:
    from prism_megatron.util import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2,
                        help="busy processes beside the loaded run (default: one per core)")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "host_load.json"))
    parser.add_argument("overrides", nargs="*", help="config overrides of the default job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prism-host-load-") as name:
        work = Path(name)
        idle = _predict(args.overrides, work, "idle")
        burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
        for p in burners:
            p.start()
        try:
            loaded = _predict(args.overrides, work, f"loaded ({args.burners} busy processes)")
        finally:
            for p in burners:
                p.terminate()
                p.join()
    rows = [idle, loaded]
    for row in rows:
        row["last_iteration_ms"] = row["iteration_times_ms"][-1]
        row["difference_pct"] = (row["last_iteration_ms"] / idle["last_iteration_ms"] - 1) * 100
    print(f"{'load':<32}{'wall s':>8}{'iteration ms':>14}{'diff %':>9}{'peak GiB':>10}")
    for row in rows:
        print(f"{row['load']:<32}{row['wall_s']:>8.1f}{row['last_iteration_ms']:>14.3f}"
              f"{row['difference_pct']:>9.4f}{row['peak_allocated_bytes'] / 2**30:>10.3f}")
    result = {"benchmark": "host_load",
              "command": "python benchmarks/host_load.py" + "".join(f" {o}" for o in args.overrides),
              "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU",
              "columns": ["load", "load_avg_1min_before", "wall_s", "last_iteration_ms", "difference_pct", "peak_allocated_bytes"],
              "overrides": args.overrides, "rows": rows}
    atomic_write_text(args.json, json.dumps(result, indent=1))
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
