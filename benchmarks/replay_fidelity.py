"""Benchmark: replay fidelity on CPU: real multi-process gloo runs against their DES replay.

For each config, 4 gloo processes (torchrun) train the example GPT and every rank records itself
(`--prism-trace-path`, real data, no ghosts). The replay takes every rank's recorded graph with its
recorded compute durations and starts each rank when it really started the iteration (one host
clock); communication is modelled by the cost model calibrated here on gloo (`calibrate --device cpu
--nproc 4`, fitted from 1 KiB). Per rank: measured iteration time (the recorded iteration's span on
that rank), replayed time, and the error. Issue [C]'s goal: within 2% per rank (aim 1%).

    python benchmarks/replay_fidelity.py [--json PATH] [--calibration FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {
    "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--global-batch-size", "8", "--micro-batch-size", "2"],
    "pp4_1f1b": ["--pipeline-model-parallel-size", "4", "--num-layers", "4", "--global-batch-size", "16",
                 "--micro-batch-size", "2"],
    "dp4_overlap": ["--overlap-grad-reduce", "--global-batch-size", "16", "--micro-batch-size", "2"],
}
COMMON = ["--device", "cpu", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
          "--train-iters", "4"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(name: str, args: list[str], tmp: str) -> dict[int, str]:
    out = os.path.join(tmp, name)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
         str(_port()), str(REPO / "examples" / "pretrain_gpt.py"), *COMMON, *args,
         "--prism-trace-path", os.path.join(out, "rank{rank}.prism")],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    if proc.returncode:
        raise RuntimeError(f"{name} failed: {proc.stderr[-2000:]}")
    return {r: os.path.join(out, f"rank{r}.prism") for r in range(4)}


def replay(paths: dict[int, str], calibration) -> list[dict]:
    from prism_megatron.graph import load_graph
    from prism_megatron.graph.model import ExecutionGraph, StringTable
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.sim.des import Simulator

    table, rank_graphs, origins, measured, world = StringTable(), {}, {}, {}, None
    for rank, path in paths.items():
        g = load_graph(path, check=False)
        world = g.world
        mapping = np.asarray([table(s) for s in g.strings], dtype="i4")
        rg = g.graph_of(rank).remap_strings(mapping)
        rank_graphs[rank] = rg
        origins[rank] = g.meta["iteration_origin_s"]
        cols = rg.columns
        measured[rank] = float((cols["start_s"] + cols["duration_s"]).max())
    base = min(origins.values())
    roles = {role: rank_graphs[world.representative(role)] for role in world.roles()}
    graph = ExecutionGraph(world=world, roles=roles, strings=table.strings)
    cost = load_cluster("cpu_host").cost_model(calibration)
    result = Simulator(graph, cost, rank_graphs=rank_graphs, per_rank=True,
                       start_s={r: o - base for r, o in origins.items()}).run()
    times = result.rank_times()
    return [{"rank": r, "measured_s": measured[r], "replayed_s": float(times[r]),
             "error": float(times[r]) / measured[r] - 1} for r in sorted(paths)]


def op_costs(paths: dict[int, str], cost) -> list[dict]:
    """Each operation of the recorded iteration, as it really took (from the last member's arrival to
    the last member's return, on the one host clock) against the cost model, per (op, dim, bytes)."""
    from collections import defaultdict

    from prism_megatron.graph import load_graph
    from prism_megatron.graph.model import NO_PEER
    from prism_megatron.sim.des import _placement

    instances: dict[tuple, dict[int, tuple]] = defaultdict(dict)
    world = None
    for rank, path in paths.items():
        g = load_graph(path, check=False)
        world, cols, origin = g.world, g.graph_of(rank).columns, g.meta["iteration_origin_s"]
        for i in np.nonzero(cols["kind"] == 1)[0].tolist():
            op, dim = g.strings[cols["op"][i]], g.strings[cols["dim"][i]]
            if dim == "other":
                continue
            members = tuple(range(world.world_size)) if dim == "world" else world.group(rank, dim)
            if cols["peer_delta"][i] != NO_PEER:
                peer = members[(members.index(rank) + int(cols["peer_delta"][i])) % len(members)]
                key = ("send", dim, (rank, peer) if op == "send" else (peer, rank), int(cols["seq"][i]))
            else:
                key = (op, dim, members, int(cols["seq"][i]))
            start = origin + float(cols["start_s"][i])
            instances[key][rank] = (start, start + float(cols["duration_s"][i]), int(cols["nbytes"][i]))
    rows: dict[tuple, list[float]] = defaultdict(list)
    for (op, dim, members, _), seen in instances.items():
        nbytes = max(v[2] for v in seen.values())
        real = max(v[1] for v in seen.values()) - max(v[0] for v in seen.values())
        rows[(op, dim, nbytes, members if op == "send" else len(members))].append(real)
    out = []
    for (op, dim, nbytes, members), reals in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        group = members if isinstance(members, tuple) else tuple(range(members))
        model = cost.time(op, nbytes, _placement(world, group))
        out.append({"op": op, "dim": dim, "bytes": nbytes, "count": len(reals),
                    "measured_median_s": float(np.median(reals)), "model_s": model,
                    "measured_total_s": float(np.sum(reals)), "model_total_s": model * len(reals)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--calibration", default=None, help="a gloo calibration (default: measure one)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    from prism_megatron.commands.calibrate import calibrate
    from prism_megatron.comm.cost import Calibration
    from prism_megatron.sim.cluster import load_cluster

    with tempfile.TemporaryDirectory() as tmp:
        if args.calibration:
            cal = Calibration.from_json(Path(args.calibration).read_text())
        else:
            data = calibrate("cpu", 4, 1 << 10, 1 << 24, os.path.join(tmp, "cal.json"),
                             fit_min_bytes=1 << 10)
            cal = Calibration(points=data["points"], fits=data["fits"], device=data["device"])
        rows, per_op = {}, {}
        print(f"{'config':>12}{'rank':>6}{'measured ms':>13}{'replayed ms':>13}{'error':>9}")
        for name in args.configs:
            paths = run_config(name, CONFIGS[name], tmp)
            rows[name] = replay(paths, cal)
            per_op[name] = op_costs(paths, load_cluster("cpu_host").cost_model(cal))
            for r in rows[name]:
                print(f"{name:>12}{r['rank']:>6}{r['measured_s'] * 1e3:>13.2f}{r['replayed_s'] * 1e3:>13.2f}"
                      f"{r['error'] * 100:>8.2f}%")
        errors = [abs(r["error"]) for v in rows.values() for r in v]
        print(f"mean |error| {np.mean(errors) * 100:.2f}%, max {np.max(errors) * 100:.2f}%")
        print("\nper operation (measured: last arrival to last return; the largest totals first)")
        print(f"{'config':>12}{'op':>15}{'dim':>6}{'bytes':>10}{'count':>6}{'measured ms':>13}"
              f"{'model ms':>10}")
        for name, ops in per_op.items():
            for o in ops[:6]:
                print(f"{name:>12}{o['op']:>15}{o['dim']:>6}{o['bytes']:>10}{o['count']:>6}"
                      f"{o['measured_median_s'] * 1e3:>13.3f}{o['model_s'] * 1e3:>10.3f}")
    if args.json:
        from prism_megatron.util import atomic_write_text

        atomic_write_text(args.json, json.dumps({"date": str(date.today()), "machine": platform.node(),
                                                 "cpus": os.cpu_count(), "common": COMMON, "configs": CONFIGS,
                                                 "rows": rows, "per_op": per_op,
                                                 "calibration_device": cal.device}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
