"""`prism-megatron calibrate`: time real collectives on the devices present, fit the cost model.

P worker processes (one per GPU with NCCL, or P CPU processes with gloo) time all_reduce, all_gather,
reduce_scatter, broadcast, all_to_all and send/recv for sizes from `min_bytes` to `max_bytes` (powers
of two; sizes in nccl-tests' convention), for every group size k dividing P (P/k groups at once, as
the groups of one parallel dim run together). Each figure is the median of several timed repetitions
after warm-up, bracketed by a barrier, and the slowest rank's. On GPU a repetition is timed as
nccl-tests time it, on the device: a small all-reduce of the group first aligns its devices (so the
processes' skew in leaving the barrier is not timed), then `DEVICE_BATCH` operations are enqueued back
to back between two CUDA events and the figure is their mean: in training the host runs ahead and a
collective starts on the device as soon as its inputs are ready, so the host's launch gap and the
peers' host skew that one isolated, synchronized operation shows (measured on 2 H200: 85-95 us for
any all-reduce up to 1 MiB; timed this way, 37-40 us) are not part of its cost. On CPU the figure
is perf_counter around one operation, and the workers run under the hooks of a recorded CPU run (the
CPU runtime with its 0.5 ms settle after each blocking wait, the prism backend over gloo, the
recorder), so the costs are those the recorded CPU runs pay (p2p without the settle, which a recording
charges to the next compute); on GPU they call NCCL directly, as production does.
Rank 0 writes the points, the fitted (latency, bus bandwidth) per (op, link, group size) and a table
of model against measurement to a JSON file, atomically. All processes of this machine are one node,
so every fit is for the `intra` link kind.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Optional

from prism_megatron.config.schema import ConfigError
from prism_megatron.util import free_port

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send")
DEVICE_BATCH = 20  # operations per timed GPU repetition (nccl-tests' default `-n 20`)


def _time_op(dist, torch, op: str, nbytes: int, members: list[int], group, rank: int, device: str,
             min_time_s: float) -> float:
    """Time `op` on `group` (this rank's group of `members`) while every other group of the same
    size runs it too, as the groups of one parallel dim do in training."""
    k = len(members)
    elems = max(k, nbytes // 4 // k * k)
    buf = torch.ones(elems, dtype=torch.float32, device=device)
    shard = torch.ones(elems // k, dtype=torch.float32, device=device)
    out = torch.empty_like(buf)

    def run():
        if op == "all_reduce":
            dist.all_reduce(buf, group=group)
        elif op == "all_gather":
            dist.all_gather_into_tensor(buf, shard, group=group)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(shard, buf, group=group)
        elif op == "broadcast":
            dist.broadcast(buf, src=members[0], group=group)
        elif op == "all_to_all":
            dist.all_to_all_single(out, buf, group=group)
        elif op == "send":  # pairs (0, 1), (2, 3), ... exchange at once
            pos = members.index(rank)
            if pos % 2 == 0 and pos + 1 < k:
                dist.send(buf, members[pos + 1], group=group)
            elif pos % 2 == 1:
                dist.recv(buf, members[pos - 1], group=group)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):
        run()
    sync()
    gate = torch.zeros(1, dtype=torch.float32, device=device)

    def timed() -> float:
        dist.barrier()
        sync()
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.all_reduce(gate, group=group)  # the stream waits for it: the group's devices aligned
            begin.record()
            for _ in range(DEVICE_BATCH):
                run()
            end.record()
            sync()
            return begin.elapsed_time(end) * 1e-3 / DEVICE_BATCH
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    # Every rank must run the same number of repetitions: agree on it from a first sample.
    first = torch.tensor([timed()], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    reps = int(min(50, max(5, min_time_s / max(float(first.item()), 1e-9))))
    samples = [timed() for _ in range(reps)]
    local = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)  # an op ends when its slowest rank does
    return float(local.item())


def _worker(rank: int, world: int, device: str, port: int, sizes: list[int], out_path: str,
            min_time_s: float) -> None:
    import multiprocessing

    import torch
    import torch.distributed as dist

    from prism_megatron import procs

    procs.die_with_parent(multiprocessing.parent_process().pid)  # spawned: no preexec hook to do it

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    inst = None
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:  # measure gloo as a recorded CPU run pays it: through the prism stack, recorder attached
        inst = _recorded_stack(world, os.path.dirname(out_path))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    if inst is not None:
        session = inst.session
        if session.physical.size != world:
            raise RuntimeError(f"calibration: {session.physical.size} of {world} processes are real")
        session.connect_p2p()  # as megatron's parallel-state hook does in a run
        settle_s = inst.runtime.settle_after_wait_s
    points = []
    for k in [d for d in range(2, world + 1) if world % d == 0]:
        partitions = [list(range(g, g + k)) for g in range(0, world, k)]
        groups = [dist.new_group(p) for p in partitions]  # every rank creates every group
        mine = next(i for i, p in enumerate(partitions) if rank in p)
        for op in OPS:
            if op == "send" and k != 2:
                continue
            if inst is not None:
                # A recorded run charges the settle after a p2p wait to the next compute segment (the
                # native Work records the wait's end before it settles); collectives wait inside the
                # backend, settle included.
                settle = 0.0 if op == "send" else settle_s
                inst.runtime.settle_after_wait_s = settle
                if inst.session is not None:
                    inst.session.native.settle_after_wait_s = settle
            for nbytes in sizes:
                t = _time_op(dist, torch, op, nbytes, partitions[mine], groups[mine], rank, device,
                             min_time_s)
                points.append({"op": op, "n": k, "link": "intra", "bytes": nbytes, "time_s": t,
                               "concurrent_groups": world // k})
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(points, handle)
    if inst is not None:
        inst.recorder = None  # a calibration runs no training iteration: no graph to write
    dist.destroy_process_group()
    if inst is not None:
        inst.uninstall()


def _recorded_stack(world: int, tmp: str):
    """The hooks of a recorded CPU run (`--prism-trace-path`, virtual world = the P processes): the
    CPU runtime (its 0.5 ms settle after each blocking wait, for reproducible memory), the prism
    backend over gloo and the recorder. Their per-operation host time is part of every collective a
    recorded CPU run measures, so it is part of what is calibrated (~0.15-0.2 ms per op here)."""
    from prism_megatron.config import load_config
    from prism_megatron.hooks.install import install

    trace = os.path.join(tmp, "calibration-rank{rank}.prism")
    cfg = load_config(["train.device=cpu", "emulation.sandbox_ranks=[]", "train.micro_batch_size=1",
                       f"train.global_batch_size={world}", f"emulation.virtual_world_size={world}",
                       f"trace.path={trace}"])
    return install(cfg)


def calibrate(device: str, nproc: int, min_bytes: int, max_bytes: int, out: str,
              min_time_s: float = 0.05, fit_min_bytes: int = 1 << 20) -> dict:
    """Measure, fit, write `out` (JSON); returns the file's content."""
    import tempfile

    import torch.multiprocessing as mp

    from prism_megatron.comm.cost import Calibration, CostModel, Placement
    from prism_megatron.util import atomic_write_text

    sizes = []
    s = min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "points.json")
        mp.start_processes(_worker, args=(nproc, device, free_port(), sizes, raw, min_time_s),
                           nprocs=nproc, join=True, start_method="spawn")
        with open(raw) as handle:
            points = json.load(handle)
    cal = Calibration(points=points, device=_describe(device, nproc))
    cal.fit(min_bytes=fit_min_bytes)
    model = CostModel(nvlink_Bps=1.0, net_Bps=1.0, calibration=cal)
    table = []
    for p in points:
        predicted = model.time(p["op"], p["bytes"], Placement(n=p["n"], nodes=1, per_node=p["n"]))
        table.append({**p, "model_s": predicted, "error": predicted / p["time_s"] - 1})
    data = json.loads(cal.to_json())
    data["table"] = table
    data["fit_min_bytes"] = fit_min_bytes
    atomic_write_text(out, json.dumps(data, indent=1))
    return data


