"""Host cost per collective: plain torch.distributed, the prism backend with a ghost peer, and the
prism backend with the recorder on (labelled and timed iterations of two-pass recording).

A sandbox that calls a collective pays host time the real rank does not (the Python backend, the
recorder's marks); when the job is launch-bound that time is device idle, and the recorder measures
it as compute. This prints microseconds of host time per synchronous `dist.all_reduce` of a small
tensor (so the device is never the bottleneck), median of blocks, in one process:

  plain       one-rank group of the real backend (nccl on cuda, gloo on cpu), no prism
  prism       prism group of 2 virtual ranks, the other a ghost (mirror policy), no recorder
  labelled    the same with the recorder in a labelled iteration (marks at every anchor)
  timed       the same in a timed iteration
  mark        the device clock's mark alone

`--cold`: each call follows a matmul and a dict build that evict the host's caches, as a collective
follows a rank's kernels in a real iteration, and each call is timed alone (median of blocks of
per-call means). Hot loops understate the Python path several times over.

    python benchmarks/recorder_cost.py [--device cuda|cpu] [--calls 4000] [--cold] [--world 2] [--json PATH]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BLOCK = 200
COLD = False


def _cold_blocks(fn, calls: int, sync) -> float:
    import torch

    a = torch.randn(384, 384)

    def thrash():
        (a @ a).sum()
        return {i: str(i) for i in range(3000)}

    for _ in range(BLOCK):
        fn()
    sync()
    per = []
    for _ in range(max(1, calls // BLOCK)):
        total = 0.0
        for _ in range(BLOCK):
            thrash()
            sync()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start  # the host's part: the device runs on meanwhile
            sync()
        per.append(total / BLOCK * 1e6)
    return statistics.median(per)


def _blocks(fn, calls: int, sync) -> float:
    if COLD:
        return _cold_blocks(fn, calls, sync)
    for _ in range(BLOCK):
        fn()
    sync()
    per = []
    for _ in range(max(1, calls // BLOCK)):
        start = time.perf_counter()
        for _ in range(BLOCK):
            fn()
        sync()
        per.append((time.perf_counter() - start) / BLOCK * 1e6)
    return statistics.median(per)


def worker(side: str, device: str, calls: int, out: str, world: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    backend = "nccl" if device == "cuda" else "gloo"
    result = {}
    inst = None
    if side != "plain":
        import prism_megatron
        from prism_megatron.config import load_config

        trace = os.path.join(tempfile.mkdtemp(), "cost.prism")
        inst = prism_megatron.install(load_config([
            f"train.device={device}", f"emulation.virtual_world_size={world}", "emulation.sandbox_ranks=[0]",
            f"train.global_batch_size={2 * world}",
            *([f"trace.path={trace}"] if side == "recorded" else [])]))
    dist.init_process_group(backend=backend)
    t = torch.ones(1024, device=device)
    op = lambda: dist.all_reduce(t)  # noqa: E731
    if side == "recorded":
        rec = inst.recorder
        rec.begin_iteration()
        result["labelled"] = _blocks(op, calls, sync)
        rec.begin_iteration()
        result["timed"] = _blocks(op, calls, sync)
        result["mark"] = _blocks(rec.clock.mark, calls, sync)
        inst.recorder.iterations.clear()  # nothing to write
        inst.recorder = None
    else:
        result[side] = _blocks(op, calls, sync)
    dist.destroy_process_group()
    if inst is not None:
        inst.uninstall()
    Path(out).write_text(json.dumps(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--cold", action="store_true", help="evict caches before each call")
    parser.add_argument("--world", type=int, default=2, help="virtual ranks of the prism group")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global COLD
    COLD = args.cold
    if args.worker:
        worker(args.worker[0], args.device, args.calls, args.worker[1], args.world)
        return 0
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("plain", "prism", "recorded"):
            out = os.path.join(tmp, side + ".json")
            env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_PORT=str(29500 + os.getpid() % 1000))
            subprocess.run([sys.executable, __file__, "--device", args.device, "--calls", str(args.calls),
                            "--world", str(args.world), *(["--cold"] if args.cold else []),
                            "--worker", side, out], check=True, env=env, cwd=REPO)
            figures.update(json.loads(Path(out).read_text()))
    print(f"host us per synchronous all_reduce of 1024 floats ({args.device}, {'cold, ' if args.cold else ''}"
          f"prism group of {args.world}, median of {BLOCK}-call blocks)")
    for key in ("plain", "prism", "labelled", "timed", "mark"):
        print(f"{key:>10} {figures[key]:8.1f} us")
    if args.json:
        from prism_megatron.util import atomic_write_text

        atomic_write_text(args.json, json.dumps({"device": args.device, "cold": args.cold, "world": args.world,
                                                 "us_per_call": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
