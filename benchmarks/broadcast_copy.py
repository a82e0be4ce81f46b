"""Benchmark: filling the ghosts' slots of a gather with copies of ours, three ways side by side.

Under the `mirror` policy with one real member, a gather's output is our shard repeated once per
member: one copy whose source is our shard broadcast over the rows. On an H200 the GPT-175B rank's
sequence-parallel all-gather (8 slots of 6 MiB, bf16) took 44 us of device time per call this way,
4.4 % of the rank's compute. Ways timed, per shape:

- `expand`: `dst.copy_(row.expand(k, -1))` in the tensor's own dtype (what the backend did);
- `widened`: the native `copy_broadcast(widen=1)` (comm/native.py), the same copy with both sides viewed as the
  widest element type the bytes and addresses allow;
- `default`: the native `copy_broadcast` as the backend calls it (widened on a GPU from
  `WIDEN_MIN_BYTES` of destination up, plain below and on CPU);
- `doubling`: our row into slot 0, then contiguous copies of slots [0, j) to [j, 2j): log2(k) + 1
  copies (memcpy-like kernels, but each reads what it writes);
- `cat`: `torch.cat([row] * k, out=dst)`, one batched copy kernel over contiguous inputs.

Each figure is the median of `--repeat` timed calls after warm-up (CUDA events on GPU, perf_counter
on CPU), with the bytes written per second beside it. Also checks that every way fills the same
bytes.

    python benchmarks/broadcast_copy.py [--device cuda] [--repeat 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from prism_megatron.comm.native import load as _native  # noqa: E402
from prism_megatron.util import atomic_write_text  # noqa: E402


def copy_broadcast(dst, row, widen=None):
    _native().copy_broadcast(dst, row, -1 if widen is None else int(widen))


SHAPES = [  # (name, slots, row elements, dtype)
    ("gpt175b sp all-gather: tp8, 256 x 12288", 8, 256 * 12288, torch.bfloat16),
    ("gpt175b dp param all-gather shard (1/64 of 2.6 GiB)", 64, 2592 * 2**20 // 64 // 2, torch.bfloat16),
    ("moe ep64 all-to-all: 64 x (128 x 4096)", 64, 128 * 4096, torch.bfloat16),
    ("tiny tp8 sp all-gather: 8 x (32 x 64)", 8, 32 * 64, torch.float32),
    ("small: 8 x 16 KiB bf16", 8, 8 * 2**10, torch.bfloat16),
    ("small: 8 x 64 KiB bf16", 8, 32 * 2**10, torch.bfloat16),
    ("small: 8 x 256 KiB bf16", 8, 128 * 2**10, torch.bfloat16),
    ("small: 8 x 1 MiB bf16", 8, 512 * 2**10, torch.bfloat16),
    ("medium: 8 x 2 MiB bf16", 8, 2**20, torch.bfloat16),
    ("medium: 8 x 4 MiB bf16", 8, 2 * 2**20, torch.bfloat16),
]


def _expand(dst, row):
    dst.copy_(row.reshape(1, -1).expand(dst.shape[0], -1))


def _doubling(dst, row):
    dst[0].copy_(row.reshape(-1))
    done = 1
    while done < dst.shape[0]:
        step = min(done, dst.shape[0] - done)
        dst[done:done + step].copy_(dst[:step])
        done += step


def _cat(dst, row):
    torch.cat([row.reshape(1, -1)] * dst.shape[0], out=dst)


def _widened(dst, row):
    copy_broadcast(dst, row, widen=True)


WAYS = {"expand": _expand, "widened": _widened, "default": copy_broadcast, "doubling": _doubling,
        "cat": _cat}


def _time_us(fn, dst, row, device: str, repeat: int) -> float:
    for _ in range(3):
        fn(dst, row)
    samples = []
    for _ in range(repeat):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn(dst, row)
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn(dst, row)
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("broadcast_copy: --device cuda but torch sees no GPU; expected a CUDA build on a GPU "
              "machine; run with --device cpu", file=sys.stderr)
        return 2
    rows = []
    print(f"{'shape':<52}{'MiB':>8}" + "".join(f"{w + ' us':>14}{'GB/s':>8}" for w in WAYS)
          + f"{'widened/expand':>16}{'default/expand':>16}")
    for name, slots, elems, dtype in SHAPES:
        row = torch.randn(elems, device=args.device).to(dtype)
        dst = torch.empty(slots, elems, device=args.device, dtype=dtype)
        nbytes = dst.numel() * dst.element_size()
        reference = None
        times = {}
        for way, fn in WAYS.items():
            dst.zero_()
            fn(dst, row)
            got = dst.view(torch.uint8).cpu()
            if reference is None:
                reference = got
            elif not torch.equal(got, reference):
                raise SystemExit(f"broadcast_copy: {way} filled different bytes than expand for {name}")
            times[way] = _time_us(fn, dst, row, args.device, args.repeat)
        rows.append({"shape": name, "slots": slots, "bytes": nbytes,
                     **{f"{w}_us": round(t, 2) for w, t in times.items()}})
        print(f"{name:<52}{nbytes / 2**20:>8.1f}"
              + "".join(f"{t:>14.1f}{nbytes / t / 1e3:>8.0f}" for t in times.values())
              + f"{times['widened'] / times['expand']:>16.2f}{times['default'] / times['expand']:>16.2f}")
        del row, dst
    if args.json:
        machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.node()
        atomic_write_text(args.json, json.dumps({"date": str(date.today()), "machine": machine,
                                                 "device": args.device, "repeat": args.repeat,
                                                 "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
