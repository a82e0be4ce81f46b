"""Benchmark: instructions per synchronous all_reduce through the prism backend, counted by callgrind.

Wall-clock figures on a shared 2-core VM move 2x between runs; instruction counts do not (the same
code, inputs and environment give the same count, whatever else the machine does). This runs
`--calls` all-reduces of 1024 floats in a prism group of `--world` virtual ranks (one real, the rest
ghosts, mirror policy) with the recorder in a timed iteration, each after a matmul and a dict build
as a collective follows a rank's kernels, under `valgrind --tool=callgrind`. Only the calls are
collected: each runs inside `functools.reduce`, the collection's toggle. torch's `dist.all_reduce`
wrapper is included. It prints instructions per operation. It needs valgrind and takes minutes:
torch's import runs under it.

    python benchmarks/backend_instructions.py [--calls 200] [--world 8] [--json PATH] [--keep-out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def workload(calls: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    import prism_megatron
    from prism_megatron.config import load_config

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    inst = prism_megatron.install(load_config([
        "train.device=cpu", f"emulation.virtual_world_size={world}", "emulation.sandbox_ranks=[0]",
        f"train.global_batch_size={2 * world}", f"trace.path={tempfile.mkdtemp()}/cost.prism"]))
    dist.init_process_group(backend="gloo")
    t = torch.ones(1024)
    op = lambda _a, _b: dist.all_reduce(t)  # noqa: E731
    inst.recorder.begin_iteration()  # labelled
    inst.recorder.begin_iteration()  # timed
    a = torch.randn(384, 384)
    for _ in range(50):
        dist.all_reduce(t)
    for _ in range(calls):
        (a @ a).sum()
        {i: str(i) for i in range(3000)}  # noqa: B018 - evicts the host's caches
        functools.reduce(op, (0, 0))  # the collected call
    inst.recorder.iterations.clear()  # nothing to write
    inst.recorder = None
    dist.destroy_process_group()
    inst.uninstall()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--json", default=None)
    parser.add_argument("--keep-out", default=None, metavar="PATH",
                        help="copy callgrind's output file here (for callgrind_annotate)")
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload:
        workload(args.calls, args.world)
        return 0
    if shutil.which("valgrind") is None:
        print("error: valgrind is not installed; expected valgrind on the PATH (Debian: apt-get install "
              "valgrind)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                   MASTER_PORT=str(29600 + os.getpid() % 1000))
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
             f"--callgrind-out-file={out}", sys.executable, __file__, "--workload", "--calls",
             str(args.calls), "--world", str(args.world)],
            capture_output=True, text=True, env=env, cwd=tmp)
        found = re.search(r"^summary:\s+(\d+)", Path(out).read_text(), re.M) if os.path.exists(out) else None
        if proc.returncode != 0 or found is None:
            print(f"error: the workload failed under valgrind (exit {proc.returncode}): "
                  f"{proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        if args.keep_out:
            shutil.copyfile(out, args.keep_out)
    per_op = int(found.group(1)) / args.calls
    print(f"instructions per synchronous all_reduce (prism group of {args.world}, recorder timed, "
          f"{args.calls} calls): {per_op:,.0f}")
    if args.json:
        sys.path.insert(0, str(REPO))
        from prism_megatron.util import atomic_write_text

        atomic_write_text(args.json, json.dumps({"calls": args.calls, "world": args.world,
                                                 "instructions_per_op": per_op}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
