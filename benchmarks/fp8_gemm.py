"""Whether torch's FP8 GEMM (`torch._scaled_mm`, per-tensor scales) runs on this GPU, and its speed
against bf16 on the GEMMs of the model_fidelity shards: the ground an FP8 path without Transformer
Engine would stand on (issue [M]: FP8 costs for fake execution).

For each (M, K, N): bf16 `x @ w.t()`, and `_scaled_mm` of e4m3 x e4m3 (forward, wgrad) and of
e5m2 x e4m3 (the hybrid recipe's dgrad), each the median of 20 runs after 5 warm-ups, timed with CUDA
events; TFLOP/s and the speed-up over bf16.

    python benchmarks/fp8_gemm.py [--json PATH]      # on a GPU; writes benchmarks/results/fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = [  # (tokens, in, out): LLaMA-3-8B at seq 8192 (QKV, attention out, SwiGLU up, down), GPT-3 TP8
    (8192, 4096, 6144), (8192, 4096, 4096), (8192, 4096, 28672), (8192, 14336, 4096),
    (2048, 12288, 4608), (2048, 12288, 6144)]


def _time(fn, reps: int = 20, warmup: int = 5) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "fp8_gemm.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_gemm: needs a CUDA GPU (run it through the device tool)", file=sys.stderr)
        return 2
    rows = []
    one = torch.ones((), device="cuda")
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        g8 = g.to(torch.float8_e5m2)
        w8_kn = w8.t().contiguous().t()  # (n, k) stored column-major: the dgrad's second operand
        flops = 2.0 * m * k * n
        row = {"m": m, "k": k, "n": n}
        row["bf16_s"] = _time(lambda: x @ w.t())
        row["fp8_fwd_s"] = _time(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                           out_dtype=torch.bfloat16))
        row["fp8_dgrad_s"] = _time(lambda: torch._scaled_mm(g8, w8_kn, scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16))
        for key in ("bf16_s", "fp8_fwd_s", "fp8_dgrad_s"):
            row[key.replace("_s", "_tflops")] = round(flops / row[key] / 1e12, 1)
        row["fwd_speedup"] = round(row["bf16_s"] / row["fp8_fwd_s"], 3)
        rows.append(row)
        print(f"{m:>6} x {k:>6} x {n:>6}: bf16 {row['bf16_tflops']:7.1f}  fp8 fwd {row['fp8_fwd_tflops']:7.1f}  "
              f"dgrad {row['fp8_dgrad_tflops']:7.1f} TFLOP/s  (fwd x{row['fwd_speedup']:.2f})", flush=True)
    result = {"benchmark": "fp8_gemm", "command": "python benchmarks/fp8_gemm.py",
              "machine": f"one {torch.cuda.get_device_name(0)} (torch {torch.__version__})", "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
