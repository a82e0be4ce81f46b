"""Benchmark: write and load (with every check) the execution graph of a TP8 PP16 DP64 world.

The graph is synthetic (graph/synthetic.py, 1F1B shape) with `--microbatches` per iteration, so the
figures are about the file format and the checks, not about a capture. Issue [B]'s goal: loading a
graph for N = 8192 in under a second.

    python benchmarks/graph_io.py [--microbatches 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prism_megatron.graph import load_graph, save_graph  # noqa: E402
from prism_megatron.graph.synthetic import synthetic_graph  # noqa: E402
from prism_megatron.util import atomic_write_text  # noqa: E402
from prism_megatron.world import VirtualWorld  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    world = VirtualWorld(world_size=8192, tp=8, pp=16)
    rows = []
    print(f"{'N':>6}{'roles':>7}{'micro':>7}{'nodes':>9}{'build s':>9}{'save s':>8}{'load s':>8}"
          f"{'load+check s':>14}{'file KiB':>10}")
    for micro in args.microbatches:
        t0 = time.perf_counter()
        graph = synthetic_graph(world, microbatches=micro)
        build_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "g.prism")
            t0 = time.perf_counter()
            save_graph(graph, path)
            save_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            load_graph(path, check=False)
            load_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            load_graph(path)
            checked_s = time.perf_counter() - t0
            size = os.path.getsize(path)
        nodes = sum(g.num_nodes for g in graph.roles.values())
        row = {"n_ranks": world.world_size, "roles": len(graph.roles), "microbatches": micro,
               "nodes": nodes, "build_s": build_s, "save_s": save_s, "load_s": load_s,
               "load_checked_s": checked_s, "file_bytes": size}
        rows.append(row)
        print(f"{world.world_size:>6}{len(graph.roles):>7}{micro:>7}{nodes:>9}{build_s:>9.3f}"
              f"{save_s:>8.3f}{load_s:>8.3f}{checked_s:>14.3f}{size / 1024:>10.0f}")
    path = args.json or str(REPO / "benchmarks" / "results" / "graph_io.json")
    atomic_write_text(path, json.dumps({"benchmark": "graph_io", "rows": rows}, indent=1))
    print(f"goal: load + check under 1 s at N = 8192; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
