"""Where a synchronous all-reduce of 1 KiB spends its host time, NCCL against prism (one process each).

    python benchmarks/results/native/breakdown.py [--device cuda] [--calls 2000]

Per piece, the median host microseconds of one call, hot: the whole `dist.all_reduce`; the process
group's own call without torch's Python wrapper (`group.allreduce([t], opts).wait()`); for prism the
same with the native trace detached (the backend alone), its mirror fold as a Python `mul_`, a trace
mark, and a Python call that does nothing (the floor of any Python step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))


def _median_us(fn, calls: int, sync) -> float:
    for _ in range(100):
        fn()
    sync()
    out = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out) * 1e6


def worker(side: str, device: str, calls: int) -> dict:
    import torch
    import torch.distributed as dist

    import prism_megatron
    from prism_megatron.config import load_config

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    overrides = [f"train.device={device}"]
    if side == "prism":
        overrides += ["emulation.virtual_world_size=3", "emulation.sandbox_ranks=[0]", "train.global_batch_size=6",
                      f"trace.path={tempfile.mkdtemp()}/b.prism", "trace.timing=two-pass"]
    inst = prism_megatron.install(load_config(overrides))
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    group = dist.distributed_c10d._get_default_group()
    t = torch.ones(256, device=device)
    opts = dist.AllreduceOptions()
    out = {}
    if inst.recorder is not None:
        inst.recorder.begin_iteration()
        inst.recorder.begin_iteration()
    out["dist.all_reduce"] = _median_us(lambda: dist.all_reduce(t), calls, sync)
    out["group.allreduce().wait()"] = _median_us(lambda: group.allreduce([t], opts).wait(), calls, sync)
    out["python no-op"] = _median_us(lambda: None, calls, sync)
    if side == "prism":
        session, trace = inst.session, inst.recorder.clock.trace
        factor = torch.tensor(3.0)
        out["t.mul_(cpu 0-dim)"] = _median_us(lambda: t.mul_(factor), calls, sync)
        out["trace.mark()"] = _median_us(trace.mark, calls, sync)
        session.native.attach_trace(None)
        out["dist.all_reduce, no trace"] = _median_us(lambda: dist.all_reduce(t), calls, sync)
        out["group.allreduce().wait(), no trace"] = _median_us(lambda: group.allreduce([t], opts).wait(), calls, sync)
        session.native.attach_trace(trace)
        inst.recorder.iterations.clear()
        inst.recorder = None
    dist.destroy_process_group()
    inst.uninstall()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.device, args.calls)))
        return 0
    result = {}
    for side in ("plain", "prism"):
        env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_PORT=str(29600 + os.getpid() % 500))
        proc = subprocess.run([sys.executable, __file__, "--device", args.device, "--calls", str(args.calls),
                               "--worker", side], capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        result[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    for side, pieces in result.items():
        for piece, us in pieces.items():
            print(f"{side:>6} {piece:>38} {us:8.2f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
