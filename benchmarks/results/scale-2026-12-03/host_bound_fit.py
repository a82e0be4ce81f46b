"""(session 31) The host-bound probe against the measured compute, over emulations of one graph.

Reads `emulate_scale.py --json` outputs (default: this directory's pace-*-s31.json, rank 4711 of the
175B job on one H200) and prints per run the sandbox's compute, the backend's host time per
operation, the device overhead ratio and the probe's figures (trace/iterations.py `host_bound`), then
the least-squares line compute = a * idle_compute + b and the correlation of the two.

    python benchmarks/results/scale-2026-12-03/host_bound_fit.py [FILE ...]
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np


def main(paths: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = paths or sorted(glob.glob(os.path.join(here, "pace-*-s31.json")))
    if not paths:
        print("host_bound_fit: no emulate_scale.py JSON given or found; pass their paths", file=sys.stderr)
        return 2
    idle, compute, share = [], [], []
    print(f"{'run':>22}{'compute ms':>12}{'us/op':>7}{'on device':>11}{'idle ops':>10}{'idle ms':>9}{'share':>8}")
    for path in paths:
        row = json.load(open(path))["rows"][0]
        bound = row.get("host_bound")
        if not bound:
            print(f"host_bound_fit: {path} has no host_bound figures (a host clock, or an older run)",
                  file=sys.stderr)
            return 2
        idle.append(bound["idle_compute_s"] * 1e3)
        compute.append(row["compute_s"] * 1e3)
        share.append(bound["share"] * 100)
        print(f"{os.path.basename(path):>22}{compute[-1]:>12.2f}{row['backend_host_s_per_op'] * 1e6:>7.0f}"
              f"{row['device_overhead_ratio'] * 100:>10.2f}%{bound['idle_ops']:>5}/{bound['ops']:<4}"
              f"{idle[-1]:>9.2f}{bound['share'] * 100:>7.1f}%")
    x, y = np.asarray(idle), np.asarray(compute)
    a, b = np.polyfit(x, y, 1)
    r = np.corrcoef(x, y)[0, 1]
    print(f"compute = {a:.3f} * idle_compute + {b:.2f} ms; correlation {r:.3f} over {len(x)} runs; "
          f"compute {y.min():.2f}-{y.max():.2f} ms, share {min(share):.1f}-{max(share):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
