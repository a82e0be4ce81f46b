"""What the prism backend costs per training iteration when nothing is virtual (N = physical world).

Runs examples/pretrain_gpt.py under torchrun (gloo, CPU) twice per repetition, interleaved
(plain, prism, plain, prism, ...) so that machine noise hits both sides alike. `prism` is the same
command with `--prism-virtual-world-size <physical world>`: every collective then goes through
`PrismGroup` onto the inner gloo group, with no ghosts. Per side and config:

  median_ms      median job iteration time over every measured iteration of every repetition; a
                 job iteration is the slowest rank's (ranks synchronize on the loss broadcast)
  spread         run-to-run spread: (max - min) / median of the per-run medians
  ratio          median prism / median plain; goal <= 1.05 (GOAL_RATIO)
  paired         prism / plain of each repetition's pair of runs (min..max)
  calls/iter     collectives and p2p calls per iteration and rank, from prism's comm log
  est.           1 + calls/iter x (prism layer us per call) / plain median: the overhead that
                 prism's own per-call work can explain, an upper bound that noise does not blur.
                 The prism layer cost is measured apart: `dist.all_reduce` in one process, where a
                 prism group has no inner backend, so all of its time is prism's own (CPU time)
  losses         whether every rank's losses and grad norms were bitwise identical between all
                 plain and prism runs (they should be: without ghosts prism returns gloo's result)

The first `--warmup` iterations of each run are left out (allocation, first-touch of buffers).
Start-up (torchrun, imports, model build) is not measured; on a 2-core machine it is ~15 s a run.

Configs (4 processes each, global batch 8, megatron's default tiny model):
  tp2-pp2          dense GPT, TP2 x PP2 (DP1): tensor-parallel all-reduces, pipeline send/recv
  moe-dp4-ep2      MoE (4 experts), DP4 with EP2: all-to-all token dispatch over the expert axis
  moe-tp2-sp-dp2   MoE, TP2 with sequence parallel, DP2, EP1: all-gather/reduce-scatter over TP
  moe-tp2-sp-ep2   not in the defaults: fails on CPU in plain gloo as well. With TP > 1 the
                   all-to-all dispatcher gathers tokens of uneven counts over TP (megatron's
                   `_gather_along_first_dim` with output_split_sizes -> `dist.all_gather` of
                   tensors of different sizes), which NCCL allows and gloo rejects.

Known limitations: four processes on a small machine share cores (and with anything else running
on it), so single iterations vary by +-20% or more; the medians of several runs are what to read.
The model is megatron's tiny default (hidden 64): an iteration is mostly Python and communication
latency, the worst case for a per-call overhead; a bigger model dilutes it. calls/iter counts the
set-up collectives too (a few per run).

Usage: python benchmarks/prism_overhead.py [--iters 10] [--warmup 2] [--reps 3]
           [--configs tp2-pp2,moe-dp4-ep2] [--json PATH]
Exit status: 0; 1 if a run failed or losses differ between plain and prism; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from prism_megatron.util import atomic_write_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "pretrain_gpt.py")
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
GOAL_RATIO = 1.05
RUN_TIMEOUT_S = 600
SIDES = ("plain", "prism")
PER_CALL_NPROC = 1  # alone, a prism group has no inner backend: its time is prism's own layer
PER_CALL_NUMEL = 64
PER_CALL_BLOCK = 100


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One parallel layout of pretrain_gpt.py, run by `nproc` processes."""

    name: str
    """Short name, as given to --configs."""
    args: tuple[str, ...]
    """pretrain_gpt.py flags (parallel sizes, model, batch)."""
    nproc: int = 4
    """Physical processes; also N of the prism run."""


