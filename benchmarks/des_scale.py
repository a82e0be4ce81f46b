"""Benchmark: DES wall time and memory for GPT-175B-shaped iterations, N = 8192 .. 65,536.

The graph is built synthetically (sim/synth.py) from a captured tiny-layer role: the module kinds and
their relative durations come from the capture (`--graph`, or a capture of the built-in default config
made first), the shape is GPT-175B (96 layers, hidden 12288, seq 2048, micro-batch 1) on TP8 PP16 with
DP = N / 128, durations at 50% of an H100's bf16 peak, network DGX H100 with bandwidth sharing
between a rank's concurrent transfers (replayed to its fixed point: `passes`). Each (N, microbatches) row
runs in a fresh process so that its peak RSS is its own. Issue [C]'s goal: N = 8192 with >= 32
microbatches in <= 2 s and <= 1 GB RSS; N = 65,536 in <= 20 s.

    python benchmarks/des_scale.py [--graph G] [--sizes 8192 65536] [--microbatches 32 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one_row(graph_path: str, n: int, microbatches: int) -> dict:
    from prism_megatron.graph import load_graph
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.sim.des import Simulator
    from prism_megatron.sim.synth import GptShape, gpt_graph, module_durations
    from prism_megatron.world import VirtualWorld

    cluster = load_cluster("dgx_h100")
    per_module = module_durations(load_graph(graph_path))
    tiny = GptShape(hidden=64, seq=32, micro_batch=1, layers=16)
    big = GptShape(hidden=12288, seq=2048, micro_batch=1, layers=96)
    t0 = time.perf_counter()
    graph = gpt_graph(VirtualWorld(world_size=n, tp=8, pp=16), big, microbatches, per_module, tiny,
                      flops_per_s=0.5 * cluster.peak_tflops * 1e12)
    build_s = time.perf_counter() - t0
    result = Simulator(graph, cluster.cost_model()).run()
    return {"n_ranks": n, "microbatches": microbatches, "sim_wall_s": round(result.sim_wall_s, 4),
            "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "build_s": round(build_s, 4), "classes": len(result.classes),
            "nodes_per_role": graph.graph_of(0).num_nodes,
            "iteration_time_s": round(result.iteration_s, 4), "sharing_passes": result.sharing_passes,
            "shared_ops": result.shared_ops}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default=None, help="a captured tiny-layer graph (default: capture one)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--json", default=None)
    parser.add_argument("--row", type=int, nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(one_row(args.graph, *args.row)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        graph = args.graph
        if graph is None:
            from prism_megatron.capture.run import Capture
            from prism_megatron.config import load_config

            cfg = load_config(["emulation.sandbox_ranks=[]", "train.device=cpu"],
                              str(REPO / "configs" / "tiny_8192.yaml"))
            graph = Capture(cfg, os.path.join(tmp, "cap"), log=lambda s: None).run().graph_path
        rows = []
        print(f"{'N':>7}{'micro':>7}{'nodes/role':>12}{'classes':>9}{'sim s':>8}{'RSS MB':>9}"
              f"{'iteration s':>13}{'passes':>8}{'shared ops':>12}")
        for n in args.sizes:
            for m in args.microbatches:
                out = subprocess.run([sys.executable, __file__, "--graph", graph, "--row", str(n), str(m)],
                                     capture_output=True, text=True,
                                     env=dict(os.environ, PYTHONWARNINGS="ignore"))
                if out.returncode:
                    print(out.stderr[-2000:], file=sys.stderr)
                    return 1
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{n:>7}{m:>7}{row['nodes_per_role']:>12}{row['classes']:>9}{row['sim_wall_s']:>8.3f}"
                      f"{row['rss_bytes'] / 2**20:>9.0f}{row['iteration_time_s']:>13.3f}"
                      f"{row['sharing_passes']:>8}{row['shared_ops']:>12}")
    if args.json:
        from prism_megatron.util import atomic_write_text

        atomic_write_text(args.json, json.dumps({"date": str(date.today()), "machine": platform.node(),
                                                 "cpus": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
