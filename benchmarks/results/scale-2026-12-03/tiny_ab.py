"""A/B of the backend's host time on one sandbox rank, per iteration, on this machine.

Runs one emulation's sandbox program (`emulate ... --out DIR` writes its config under DIR/sandbox)
from two checkouts in turn, ROUNDS times each, with `train.iters` raised to ITERS, and prints per
run the median over its iterations (the first left out) of the backend's host time and of its ratio
to the rest of the iteration (the virtual clock sleeps nothing, so the rest is the sandbox's own
work). One iteration's figure, which is what `emulate_scale.py` reports, moves by a point between
iterations on the 2-core VM; the median of many does not. (`../hostcost-2026-12-02/vm/emulate_ab.sh`
compares whole emulations, and with them that one iteration's figure.)

    python tiny_ab.py SANDBOX_DIR OLD_ROOT NEW_ROOT [--rounds 3] [--iters 60] [--rank 4711]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(root: Path, config: Path, rank: int, out: Path) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONWARNINGS="ignore")
    summary = out / f"summary{rank}.json"
    cmd = [sys.executable, str(root / "examples" / "pretrain_gpt.py"), "--prism-config", str(config),
           "--prism-sandbox-ranks", str(rank), "--prism-trace-path", str(out / "rank{rank}.prism"),
           "--prism-trace-selection", "node-median", "--device", "cpu",
           "--prism-summary-json", str(out / "summary{rank}.json")]
    subprocess.run(cmd, cwd=root, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = json.loads(summary.read_text())
    iters_ms = d["iteration_times_ms"][1:]
    backend_ms = [s * 1e3 for s in d["backend_host_s_per_iteration"][1:]]
    ratios = [b / (i - b) for i, b in zip(iters_ms, backend_ms)]
    return statistics.median(backend_ms), statistics.median(ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sandbox_dir", type=Path)
    parser.add_argument("old_root", type=Path)
    parser.add_argument("new_root", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--rank", type=int, default=4711)
    args = parser.parse_args()
    base = (args.sandbox_dir / "config.yaml").read_text().splitlines()
    lines = [f"  iters: {args.iters}" if line.startswith("  iters:") else line for line in base]
    results = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text("\n".join(lines) + "\n")
        for r in range(args.rounds):
            for side, root in (("old", args.old_root), ("new", args.new_root)):
                out = Path(tmp) / f"{side}{r}"
                out.mkdir()
                ms, ratio = run_once(root.resolve(), config, args.rank, out)
                results[side].append(ratio)
                print(f"round {r} {side}: backend {ms:.3f} ms/iteration, ratio {ratio * 100:.2f} %", flush=True)
    for side, ratios in results.items():
        print(f"{side}: median ratio {statistics.median(ratios) * 100:.2f} % "
              f"({', '.join(f'{x * 100:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
