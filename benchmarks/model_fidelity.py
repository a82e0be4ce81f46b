"""GPU-free predictions of the models people train against real runs of the same shard on one GPU.

Six per-GPU shards that fit one H100/H200, each one process (a virtual world of one rank), bf16 with
megatron's distributed-optimizer-free Adam:

- `llama8b`: a LLaMA-3-8B block stack (GQA 8, SwiGLU, RMSNorm, RoPE, seq 8192, flash attention);
- `llama8b_recompute`: the same with full recomputation (uniform, one layer per group);
- `mixtral`: a Mixtral-8x7B block stack (8 experts top-2, seq 4096, flash attention; routing by the
  force-balanced model on both sides, so that real and fake route alike);
- `gpt3_tp8`: a GPT-3 175B layer as one TP8 rank holds it (hidden 12288, 12 heads of 128, FFN 6144,
  vocab 51200/8, learned positions, LayerNorm, GeLU, megatron's unfused attention);
- `llama8b_fp8`, `gpt3_tp8_fp8`: the first and the last in FP8 (hybrid format, delayed scaling with
  an amax history of 1024, its maximum: Megatron-LM's usual FP8 flags; runtime/fp8_linear.py).

Three steps, one command each:

    python benchmarks/model_fidelity.py ops OUT.json          # CPU: the fake runs' op signatures
    python benchmarks/model_fidelity.py real OUT.json         # GPU: real iterations and peak memory
    python benchmarks/model_fidelity.py predict REAL.json --calibration CAL.json [--json RESULT]

`real` runs each shard for `ITERS` iterations and keeps the median and spread of the iterations after
the first two; `predict` runs the fake (GPU-free) prediction with the kernel calibration measured on that
GPU (`prism-megatron calibrate --kernels --ops OUT.json`) and compares iteration time and peak
allocated memory.
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
from pathlib import Path

from prism_megatron.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
ITERS = 8
WORLD = ["emulation.virtual_world_size=1", "emulation.sandbox_ranks=[0]", "parallel.tp=1", "parallel.pp=1",
         "parallel.sequence_parallel=false", "model.params_dtype=bf16", "train.micro_batch_size=1",
         "train.use_distributed_optimizer=false", f"train.iters={ITERS}"]
LLAMA = ["model.num_layers=4", "model.hidden_size=4096", "model.num_attention_heads=32",
         "model.num_query_groups=8", "model.ffn_hidden_size=14336", "model.swiglu=true",
         "model.normalization=RMSNorm", "model.position_embedding_type=rope", "model.rotary_base=500000",
         "model.vocab_size=128256", "model.seq_length=8192", "model.attention_backend=flash",
         "model.tie_embeddings=false", "train.global_batch_size=2"]
SHARDS = {
    "llama8b": LLAMA,
    "llama8b_recompute": [*LLAMA, "train.recompute_granularity=full", "train.recompute_method=uniform",
                          "train.recompute_num_layers=1"],
    "mixtral": ["model.num_layers=2", "model.hidden_size=4096", "model.num_attention_heads=32",
                "model.num_query_groups=8", "model.ffn_hidden_size=14336", "model.num_experts=8",
                "model.moe_router_topk=2", "model.moe_ffn_hidden_size=14336", "model.swiglu=true",
                "model.normalization=RMSNorm", "model.position_embedding_type=rope",
                "model.rotary_base=1000000", "model.vocab_size=32000", "model.seq_length=4096",
                "model.attention_backend=flash", "model.tie_embeddings=false", "moe.imbalance=force-balanced",
                "train.global_batch_size=2"],
    "gpt3_tp8": ["model.num_layers=4", "model.hidden_size=12288", "model.num_attention_heads=12",
                 "model.kv_channels=128", "model.ffn_hidden_size=6144", "model.vocab_size=6400",
                 "model.seq_length=2048", "model.tie_embeddings=true", "model.attention_backend=local",
                 "train.global_batch_size=4"],
}
FP8 = ["model.fp8=hybrid", "model.fp8_recipe=delayed", "model.fp8_amax_history_len=1024",
       "model.fp8_amax_compute_algo=max"]  # Megatron-LM's usual FP8 recipe flags
SHARDS.update({"llama8b_fp8": [*LLAMA, *FP8], "gpt3_tp8_fp8": [*SHARDS["gpt3_tp8"], *FP8]})


def _train(name: str, extra: list[str], out: Path, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "prism_megatron.cli", "train", *WORLD, *SHARDS[name], *extra,
           "--json", str(out)]
    run = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{name}: train failed ({run.returncode}): {run.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.read_text())


def _steady(summary: dict) -> dict:
    times = summary["iteration_times_ms"][2:]
    median = statistics.median(times)
    return {"iteration_ms_median": median, "iteration_ms": times,
            "spread_pct": 100.0 * (max(times) - min(times)) / median}


def ops(out: str) -> None:
    """Every shard's op signatures under fake execution, merged into one `--ops` file."""
    seen, merged = set(), []
    with tempfile.TemporaryDirectory() as tmp:
        for name in SHARDS:
            path = Path(tmp) / f"{name}.ops.json"
            _train(name, ["train.device=cpu", "emulation.execution=fake", "train.iters=3"],
                   Path(tmp) / f"{name}.json", {"PRISM_FAKE_OPS": str(path)})
            for sig in json.loads(path.read_text())["ops"]:
                key = json.dumps(sig, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    merged.append(sig)
            print(f"{name}: {len(merged)} distinct signatures so far", flush=True)
    atomic_write_text(out, json.dumps({"ops": merged}))


def real(out: str) -> None:
    import torch

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in SHARDS:
            try:
                summary = _train(name, ["train.device=cuda", "emulation.execution=real"], Path(tmp) / f"{name}.json")
            except SystemExit as err:  # one shard's failure is reported; the others still run
                print(err, flush=True)
                continue
            rows[name] = {**_steady(summary), "peak_allocated_bytes": summary["peak_allocated_bytes"]}
            print(f"{name}: {rows[name]['iteration_ms_median']:.1f} ms (spread {rows[name]['spread_pct']:.1f} %), "
                  f"peak {rows[name]['peak_allocated_bytes'] / 2**30:.2f} GiB", flush=True)
            atomic_write_text(out, json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                             "rows": rows}, indent=1))


