"""Benchmark: slicing capture of an N = 8192 job (TP8 PP16 DP64, tiny layers) on this machine.

Runs `prism-megatron capture` on the built-in default config (or `--config`/overrides) into a fresh
directory and prints, side by side: the roles of the world, the slices run, the roles inferred from
verified symmetric probes, the wall time, the graph file size and its load+check time, and what a
capture of every role (no symmetry) would have cost at the measured time per slice. Issue [B]'s goal:
at most one slice per distinct role (here <= 16, with tensor symmetry verified).

    python benchmarks/capture_scale.py [key=value ...] [--workers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prism_megatron.capture.run import Capture  # noqa: E402
from prism_megatron.config import load_config  # noqa: E402
from prism_megatron.graph import load_graph  # noqa: E402
from prism_megatron.util import atomic_write_text  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_8192.yaml"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = load_config(["emulation.sandbox_ranks=[]", *args.overrides], args.config)
    with tempfile.TemporaryDirectory() as tmp:
        capture = Capture(cfg, os.path.join(tmp, "cap"), workers=args.workers, device=args.device,
                          log=lambda s: None)
        result = capture.run()
        t0 = time.perf_counter()
        graph = load_graph(result.graph_path)
        load_s = time.perf_counter() - t0
    per_slice_s = result.wall_s * args.workers / max(result.slices_run, 1)
    every_role_s = per_slice_s * result.roles_total / args.workers
    world = graph.world
    row = {
        "date": str(date.today()), "machine": platform.node(), "cpus": os.cpu_count(),
        "device": args.device, "workers": args.workers,
        "n_ranks": world.world_size, "tp": world.tp, "pp": world.pp, "dp": world.dp,
        "roles_total": result.roles_total, "classes": result.classes,
        "slices_run": result.slices_run, "roles_captured": len(result.roles_captured),
        "roles_inferred": len(result.roles_inferred), "wall_s": result.wall_s,
        "graph_bytes": result.graph_bytes, "graph_load_check_s": round(load_s, 4),
        "nodes_per_role": sorted({g.num_nodes for g in graph.roles.values()}),
        "est_slice_s": round(per_slice_s, 2), "est_every_role_wall_s": round(every_role_s, 1),
    }
    print(f"N={world.world_size} (TP{world.tp} PP{world.pp} DP{world.dp}), {result.roles_total} roles, "
          f"{len(result.classes)} classes, {args.workers} workers on {os.cpu_count()} CPUs")
    print(f"{'':28}{'slices':>8}{'wall s':>9}")
    print(f"{'capture with symmetry':28}{result.slices_run:>8}{result.wall_s:>9.1f}")
    print(f"{'every role (estimated)':28}{result.roles_total:>8}{every_role_s:>9.1f}"
          f"   ratio {every_role_s / result.wall_s:.1f}x")
    for c in result.classes:
        print(f"  class {c['key']:>16}: {c['roles']:4d} roles, symmetric={c['symmetric']}")
    print(f"roles inferred {row['roles_inferred']}, graph {result.graph_bytes / 1024:.1f} KiB, "
          f"load+check {load_s:.3f} s, nodes per role {row['nodes_per_role']}")
    if args.json:
        atomic_write_text(args.json, json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
