"""Benchmark: bring up a virtual world end to end (install, init_process_group, megatron groups).

For each world size, one fresh process times `prism_megatron.install(cfg)`,
`torch.distributed.init_process_group` and megatron-core's `initialize_model_parallel` (which creates
every group of the N-rank job, as on a real cluster), and reports its peak RSS. Fresh processes keep
one size's caches and imports out of the next size's figures.

    python benchmarks/virtual_init.py [--sizes 8192 65536] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {  # name -> (tp, pp, ep); dp follows from N
    "TP8 PP16": (8, 16, 1),
    "MoE TP2 PP16 EP8": (2, 16, 8),
}


def _child(world_size: int, tp: int, pp: int, ep: int) -> dict:
    t0 = time.perf_counter()
    import torch.distributed as dist
    from megatron.core import parallel_state

    import prism_megatron

    t_import = time.perf_counter() - t0
    cfg = prism_megatron.load_config([
        f"emulation.virtual_world_size={world_size}", f"emulation.sandbox_ranks=[{world_size // 2 + 3}]",
        f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", "train.device=cpu",
        "model.num_layers=16", "model.num_attention_heads=8", f"model.num_experts={8 if ep > 1 else 'null'}",
        f"train.global_batch_size={world_size}", "train.micro_batch_size=1"])
    t1 = time.perf_counter()
    inst = prism_megatron.install(cfg)
    dist.init_process_group("gloo")
    t_init = time.perf_counter() - t1
    t2 = time.perf_counter()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    t_groups = time.perf_counter() - t2
    groups = len(dist.distributed_c10d._world.pg_map)
    rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    inst.uninstall()
    return {"n_ranks": world_size, "tp": tp, "pp": pp, "ep": ep, "import_s": t_import,
            "init_process_group_s": t_init, "initialize_model_parallel_s": t_groups,
            "total_init_s": t_init + t_groups, "groups_member": groups, "rss_bytes": rss_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--json", default=None, help="results file (default under benchmarks/results)")
    parser.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    rows = []
    print(f"{'config':<18}{'N':>7}{'init_pg s':>11}{'mp groups s':>13}{'total s':>9}"
          f"{'groups':>8}{'RSS MiB':>9}")
    for name, (tp, pp, ep) in CONFIGS.items():
        for n in args.sizes:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            proc = subprocess.run([sys.executable, __file__, "--child", str(n), str(tp), str(pp), str(ep)],
                                  capture_output=True, text=True, env=env, timeout=600)
            if proc.returncode != 0:
                print(f"{name:<18}{n:>7}  failed: {proc.stderr.strip().splitlines()[-1]}")
                continue
            row = dict(json.loads(proc.stdout.strip().splitlines()[-1]), config=name)
            rows.append(row)
            print(f"{name:<18}{n:>7}{row['init_process_group_s']:>11.3f}"
                  f"{row['initialize_model_parallel_s']:>13.3f}{row['total_init_s']:>9.3f}"
                  f"{row['groups_member']:>8}{row['rss_bytes'] / 2**20:>9.0f}")
    path = args.json or str(REPO / "benchmarks" / "results" / "virtual_init.json")
    from prism_megatron.util import atomic_write_text

    atomic_write_text(path, json.dumps({"benchmark": "virtual_init", "host": platform.node(),
                                        "cpu_count": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
