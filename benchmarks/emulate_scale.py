"""Benchmark: one process emulates one rank of an N = 8192 job (TP8 PP16 DP64) on this machine.

Captures the built-in default config (or `--config`/overrides) unless `--graph` is given, then runs
`emulate` with each sandbox spec in turn (default: first-stage, 4711, last-stage), one process each,
and prints per sandbox: the physical fraction, the direct-peer ghosts and the DES classes (goal: a
number of peers, independent of N), the emulated job's iteration time, the sandbox's peak memory, and
the emulator's own overhead per iteration (host time in the backend's operations) as a ratio to the
sandbox's compute (issue [D]'s goal: <= 5%), the same for the device time of the backend's
operations ("on device": on a GPU-bound rank the host waits in its launches, in the backend too, so
its host time overstates the cost; on CPU it is the host time between the operations' marks), the
backend's time per operation, and the replay's time (the oracle runs once per emulation in
virtual-clock mode).

    python benchmarks/emulate_scale.py [key=value ...] [--graph G] [--sandbox first-stage 4711] [--device cuda]
                                       [--pace auto|on|off] [--json PATH] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prism_megatron.capture.run import Capture  # noqa: E402
from prism_megatron.config import load_config  # noqa: E402
from prism_megatron.emulate.run import Emulation  # noqa: E402
from prism_megatron.sim.cluster import load_cluster  # noqa: E402
from prism_megatron.util import atomic_write_text  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_8192.yaml"))
    parser.add_argument("--graph", default=None, help="a captured graph (default: capture the config)")
    parser.add_argument("--sandbox", nargs="+", default=["first-stage", "4711", "last-stage"])
    parser.add_argument("--cluster", default="dgx_h100")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the capture's slices and the sandboxes run (cuda: one GPU)")
    parser.add_argument("--pace", default="auto", choices=("auto", "on", "off"),
                        help="the sandboxes' collectives hold the stream for the ghosts' waits "
                             "(auto: on GPU; emulate/run.py)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="work in DIR and keep it (the capture, and each sandbox's graph under "
                             "emu-<spec>/sandbox/) instead of a temporary directory")
    args = parser.parse_args()
    pace = {"auto": None, "on": True, "off": False}[args.pace]
    rows = []
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory()) as tmp:
        graph = args.graph
        if graph is None:
            cfg = load_config(["emulation.sandbox_ranks=[]", f"train.device={args.device}", *args.overrides],
                              args.config)
            graph = Capture(cfg, os.path.join(tmp, "capture"), log=lambda s: print(s, file=sys.stderr)).run().graph_path
        print(f"{'sandbox':>12}{'rank':>6}{'N':>6}{'fraction':>11}{'peer ghosts':>13}{'classes':>9}"
              f"{'job iter ms':>13}{'peak MiB':>10}{'backend ms':>12}{'us/op':>7}{'replay ms':>11}"
              f"{'overhead':>10}{'on device':>11}{'compute ms':>12}{'idle ops':>10}{'idle share':>12}")
        for spec in args.sandbox:
            out = Emulation(graph, os.path.join(tmp, f"emu-{spec}"), [spec], load_cluster(args.cluster),
                            pace=pace).run()
            s = out["sandbox"][0]
            row = {"spec": spec, **{k: v for k, v in out.items() if k != "sandbox"}, **s}
            rows.append(row)
            print(f"{spec:>12}{s['virtual_rank']:>6}{out['ranks']:>6}{out['physical_fraction']:>11.6f}"
                  f"{out['materialized_ghosts']:>13}{out['classes']:>9}{out['iteration_time_s'] * 1e3:>13.2f}"
                  f"{s['peak_allocated_bytes'] / 2**20:>10.2f}"
                  f"{s['backend_host_s_per_iteration'] * 1e3:>12.2f}{s['backend_host_s_per_op'] * 1e6:>7.0f}"
                  f"{s['replay_s'] * 1e3:>11.2f}{s['overhead_ratio'] * 100:>9.2f}%"
                  f"{s['device_overhead_ratio'] * 100:>10.2f}%{s['compute_s'] * 1e3:>12.2f}"
                  f"{_idle(s)}", flush=True)
    if args.json:
        import torch
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else None  # (node names say little)
        atomic_write_text(args.json, json.dumps({"date": str(date.today()), "machine": platform.node(),
                                                 "gpu": gpu, "cpus": os.cpu_count(), "device": args.device,
                                                 "graph": args.graph or "captured",
                                                 "cluster": args.cluster, "rows": rows}, indent=1))
    return 0


def _idle(s: dict) -> str:
    """The host-bound figures on a device clock (operations that began with the device idle, and the
    share of compute before them); blank on CPU, where the host is the device."""
    bound = s.get("host_bound")
    if not bound:
        return f"{'-':>10}{'-':>12}"
    return f"{bound['idle_ops']:>5}/{bound['ops']:<4}{bound['share'] * 100:>11.1f}%"


if __name__ == "__main__":
    sys.exit(main())
