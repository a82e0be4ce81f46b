"""Host time per operation: the emulator's ghost path against the real backend's call, side by side.

A sandbox pays, for each collective or p2p with ghost members, the host time of the prism backend and
of the recorder; a real rank pays its backend's launch (NCCL on a GPU, gloo on CPU). Where the job is
launch-bound that difference is device idle that the recorder would keep as compute. This measures,
per operation kind and message size, the host time of one synchronous call as the training program
makes it (`torch.distributed.<op>(...)`, its wait included), each call timed alone:

  plain     the real backend, a one-rank group (nccl on cuda, gloo on cpu): the call a real rank makes
            (on CPU under the CPU runtime, whose memory tracker sees every op, as in the emulation)
  prism     the prism backend, a group of 3 virtual ranks whose other members are ghosts (mirror),
            with the recorder on (trace.path set, a timed iteration of two-pass recording): the
            sandbox's whole per-operation path; p2p sends to rank 1 and receives from rank 2 (a
            pipeline stage between two ghost stages: the recv mirrors what was sent on)
  replay    the recorder's reading of the native trace, per operation (at its next boundary, off the
            operation's own path), reported beside it

Sizes are per rank, as nccl-tests counts them per op: all_reduce/broadcast/send/recv the tensor,
all_gather the input (its output n times it), reduce_scatter the output, all_to_all the local buffer.
A real one-rank backend cannot send to itself alone: its p2p figure is a batched isend/irecv pair to
itself, per operation (where the backend refuses even that, the row says so).

`--cold`: before each call a matmul and a dict build evict the host's caches, as a collective follows
a rank's kernels in a training iteration (hot loops understate a Python path several times over).
Between calls the device is synchronized outside the timing, so a call never waits for a full queue.

    python benchmarks/ghost_op_cost.py [--device cuda|cpu] [--sizes 1KiB,1MiB,64MiB] [--calls 300]
        [--cold] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "all_reduce_coalesced",
       "send", "recv", "batch_isend_irecv")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _calls(op: str, nbytes: int, device: str, n: int, real: bool):
    """A function making one synchronous call of `op` with `nbytes` per rank (None: not possible)."""
    import torch
    import torch.distributed as dist

    count = max(1, nbytes // 4)
    t = torch.ones(count, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(t)
    if op == "all_gather":
        out = torch.empty(n * count, device=device)
        return lambda: dist.all_gather_into_tensor(out, t)
    if op == "reduce_scatter":
        big = torch.ones(n * count, device=device)
        return lambda: dist.reduce_scatter_tensor(t, big)
    if op == "all_to_all":
        out = torch.empty(count - count % n or n, device=device)
        inp = torch.ones(out.numel(), device=device)
        return lambda: dist.all_to_all_single(out, inp)
    if op == "broadcast":
        return lambda: dist.broadcast(t, src=0)
    if op == "all_reduce_coalesced":
        halves = [torch.ones(max(1, count // 2), device=device) for _ in range(2)]

        def coalesced():
            with dist._coalescing_manager(async_ops=False):
                for h in halves:
                    dist.all_reduce(h)
        return coalesced
    other = torch.empty(count, device=device)
    nxt, prev = (0, 0) if real else (1, 2)  # a one-rank backend: a pair to itself, in one batch

    def batch():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, other, prev)]):
            work.wait()
    if real:
        return batch if op == "batch_isend_irecv" else ("pair", batch)  # per operation: half of it
    dist.send(t, dst=nxt)  # what a recv from the previous stage mirrors
    if op == "send":
        return lambda: dist.send(t, dst=nxt)
    if op == "recv":
        return lambda: dist.recv(other, src=prev)
    return batch


def _time(fn, calls: int, sync, cold: bool) -> list[float]:
    import torch

    a = torch.randn(384, 384)

    def thrash():
        (a @ a).sum()
        return {i: str(i) for i in range(3000)}

    for _ in range(min(20, calls)):
        fn()
    sync()
    out = []
    for _ in range(calls):
        if cold:
            thrash()
        sync()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    sync()
    return out


def worker(side: str, device: str, sizes: list[int], calls: int, cold: bool, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    import prism_megatron
    from prism_megatron.config import load_config

    overrides = [f"train.device={device}"]
    if side == "prism":
        trace = os.path.join(tempfile.mkdtemp(), "cost.prism")
        overrides += ["emulation.virtual_world_size=3", "emulation.sandbox_ranks=[0]",
                      "train.global_batch_size=6", f"trace.path={trace}", "trace.timing=two-pass"]
    inst = prism_megatron.install(load_config(overrides))
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    n = dist.get_world_size()
    rec = inst.recorder
    rows = []
    for op in OPS:
        for nbytes in sizes:
            row = {"op": op, "bytes": nbytes}
            try:
                fn = _calls(op, nbytes, device, n, real=side == "plain")
                per_op = 1
                if isinstance(fn, tuple):  # send or recv of a one-rank backend: half a batched pair
                    fn, per_op = fn[1], 2
                if rec is not None:
                    rec.begin_iteration()
                    rec.begin_iteration()  # a timed iteration (two-pass): no module hooks, anchors only
                seconds = _time(fn, calls, sync, cold)
                row["host_us"] = statistics.median(seconds) * 1e6 / per_op
                row["host_us_p90"] = sorted(seconds)[int(0.9 * len(seconds))] * 1e6 / per_op
                if rec is not None:
                    pending = len(rec._cur.nodes)
                    start = time.perf_counter()
                    rec._sync()
                    took = time.perf_counter() - start
                    ops_read = sum(1 for node in rec._cur.nodes[pending:] if node.op)
                    row["replay_us"] = took * 1e6 / ops_read if ops_read else None
            except Exception as err:  # noqa: BLE001 - the row says why
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            rows.append(row)
    if rec is not None:
        rec.iterations.clear()  # nothing to write
        inst.recorder = None
    dist.destroy_process_group()
    inst.uninstall()
    Path(out).write_text(json.dumps(rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", default="1KiB,1MiB,64MiB")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--cold", action="store_true", help="evict the host's caches before each call")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError:
        print(f"ghost_op_cost: --sizes {args.sizes!r} is not a list of sizes such as 1KiB,1MiB,64MiB",
              file=sys.stderr)
        return 2
    if args.worker:
        worker(args.worker[0], args.device, sizes, args.calls, args.cold, args.worker[1])
        return 0
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("plain", "prism"):
            out = os.path.join(tmp, side + ".json")
            env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_PORT=str(29500 + os.getpid() % 1000))
            subprocess.run([sys.executable, __file__, "--device", args.device, "--sizes", args.sizes,
                            "--calls", str(args.calls), *(["--cold"] if args.cold else []),
                            "--worker", side, out], check=True, env=env, cwd=REPO)
            sides[side] = json.loads(Path(out).read_text())
    plain_name = "nccl" if args.device == "cuda" else "gloo"
    rows = []
    print(f"host us per synchronous call ({args.device}{', cold' if args.cold else ''}; median of "
          f"{args.calls} calls): {plain_name} one-rank group against prism (3 virtual ranks, 2 ghosts, recorder on)")
    print(f"{'op':>22} {'bytes':>10} {plain_name:>9} {'prism':>9} {'ratio':>6} {'replay':>8}")
    for plain, prism in zip(sides["plain"], sides["prism"]):
        row = {"op": plain["op"], "bytes": plain["bytes"], f"{plain_name}_us": plain.get("host_us"),
               "prism_us": prism.get("host_us"), f"{plain_name}_us_p90": plain.get("host_us_p90"),
               "prism_us_p90": prism.get("host_us_p90"), "replay_us_per_op": prism.get("replay_us"),
               "errors": {k: v["error"] for k, v in (("plain", plain), ("prism", prism)) if "error" in v}}
        if row[f"{plain_name}_us"] and row["prism_us"]:
            row["ratio"] = row["prism_us"] / row[f"{plain_name}_us"]
        rows.append(row)

        def cell(x, fmt="9.1f"):
            return format(x, fmt) if isinstance(x, float) else f"{'-':>{fmt.split('.')[0]}}"
        print(f"{row['op']:>22} {row['bytes']:>10} {cell(row[f'{plain_name}_us'])} {cell(row['prism_us'])} "
              f"{cell(row.get('ratio'), '6.2f')} {cell(row['replay_us_per_op'], '8.1f')}"
              + (f"  ({'; '.join(f'{k}: {v}' for k, v in row['errors'].items())})" if row["errors"] else ""))
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    if ratios:
        print(f"ratio prism/{plain_name}: median {statistics.median(ratios):.2f}, max {max(ratios):.2f} "
              f"over {len(ratios)} op x size")
    if args.json:
        from prism_megatron.util import atomic_write_text

        atomic_write_text(args.json, json.dumps({
            "device": args.device, "cold": args.cold, "calls": args.calls, "host": platform.node(),
            "command": "python benchmarks/ghost_op_cost.py " + " ".join(sys.argv[1:]),
            "median_ratio": statistics.median(ratios) if ratios else None,
            "max_ratio": max(ratios) if ratios else None, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