def _describe(device: str, nproc: int) -> str:
    import torch

    if device == "cuda":
        return f"{nproc}x {torch.cuda.get_device_name(0)} (NCCL, torch {torch.__version__})"
    return f"{nproc} CPU processes on {os.cpu_count()} cores (gloo, torch {torch.__version__})"


def parse_size(text: str) -> Optional[int]:
    """'1KiB', '64MiB', '1GiB' or a plain byte count."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower()
    for unit, factor in units.items():
        if t.endswith(unit) and t[: -len(unit)].isdigit():
            return int(t[: -len(unit)]) * factor
    return int(t) if t.isdigit() else None


def _host_modules(path: str, recount: bool = False) -> int:
    import torch

    from prism_megatron.kernels.host import calibrate_host_modules

    if not recount and not torch.cuda.is_available():
        raise ConfigError("calibrate --host-modules times real jobs on a GPU and none is visible here; run "
                          "it on the GPU machine (or add --recount to count ops again against the file's "
                          "real figures)")
    try:
        calibrate_host_modules(path, recount=recount)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    except RuntimeError as err:  # a job failed: its log is named
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def add_arguments(cmd) -> None:
    cmd.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="cuda: one process per GPU with NCCL; cpu: gloo processes")
    cmd.add_argument("--nproc", type=int, default=None, help="processes (default: GPUs, or 2)")
    cmd.add_argument("--min-bytes", default="1KiB", help="smallest size (default 1KiB)")
    cmd.add_argument("--max-bytes", default=None, help="largest size (default 1GiB; 64MiB on CPU)")
    cmd.add_argument("--out", required=True, help="calibration JSON to write")
    cmd.add_argument("--kernels", action="store_true",
                     help="instead of collectives: time this GPU's kernels (GEMM grid, memory-bound "
                          "families, host launch) for fake execution's kernel-cost model")
    cmd.add_argument("--ops", default=None,
                     help="with --kernels: also replay every op of this list as is (written by a "
                          "fake run with PRISM_FAKE_OPS=FILE)")
    cmd.add_argument("--quick", action="store_true", help="with --kernels: a coarse GEMM grid")
    cmd.add_argument("--host-modules", action="store_true",
                     help="time the program's Python per module class on this GPU machine's host "
                          "(host-bound jobs, real and fake) and add it to the kernel calibration "
                          "--out (with --kernels: made first)")
    cmd.add_argument("--recount", action="store_true",
                     help="with --host-modules: keep --out's real figures and count the jobs' ops again "
                          "here under fake execution (no GPU needed)")


def command(args) -> int:
    """`prism-megatron calibrate`: collectives (default), `--kernels`, `--host-modules`."""
    import torch

    if args.recount and (not args.host_modules or args.kernels):
        raise ConfigError("--recount goes with --host-modules alone (it re-counts an existing table)")
    if args.host_modules and not args.kernels:
        if args.ops or args.quick:
            raise ConfigError("--ops and --quick go with --kernels")
        if not os.path.isfile(args.out):
            raise ConfigError(f"--host-modules adds to a kernel calibration, and {args.out} does not exist; "
                              f"make it on this machine with `prism-megatron calibrate --kernels --out "
                              f"{args.out}` (or pass both flags)")
        return _host_modules(args.out, args.recount)
    if args.kernels:
        from prism_megatron.kernels.calibrate import calibrate_kernels

        if args.ops and not os.path.isfile(args.ops):
            raise ConfigError(f"--ops {args.ops}: no such file; write one with a fake run "
                              "(PRISM_FAKE_OPS=FILE prism-megatron train emulation.execution=fake ...)")
        if not torch.cuda.is_available():
            raise ConfigError("calibrate --kernels measures a GPU and none is visible here; run it on the "
                              "GPU machine and pass the file as emulation.target_gpu=FILE")
        calibrate_kernels(args.out, args.ops, quick=args.quick)
        return _host_modules(args.out) if args.host_modules else 0
    if args.ops or args.quick:
        raise ConfigError("--ops and --quick go with --kernels")

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no GPU is visible; use --device cpu")
    nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() if device == "cuda" else 2)
    if nproc < 2 or (device == "cuda" and nproc > torch.cuda.device_count()):
        limit = f" and at most the {torch.cuda.device_count()} GPUs" if device == "cuda" else ""
        raise ConfigError(f"--nproc {nproc}: expected 2 or more processes{limit}")
    low = parse_size(args.min_bytes)
    high = parse_size(args.max_bytes or ("1GiB" if device == "cuda" else "64MiB"))
    if not low or not high or low > high:
        raise ConfigError(f"sizes {args.min_bytes!r}..{args.max_bytes!r}: expected e.g. --min-bytes 1KiB "
                          "--max-bytes 1GiB, smallest first")
    data = calibrate(device, nproc, low, high, args.out)
    print(f"calibrated {data['device']}: {len(data['points'])} points -> {args.out}")
    for key, fit in sorted(data["fits"].items()):
        rows = [r for r in data["table"] if f"{r['op']}/{r['link']}/{r['n']}" == key
                and r["bytes"] >= (1 << 20)]
        worst = max((abs(r["error"]) for r in rows), default=0.0)
        segments = ", ".join(f">={seg['from_bytes']} B: {seg['latency_s'] * 1e6:.1f} us + "
                             f"{seg['busbw_Bps'] / 1e9:.2f} GB/s" for seg in fit["segments"])
        print(f"  {key:>24}: {segments}; worst model error >= 1 MiB {worst * 100:5.1f}%")
    return 0


run = command