def predict(real_path: str, calibration: str, result: str | None) -> None:
    measured = json.loads(Path(real_path).read_text())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, got in measured["rows"].items():
            summary = _train(name, ["train.device=cpu", "emulation.execution=fake",
                                    f"emulation.target_gpu={calibration}"], Path(tmp) / f"{name}.json")
            fake = _steady(summary)
            peak = summary["execution"]["peak_allocated_bytes"]
            row = {"shard": name, "real_ms": got["iteration_ms_median"], "real_spread_pct": got["spread_pct"],
                   "fake_ms": fake["iteration_ms_median"],
                   "time_error_pct": 100.0 * (fake["iteration_ms_median"] / got["iteration_ms_median"] - 1),
                   "real_peak_bytes": got["peak_allocated_bytes"], "fake_peak_bytes": peak,
                   "peak_error_pct": 100.0 * (peak / got["peak_allocated_bytes"] - 1),
                   "sources": summary["execution"]["ops_by_source"]}
            rows.append(row)
            print(f"{name:>18}: real {row['real_ms']:8.1f} ms  fake {row['fake_ms']:8.1f} ms "
                  f"({row['time_error_pct']:+.2f} %)  peak real {row['real_peak_bytes'] / 2**30:6.2f} GiB "
                  f"fake {row['fake_peak_bytes'] / 2**30:6.2f} GiB ({row['peak_error_pct']:+.2f} %)", flush=True)
    errors = [abs(r["time_error_pct"]) for r in rows]
    summary = {"benchmark": "model_fidelity",
               "command": f"python benchmarks/model_fidelity.py predict {real_path} --calibration {calibration}",
               "machine": f"real: one {measured['gpu']} (torch {measured['torch']}); fake: {platform.processor() or platform.machine()} "
                          f"CPU, {os.cpu_count()} cores",
               "rows": rows, "mean_abs_time_error_pct": statistics.mean(errors), "max_abs_time_error_pct": max(errors),
               "max_abs_peak_error_pct": max(abs(r["peak_error_pct"]) for r in rows)}
    print(f"mean |time error| {summary['mean_abs_time_error_pct']:.2f} %, max {summary['max_abs_time_error_pct']:.2f} %, "
          f"max |peak error| {summary['max_abs_peak_error_pct']:.2f} %")
    if result:

        atomic_write_text(result, json.dumps(summary, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("ops").add_argument("out")
    sub.add_parser("real").add_argument("out")
    p = sub.add_parser("predict")
    p.add_argument("real")
    p.add_argument("--calibration", required=True)
    p.add_argument("--json", default=None)
    p.add_argument("--shards", nargs="*", default=None)
    args = parser.parse_args()
    if args.step == "ops":
        ops(args.out)
    elif args.step == "real":
        real(args.out)
    else:
        predict(args.real, args.calibration, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