CONFIGS = {c.name: c for c in (
    BenchConfig(name="tp2-pp2", args=(
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--global-batch-size", "8")),
    BenchConfig(name="moe-dp4-ep2", args=(
        "--num-experts", "4", "--expert-model-parallel-size", "2", "--global-batch-size", "8")),
    BenchConfig(name="moe-tp2-sp-dp2", args=(
        "--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--global-batch-size", "8")),
    BenchConfig(name="moe-tp2-sp-ep2", args=(
        "--num-experts", "4", "--expert-model-parallel-size", "2",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "8")),
)}
DEFAULT_CONFIGS = ("tp2-pp2", "moe-dp4-ep2")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(nproc: int, script_args: list[str], log_path: str) -> tuple[int | None, float]:
    """torchrun `nproc` processes of `script_args` (OMP_NUM_THREADS=1); (exit status, wall s)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), *script_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the group of the torchrun we started, with its workers
            proc.wait()
            rc = None
    return rc, time.perf_counter() - start


def run_once(cfg: BenchConfig, side: str, rep: int, iters: int, workdir: str) -> dict:
    """One pretrain_gpt.py job; returns its per-rank summaries, or an `error` line if it failed."""
    stem = os.path.join(workdir, f"{cfg.name}-{side}-{rep}")
    script = [SCRIPT, "--device", "cpu", "--train-iters", str(iters),
              "--prism-summary-json", stem + ".rank{rank}.json", *cfg.args]
    if side == "prism":
        script += ["--prism-virtual-world-size", str(cfg.nproc)]
    rc, wall_s = launch(cfg.nproc, script, stem + ".log")
    if rc != 0:
        return {"side": side, "rep": rep, "wall_s": wall_s, "error": first_error(stem + ".log", rc)}
    ranks = []
    for r in range(cfg.nproc):
        with open(f"{stem}.rank{r}.json") as f:
            ranks.append(json.load(f))
    return {"side": side, "rep": rep, "wall_s": wall_s, "ranks": ranks}


def first_error(log_path: str, rc) -> str:
    with open(log_path, errors="replace") as f:
        for line in f:
            if "Error" in line and ":" in line and "Traceback" not in line:
                return line.strip()[:300]
    return f"exit status {rc} (timeout {RUN_TIMEOUT_S} s)" if rc is None else f"exit status {rc}"


def job_times_ms(run: dict, warmup: int) -> list[float]:
    """Per measured iteration, the slowest rank's time."""
    per_rank = [r["iteration_times_ms"] for r in run["ranks"]]
    return [max(ts) for ts in zip(*per_rank)][warmup:]


def numerics(run: dict) -> list:
    return [(r["losses"], r["grad_norms"]) for r in run["ranks"]]


def calls_per_iter(run: dict, iters: int) -> float:
    """Mean over ranks of comm calls (collectives + p2p, set-up included) per iteration."""
    totals = [sum(row["calls"] for row in r.get("comm", [])) for r in run["ranks"]]
    return statistics.mean(totals) / iters


def peak_memory(runs: list[dict]) -> dict:
    """Per rank, the tracked peaks of every run of each side: the run-to-run spread of plain gloo
    (its worker threads release buffers at racy times) next to the prism-vs-plain difference."""
    peaks = {side: [[r["peak_tracked_bytes"] for r in run["ranks"]] for run in runs if run["side"] == side]
             for side in SIDES}
    per_rank = list(zip(*peaks["plain"])), list(zip(*peaks["prism"]))
    plain_spread = max(max(p) - min(p) for p in per_rank[0])
    prism_vs_plain = max(abs(statistics.median(b) - statistics.median(a)) for a, b in zip(*per_rank))
    return {"peaks_bytes": peaks, "plain_spread_bytes": plain_spread,
            "prism_vs_plain_median_bytes": prism_vs_plain}


def summarize(cfg: BenchConfig, runs: list[dict], iters: int, warmup: int) -> dict:
    out: dict = {"config": cfg.name, "args": list(cfg.args), "nproc": cfg.nproc, "runs": []}
    failed = [r for r in runs if "error" in r]
    if failed:
        out["error"] = f"{failed[0]['side']} run {failed[0]['rep']}: {failed[0]['error']}"
    for r in runs:
        row = {"side": r["side"], "rep": r["rep"], "wall_s": round(r["wall_s"], 2)}
        if "error" in r:
            row["error"] = r["error"]
        else:
            times = job_times_ms(r, warmup)
            row.update(iteration_times_ms=[round(t, 3) for t in times],
                       median_ms=statistics.median(times))
        out["runs"].append(row)
    if failed:
        return out
    for side in SIDES:
        mine = [r for r in out["runs"] if r["side"] == side]
        medians = [r["median_ms"] for r in mine]
        median = statistics.median(t for r in mine for t in r["iteration_times_ms"])
        out[side] = {"median_ms": median, "spread": (max(medians) - min(medians)) / median,
                     "run_medians_ms": medians}
    out["ratio"] = out["prism"]["median_ms"] / out["plain"]["median_ms"]
    pairs = zip(*([r["median_ms"] for r in out["runs"] if r["side"] == s] for s in SIDES))
    out["paired_ratios"] = [prism / plain for plain, prism in pairs]
    out["calls_per_iter"] = calls_per_iter(next(r for r in runs if r["side"] == "prism"), iters)
    out["e2e_delta_per_call_us"] = ((out["prism"]["median_ms"] - out["plain"]["median_ms"]) * 1e3
                                   / out["calls_per_iter"])
    reference = numerics(runs[0])
    out["losses_identical"] = all(numerics(r) == reference for r in runs)
    out["memory"] = peak_memory(runs)
    out["goal_met"] = out["ratio"] <= GOAL_RATIO
    return out


def bench(cfg: BenchConfig, iters: int, warmup: int, reps: int, workdir: str) -> dict:
    runs = []
    for rep in range(reps):
        for side in SIDES:
            run = run_once(cfg, side, rep, iters, workdir)
            runs.append(run)
            shown = (f"error: {run['error']}" if "error" in run else
                     f"median {statistics.median(job_times_ms(run, warmup)):.1f} ms")
            print(f"  [{cfg.name}] rep {rep + 1}/{reps} {side:<5}: {shown} "
                  f"(wall {run['wall_s']:.1f} s)", flush=True)
            if "error" in run:  # the rest of this config would fail the same way
                return summarize(cfg, runs, iters, warmup)
    return summarize(cfg, runs, iters, warmup)


def per_call_worker(side: str, calls: int, out_path: str) -> None:
    """Under torchrun: time `dist.all_reduce` of PER_CALL_NUMEL floats, set up as pretrain_gpt does."""
    import torch
    import torch.distributed as dist

    import prism_megatron
    from prism_megatron.config import load_config

    size = int(os.environ["WORLD_SIZE"])
    virtual = [f"emulation.virtual_world_size={size}"] if side == "prism" else []
    inst = prism_megatron.install(load_config(["train.device=cpu", *virtual]))
    try:
        dist.init_process_group(backend="gloo")
        t = torch.ones(PER_CALL_NUMEL)
        for _ in range(PER_CALL_BLOCK):  # warm-up: connections, first allocations
            dist.all_reduce(t)
        wall_us, cpu_us = [], []
        for _ in range(max(1, calls // PER_CALL_BLOCK)):
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(PER_CALL_BLOCK):
                dist.all_reduce(t)
            cpu_us.append((time.process_time() - start_cpu) / PER_CALL_BLOCK * 1e6)
            wall_us.append((time.perf_counter() - start) / PER_CALL_BLOCK * 1e6)
        if dist.get_rank() == 0:
            atomic_write_text(out_path, json.dumps({"wall_us": wall_us, "cpu_us": cpu_us}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        inst.uninstall()


def bench_per_call(calls: int, reps: int, workdir: str) -> dict:
    """Interleaved one-process jobs of `per_call_worker`: median microseconds per all_reduce.

    Alone, the prism side has no inner backend, so its time is all of prism's own work per call
    (torch's dist wrapper, `PrismGroup`, the comm log, the completed Work): an upper bound on what
    prism adds to a gloo call. The plain side (gloo, world of one) is shown for scale. CPU time
    (process_time) is used: waiting for a core on a busy machine does not inflate it.
    """
    blocks = {side: {"wall_us": [], "cpu_us": []} for side in SIDES}
    for rep in range(reps):
        for side in SIDES:
            stem = os.path.join(workdir, f"per-call-{side}-{rep}")
            rc, wall_s = launch(PER_CALL_NPROC, [os.path.abspath(__file__), "--worker", side,
                                                 "--calls", str(calls), "--worker-out",
                                                 stem + ".json"], stem + ".log")
            if rc != 0:
                error = first_error(stem + ".log", rc)
                print(f"  [per-call] rep {rep + 1}/{reps} {side:<5}: error: {error}", flush=True)
                return {"error": f"{side} run {rep}: {error}"}
            with open(stem + ".json") as f:
                mine = json.load(f)
            for key in ("wall_us", "cpu_us"):
                blocks[side][key] += mine[key]
            print(f"  [per-call] rep {rep + 1}/{reps} {side:<5}: median "
                  f"{statistics.median(mine['cpu_us']):.1f} us CPU per all_reduce "
                  f"(wall {wall_s:.1f} s)", flush=True)
    out = {"nproc": PER_CALL_NPROC, "numel": PER_CALL_NUMEL, "calls": calls}
    for key in ("wall_us", "cpu_us"):
        out[key] = {side: statistics.median(blocks[side][key]) for side in SIDES}
    out["blocks"] = blocks
    return out


def print_table(rows: list[dict], per_call: dict | None, iters: int, warmup: int,
                reps: int) -> None:
    header = (f"{'config':<16}{'plain ms':>10}{'spread':>8}{'prism ms':>10}{'spread':>8}"
              f"{'prism/plain':>13}{'goal':>6}{'paired':>14}{'calls/it':>10}{'est.':>7}  losses")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<16}failed: {r['error']}")
            continue
        paired = f"{min(r['paired_ratios']):.3f}..{max(r['paired_ratios']):.3f}"
        est = f"{r['estimated_ratio']:.3f}" if "estimated_ratio" in r else "-"
        print(f"{r['config']:<16}{r['plain']['median_ms']:>10.1f}{r['plain']['spread']:>7.1%} "
              f"{r['prism']['median_ms']:>10.1f}{r['prism']['spread']:>7.1%} "
              f"{r['ratio']:>13.3f}{'ok' if r['goal_met'] else 'MISS':>6}{paired:>14}"
              f"{r['calls_per_iter']:>10.0f}{est:>7}"
              f"  {'bitwise identical' if r['losses_identical'] else 'DIFFER'}")
    for r in rows:
        if "memory" in r:
            m = r["memory"]
            print(f"{r['config']:<16}tracked peak: plain run-to-run spread {m['plain_spread_bytes']} B, "
                  f"prism vs plain (medians, worst rank) {m['prism_vs_plain_median_bytes']:.0f} B")
    print(f"goal: prism/plain <= {GOAL_RATIO}; medians of {iters - warmup} iterations x {reps} runs "
          f"per side (first {warmup} of each run left out); spread = (max - min) / median of the "
          f"run medians; paired = prism/plain per repetition; est. = 1 + calls/it x prism "
          f"layer us / plain ms, an upper bound")
    if per_call is None:
        return
    if "error" in per_call:
        print(f"per-call: failed: {per_call['error']}")
        return
    c = per_call["cpu_us"]
    print(f"per-call: dist.all_reduce of {per_call['numel']} floats in one process, median of "
          f"{PER_CALL_BLOCK}-call blocks, CPU: prism layer alone {c['prism']:.1f} us (no inner "
          f"backend); gloo world of one {c['plain']:.1f} us, for scale")


def default_json_path() -> str:
    return os.path.join(RESULTS_DIR, "prism_overhead.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="training iterations per run")
    parser.add_argument("--warmup", type=int, default=2,
                        help="first iterations of each run left out of the figures")
    parser.add_argument("--reps", type=int, default=3, help="runs per side, interleaved")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--per-call-calls", type=int, default=2000,
                        help="all_reduce calls per one-process per-call job (0: skip the estimate)")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="results file (default: benchmarks/results/prism_overhead.json)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        parser.error(f"--configs: unknown {unknown or 'empty list'}; expected names among "
                     f"{', '.join(CONFIGS)}, comma-separated")
    if args.iters <= args.warmup or args.warmup < 0 or args.reps < 1:
        parser.error(f"need --iters({args.iters}) > --warmup({args.warmup}) >= 0 and "
                     f"--reps({args.reps}) >= 1")
    args.configs = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        per_call_worker(args.worker, args.calls, args.worker_out)
        return 0
    start = time.perf_counter()
    rows, per_call = [], None
    with tempfile.TemporaryDirectory(prefix="prism_overhead.") as workdir:
        if args.per_call_calls > 0:
            per_call = bench_per_call(args.per_call_calls, args.reps, workdir)
        for name in args.configs:
            rows.append(bench(CONFIGS[name], args.iters, args.warmup, args.reps, workdir))
    for r in rows:
        if per_call is not None and "error" not in per_call and "error" not in r:
            r["estimated_ratio"] = 1 + (r["calls_per_iter"] * per_call["cpu_us"]["prism"]
                                        / (r["plain"]["median_ms"] * 1e3))
    total_s = time.perf_counter() - start
    print()
    print_table(rows, per_call, args.iters, args.warmup, args.reps)
    print(f"total {total_s:.0f} s")
    path = args.json or default_json_path()
    payload = {"benchmark": "prism_overhead", "host": socket.gethostname(),
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "goal_ratio": GOAL_RATIO, "iters": args.iters, "warmup": args.warmup,
               "reps": args.reps, "cpu_count": os.cpu_count(), "total_s": total_s, "rows": rows,
               "per_call": per_call}
    atomic_write_text(path, json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")
    ok = all("error" not in r and r["losses_identical"] for r in rows) and (
        per_call is None or "error" not in per_call)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
