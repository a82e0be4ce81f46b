"""`prism-megatron validate`, the fidelity harness: the real job (N processes, plain megatron-core) against
its emulation (1 process).

For each named config, in one invocation: the emulation captures the job's graph once (slices, one
process at a time); then the real job (N processes under torchrun; no virtual world, no recorder) and
`prism-megatron emulate` (one sandbox process per sandbox spec of the config: first stage, last stage,
hottest expert) run `--reps` times each, interleaved. Per config and sandbox it prints the real median
iteration time and its run-to-run spread, the emulated iteration time, the error, and the real and
emulated peak allocated memory of the sandbox rank and their error. The default configs are the
2-rank suite of issue [D]; the 8-rank suite of issue [I] (tp8, tp4_pp2, tp2_pp2_dp2_distopt_overlap,
pp8_vpp2, moe_ep8, tp2_ep4) runs by name: 8 GPUs of one host, or 8 gloo processes on CPU.

Real iteration time: per run, the median over iterations after `--warmup` of the slowest rank's
iteration time (the example times each iteration from zero_grad to after the optimizer step and a
device synchronize); the real figure is the median of the runs, the spread (max - min) / median. A
config routed by an imbalance model whose loads differ per iteration (uniform draws, a replayed log,
drift) compares the slowest rank's time in the iteration the emulation timed (same loads) instead.
Emulated: the DES iteration time of the job with the sandbox's recorded iteration in its rank's place
(on GPU measured paced: emulate/run.py). `--realtime`: every emulation also runs with its
communication held as the replay says (emulate/holds.py), and its wall clock is reported against the
virtual figure and against the replay of that run's own compute, per repetition and as medians.

`--diagnose` splits a config's error in two: it also runs the job with every rank a sandbox (N
processes, real communication, the recorder on) and replays that. Its replay against the real time is
the error of the communication model and the replay (the compute is the real job's own); the one
sandbox's compute against that run's compute of the same rank is the error of running one rank alone;
the op names whose total duration differs most are listed.

    prism-megatron validate [--configs ...] [--device cpu|cuda] [--reps 3] [--json PATH] [--list]
    prism-megatron validate --world 8 --sandbox first-stage,last-stage [...] -- SCRIPT ARGS
    python benchmarks/fidelity.py [...]      the same, its results and calibration in benchmarks/results/

With `-- SCRIPT ARGS` the job is the user's own script (config/job.py), in the place of the named
configs: its real run is the script under torchrun as `--world` processes (through `prism-megatron
launch` without a virtual world, whose summary gives each rank's iteration times and peak memory),
its emulation the capture and emulation of the same command at a virtual world of that size.

Writes fidelity.json in the current folder (benchmarks/fidelity.py: in benchmarks/results/) unless
--json says otherwise.
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
from datetime import date
from pathlib import Path
from typing import Optional

import yaml

COMMITTED_CALIBRATION = "calibration-h200x2.json"
"""The 2-GPU network calibration a results folder holds (benchmarks/results/), used on cuda for <= 2 ranks."""

# name -> (world, config overrides, sandbox specs)
CONFIGS = {
    "tp2": (2, ["parallel.tp=2"], ["first-stage"]),
    "pp2_1f1b": (2, ["parallel.pp=2"], ["first-stage"]),
    "dp2_distopt_overlap": (2, ["train.use_distributed_optimizer=true", "train.overlap_grad_reduce=true"],
                            ["0"]),
    # routed by a seeded skew (the same on the real ranks and in the emulation): zipf(1.2)
    "moe_ep2": (2, ["parallel.ep=2", "model.num_experts=4", "model.moe_router_topk=2",
                    "moe.imbalance=zipf(1.2)"], ["0"]),
    # DeepSpeed (examples/deepspeed_train.py): ZeRO-2 over the 2 ranks, bf16
    "zero2_dp2": (2, ["train.framework=deepspeed", "train.deepspeed_config=configs/deepspeed/zero2.json"],
                  ["0"]),
    # issue [I]: 8 ranks (8 GPUs of one host, or 8 gloo processes), each sandbox spec emulated alone
    "tp8": (8, ["parallel.tp=8"], ["first-stage"]),
    "tp4_pp2": (8, ["parallel.tp=4", "parallel.pp=2"], ["first-stage", "last-stage"]),
    "tp2_pp2_dp2_distopt_overlap": (8, ["parallel.tp=2", "parallel.pp=2", "train.use_distributed_optimizer=true",
                                        "train.overlap_grad_reduce=true"], ["first-stage", "last-stage"]),
    "pp8_vpp2": (8, ["parallel.pp=8", "parallel.vpp=2", "model.num_layers=16"], ["first-stage", "last-stage"]),
    "moe_ep8": (8, ["parallel.ep=8", "model.num_experts=8", "model.moe_router_topk=2", "moe.imbalance=zipf(1.2)"],
                ["first-stage", "hottest-expert"]),
    "tp2_ep4": (8, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=4", "model.num_experts=8",
                    "model.moe_router_topk=2", "moe.imbalance=zipf(1.2)"], ["first-stage", "hottest-expert"]),
}
SCRIPT = "script"
"""The config name of the job given after `--` (its world and sandboxes from --world, --sandbox)."""
SCRIPT_TOKENS: list[str] = []
DEFAULT_CONFIGS = [name for name, (world, _, _) in CONFIGS.items() if world == 2]
"""Those a plain run measures: the 2-rank suite of issue [D] (the 8-rank ones of [I] by name)."""
SHAPES = {  # per device: model and batch; an iteration of >= 300 ms on an H200 with the GPU shape
    "cpu": ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=8",
            "model.seq_length=128", "train.micro_batch_size=2", "train.global_batch_size=16"],
    "cuda": ["model.num_layers=8", "model.hidden_size=4096", "model.num_attention_heads=32",
             "model.seq_length=2048", "model.vocab_size=32000", "model.params_dtype=bf16",
             "train.micro_batch_size=1", "train.global_batch_size=16"],
}


def config_file(name: str, device: str, iters: int, tmp: Path) -> tuple[Path, int, list[str]]:
    from prism_megatron.config import load_config
    from prism_megatron.config.job import job_config
    from prism_megatron.config.loader import to_yaml

    world, overrides, sandbox = CONFIGS[name]
    if name == SCRIPT:  # the user's script: its flags are its shape; it runs `iters` iterations
        cfg = job_config([f"emulation.virtual_world_size={world}", f"emulation.stop_after={iters}",
                          f"train.device={device}", "emulation.sandbox_ranks=[]", *overrides], None,
                         SCRIPT_TOKENS)
        cfg.emulation.virtual_world_size = None  # the real run is plain; capture() sets it again
    else:
        cfg = load_config([*SHAPES[device], *overrides, f"train.iters={iters}", f"train.device={device}",
                           "emulation.sandbox_ranks=[]"])
    cfg.check_world(world)
    path = tmp / f"{name}.yaml"
    path.write_text(to_yaml(cfg))
    return path, world, sandbox


def real_run(name: str, config: Path, world: int, device: str, warmup: int, out: Path):
    """One real run: the median over iterations after `warmup` of the slowest rank's iteration time,
    rank -> peak allocated bytes, the slowest rank's time per iteration, and rank -> the caching
    allocator's cumulative counters per iteration (GPU)."""
    from prism_megatron.config.job import TrainingJob
    from prism_megatron.config.schema import TrainConfig
    from prism_megatron import procs
    from prism_megatron.util import free_port, job_env

    job = TrainingJob.of(TrainConfig(**(yaml.safe_load(config.read_text()).get("train") or {})))
    out.mkdir(parents=True, exist_ok=True)
    proc = procs.popen(
        job.command(["--prism-config", str(config.resolve()),
                     "--prism-summary-json", str(out.resolve() / "summary{rank}.json")],
                    nproc=world, master_port=free_port()),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job.env(job_env(cpu=device == "cpu")),
        cwd=str(job.workdir))
    try:
        _, stderr = proc.communicate(timeout=3600)
    finally:
        procs.kill(proc)  # past the timeout, or interrupted: the job's group; else only forgotten
    if proc.returncode:
        raise RuntimeError(f"{name}: real run failed: {stderr[-3000:]}")
    per_rank = [json.loads((out / f"summary{r}.json").read_text()) for r in range(world)]
    slowest = [max(x) / 1e3 for x in zip(*[s["iteration_times_ms"] for s in per_rank])]
    allocator = {s["virtual_rank"]: s.get("allocator_per_iteration") for s in per_rank}
    peaks = {s["virtual_rank"]: s.get("peak_allocated_bytes", s.get("peak_tracked_bytes")) for s in per_rank}
    return statistics.median(slowest[warmup:]), peaks, slowest, allocator


def capture(name: str, config: Path, world: int, device: str, tmp: Path) -> str:
    from prism_megatron.capture.run import Capture
    from prism_megatron.config import load_config

    cfg = load_config([f"emulation.virtual_world_size={world}"], str(config))
    run = Capture(cfg, str(tmp / f"{name}-capture"), workers=1, device=device, log=lambda s: None).run()
    return run.graph_path


def emulated_run(graph_path: str, sandbox: list[str], device: str, out: Path, cluster: str, calibration,
                 clock: str = "virtual") -> dict:
    from prism_megatron.emulate.run import Emulation
    from prism_megatron.sim.cluster import load_cluster

    summary = Emulation(graph_path, str(out), sandbox, load_cluster(cluster), calibration, device=device,
                        clock=clock).run()
    rank = summary["sandbox"][0]["virtual_rank"]
    wall = json.loads((out / "sandbox" / f"summary{rank}.json").read_text())["iteration_times_ms"]
    summary["sandbox_wall_ms"] = [round(t, 3) for t in wall]  # its own loop, ghosts answering at once
    summary["sandbox_allocator"] = json.loads((out / "sandbox" / f"summary{rank}.json").read_text()).get(
        "allocator_per_iteration")
    summary["out_dir"] = str(out)
    return summary


def measure(name: str, config: Path, world: int, sandbox: list[str], args, tmp: Path, cluster: str,
            calibration) -> tuple[list[float], dict, dict[str, list[dict]], list[list[float]]]:
    """Capture once, then real and emulated runs interleaved (real, then one emulation per sandbox
    spec, each its own single process; real, ...), so that a drift of the machine over the minutes
    of a config reaches both sides alike. Returns the real medians, rank -> real peaks, spec -> its
    emulations, and per real run the slowest rank's time per iteration."""
    graph_path = capture(name, config, world, args.device, tmp)
    real, peaks, per_iteration, allocators = [], {}, [], []
    emus: dict[str, list[dict]] = {spec: [] for spec in sandbox}
    for rep in range(args.reps):
        if not args.no_real:
            seconds, rank_peaks, slowest, allocator = real_run(name, config, world, args.device, args.warmup,
                                                    tmp / f"{name}-real{rep}")
            real.append(seconds)
            per_iteration.append(slowest)
            allocators.append(allocator)
            for rank, peak in rank_peaks.items():
                peaks.setdefault(rank, []).append(peak)
        clock = "realtime" if args.realtime else "virtual"
        for spec in sandbox:
            emus[spec].append(emulated_run(graph_path, [spec], args.device, tmp / f"{name}-{spec}-emu{rep}",
                                           cluster, calibration, clock))
    first = emus[sandbox[0]][0]
    if args.diagnose:
        first["diagnosis"] = diagnose(graph_path, world, first, args.device, tmp / f"{name}-all",
                                      cluster, calibration)
    first["real_allocator"] = allocators
    return real, peaks, emus, per_iteration


def diagnose(graph_path: str, world: int, emu: dict, device: str, out: Path, cluster: str,
             calibration) -> dict:
    """Every rank a sandbox (real communication, recorder on; nothing paced, no ghost): the replay of
    that run's recorded compute, and per op name the sandbox-alone compute minus that run's compute
    of the same rank (the names differing most, in ms)."""
    from prism_megatron.emulate.run import Emulation
    from prism_megatron.sim.cluster import load_cluster

    ranks = [str(r) for r in range(world)]
    summary = Emulation(graph_path, str(out), ranks, load_cluster(cluster), calibration, device=device,
                        pace=False).run()
    rank = emu["sandbox"][0]["virtual_rank"]
    alone = _compute_by_name(Path(emu["out_dir"]) / "sandbox" / f"rank{rank}.prism", rank)
    together = _compute_by_name(out / "sandbox" / f"rank{rank}.prism", rank)
    diff = {n: alone.get(n, 0.0) - together.get(n, 0.0) for n in {*alone, *together}}
    top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]
    walls = {r["virtual_rank"]: r["recorded_iteration_s"] for r in summary["sandbox"]}
    return {"all_sandbox_replay_s": summary["iteration_time_s"], "recorded_iteration_s": walls,
            "compute_alone_s": sum(alone.values()), "compute_together_s": sum(together.values()),
            "compute_diff_ms_by_name": {n: round(d * 1e3, 3) for n, d in top}}


def _compute_by_name(path: Path, rank: int) -> dict[str, float]:
    from prism_megatron.graph import load_graph

    g = load_graph(str(path), check=False)
    role = g.graph_of(rank)
    cols = role.columns
    totals: dict[str, float] = {}
    for name, kind, seconds in zip(cols["name"].tolist(), cols["kind"].tolist(), cols["duration_s"].tolist()):
        if kind == 0:
            key = g.strings[name]
            totals[key] = totals.get(key, 0.0) + seconds
    return totals


def _row(label: str, world: int, spec: str, emus: list[dict], real_all: list[float], peaks: dict,
         per_iteration: list[list[float]], varies: bool, config: Path) -> tuple[dict, str]:
    """One sandbox spec's row of a config (and its printed line): its rank's real and emulated
    iteration time and peak allocated memory."""
    nan = float("nan")
    rank = emus[0]["sandbox"][0]["virtual_rank"]
    real = real_all
    if real and varies:  # routed per iteration: the real iteration this emulation timed (same loads)
        timed = emus[0]["sandbox"][0]["timed_iteration"] - 1
        real = [times[timed] for times in per_iteration]
    real_s = statistics.median(real) if real else nan
    emu_s = statistics.median(e["iteration_time_s"] for e in emus)
    real_peak = statistics.median(peaks[rank]) if real else nan
    emu_peak = statistics.median(e["sandbox"][0]["peak_allocated_bytes"] for e in emus)
    row = {"config": label.split(":")[0], "world": world, "sandbox_spec": spec, "sandbox_rank": rank,
           "real_iter_s_median": real_s, "real_iter_s_runs": real,
           "real_spread_pct": (max(real) - min(real)) / real_s * 100 if real else nan,
           "emu_iter_s": emu_s, "emu_iter_s_runs": [e["iteration_time_s"] for e in emus],
           "iter_err_pct": (emu_s / real_s - 1) * 100, "real_peak_bytes": real_peak,
           "emu_peak_bytes": int(emu_peak), "mem_err_pct": (emu_peak / real_peak - 1) * 100,
           "materialized_ghosts": emus[0]["materialized_ghosts"], "classes": emus[0]["classes"],
           "physical_fraction": emus[0]["physical_fraction"],
           "sandbox_wall_ms": [e["sandbox_wall_ms"] for e in emus],
           "sandbox": [e["sandbox"][0] for e in emus],
           "real_slowest_s_per_iteration": per_iteration,
           "real_allocator": emus[0].get("real_allocator"),
           "sandbox_allocator": [e.get("sandbox_allocator") for e in emus],
           "config_yaml": yaml.safe_load(config.read_text())}
    realtime = [e["sandbox"][0] for e in emus if "realtime_iteration_s" in e["sandbox"][0]]
    note = ""
    if realtime:
        vs_virtual = [rt["realtime_vs_virtual_pct"] for rt in realtime]
        vs_replay = [rt["realtime_vs_replay_pct"] for rt in realtime]
        replays = [rt["realtime_replay_iteration_s"] for rt in realtime]
        row.update(realtime_vs_virtual_pct=statistics.median(vs_virtual), realtime_vs_virtual_runs=vs_virtual,
                   realtime_vs_replay_pct=statistics.median(vs_replay), realtime_vs_replay_runs=vs_replay,
                   realtime_iter_s_runs=[rt["realtime_iteration_s"] for rt in realtime],
                   realtime_replay_iter_s=statistics.median(replays),
                   realtime_replay_err_pct=(statistics.median(replays) / real_s - 1) * 100,
                   realtime_holds=[rt.get("realtime_injected_waits") for rt in realtime])
        note = (f"  realtime wall against virtual {' '.join(f'{x:+.2f}' for x in vs_virtual)} %, against "
                f"the replay of its own compute {' '.join(f'{x:+.2f}' for x in vs_replay)} %")
        for run in ("realtime", "paced"):  # each iteration's wall against the replay of its own durations
            own = [rt[f"{run}_vs_own_iterations_pct"] for rt in realtime if f"{run}_vs_own_iterations_pct" in rt]
            if own:
                row[f"{run}_vs_own_iterations_runs"] = own
                note += f", {run} iteration by iteration {' '.join(f'{x:+.2f}' for x in own)} %"
    if "diagnosis" in emus[0]:
        row["diagnosis"] = d = emus[0]["diagnosis"]
        note += (f"\n    all ranks sandboxes: replay {d['all_sandbox_replay_s'] * 1e3:.2f} ms "
                 f"({(d['all_sandbox_replay_s'] / real_s - 1) * 100:+.2f}% of real); compute alone "
                 f"{d['compute_alone_s'] * 1e3:.2f} ms vs together "
                 f"{d['compute_together_s'] * 1e3:.2f}"
                 f" ms; by name (ms): {d['compute_diff_ms_by_name']}")
    shares = [e["sandbox"][0]["host_bound"]["share"] for e in emus if e["sandbox"][0].get("host_bound")]
    if shares:  # on a device clock: how much of the sandbox's compute ended with its device idle
        note += f"  host-bound share {' '.join(f'{x * 100:.1f}' for x in shares)} %"
    line = (f"{label:>42}{world:>3}{rank:>5}{real_s * 1e3:>10.2f}{row['real_spread_pct']:>7.2f}%"
            f"{emu_s * 1e3:>10.2f}{row['iter_err_pct']:>7.2f}%{real_peak / 2**20:>15.2f}"
            f"{emu_peak / 2**20:>14.2f}{row['mem_err_pct']:>9.4f}%{note}")
    return row, line


def _write(path: str, args, cluster: str, calibration_from: str, rows: list) -> None:
    from prism_megatron.util import atomic_write_text

    atomic_write_text(path, json.dumps({"date": str(date.today()), "machine": platform.node(),
                                        "device": args.device, "cluster": cluster, "reps": args.reps,
                                        "calibration": calibration_from, "iters": args.iters,
                                        "warmup": args.warmup, "rows": rows}, indent=1))


def _calibration(args, nproc: int, results_dir: Optional[Path]):
    from prism_megatron.commands.calibrate import calibrate
    from prism_megatron.comm.cost import Calibration

    path = args.calibration
    if path is None and args.device == "cuda" and nproc <= 2 and results_dir is not None:
        path = str(results_dir / COMMITTED_CALIBRATION)
    if path:
        return Calibration.from_json(Path(path).read_text()), path
    # no calibration of this many ranks is committed: measure it here, on the machine under test
    with tempfile.TemporaryDirectory() as tmp:
        data = calibrate(args.device, nproc, 1 << 10, 1 << 24 if args.device == "cpu" else 1 << 28,
                         os.path.join(tmp, "cal.json"), fit_min_bytes=1 << 10 if args.device == "cpu" else 1 << 20)
    return Calibration(points=data["points"], fits=data["fits"], device=data["device"]), data["device"]


def main(argv: Optional[list[str]] = None, results_dir: Optional[Path] = None) -> int:
    """The harness with `argv` (default: the command line's); `results_dir`: where the results go and
    the committed calibration lies (benchmarks/fidelity.py passes benchmarks/results/), else the
    current folder and a calibration measured here."""
    parser = argparse.ArgumentParser(prog="prism-megatron validate",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cluster", default=None, help="network of the emulation (default: cpu_host on "
                                                        "cpu; on cuda h200x2 for 2 ranks, dgx_h200 for 8)")
    parser.add_argument("--calibration", default=None,
                        help="network calibration (default: measured here first, gloo on cpu and NCCL over the "
                             "configs' ranks on cuda; for 2 GPUs under benchmarks/fidelity.py "
                             f"benchmarks/results/{COMMITTED_CALIBRATION})")
    parser.add_argument("--realtime", action="store_true",
                        help="every emulation also runs with the realtime clock (its holds)")
    parser.add_argument("--no-real", action="store_true",
                        help="only the emulation (e.g. the realtime check on a machine with one GPU)")
    parser.add_argument("--diagnose", action="store_true",
                        help="also run every rank as a sandbox and split the error (module docstring)")
    parser.add_argument("--keep", default=None,
                        help="keep the work directory (graphs, sandbox runs, logs) here, not in /tmp")
    parser.add_argument("--json", default=None)
    parser.add_argument("--list", action="store_true", help="name the configs and exit")
    parser.add_argument("--world", type=int, default=2, help="with -- SCRIPT: the real run's processes")
    parser.add_argument("--sandbox", default="first-stage",
                        help="with -- SCRIPT: the sandbox specs emulated, e.g. first-stage,last-stage")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        argv, SCRIPT_TOKENS[:] = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if SCRIPT_TOKENS:
        if args.world < 1 or not args.sandbox.strip():
            print(f"error: --world {args.world} / --sandbox {args.sandbox!r}: expected >= 1 processes and a "
                  "sandbox spec", file=sys.stderr)
            return 2
        CONFIGS[SCRIPT] = (args.world, [], [s.strip() for s in args.sandbox.split(",") if s.strip()])
        args.configs = [SCRIPT]
        from prism_megatron.config.schema import ConfigError

        try:  # bad input stops here, before any calibration or run
            with tempfile.TemporaryDirectory() as check:
                config_file(SCRIPT, args.device, args.iters, Path(check))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.list:
        for name, (world, overrides, sandbox) in CONFIGS.items():
            print(f"{name}: N={world} {' '.join(overrides)} sandbox {','.join(sandbox)}")
        return 0
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or args.reps < 1 or args.iters <= args.warmup:
        print(f"error: configs {unknown} unknown (see --list), or --reps < 1, or --iters <= --warmup",
              file=sys.stderr)
        return 2
    world = max(CONFIGS[c][0] for c in args.configs)
    cluster = args.cluster or ("cpu_host" if args.device == "cpu" else "h200x2" if world <= 2 else "dgx_h200")
    path = args.json or str(Path(results_dir or ".") / "fidelity.json")
    calibration, calibration_from = _calibration(args, world, results_dir)
    print(f"network: {cluster}, calibration {calibration_from}")
    rows = []
    header = (f"{'config':>42}{'N':>3}{'rank':>5}{'real ms':>10}{'spread':>8}{'emu ms':>10}{'error':>8}"
              f"{'real peak MiB':>15}{'emu peak MiB':>14}{'mem err':>10}")
    print(header)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(args.keep or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        for name in args.configs:
            config, world, sandbox = config_file(name, args.device, args.iters, tmp)
            real_all, peaks, emus_by_spec, per_iteration = measure(name, config, world, sandbox, args, tmp,
                                                                   cluster, calibration)
            from prism_megatron.config import load_config

            varies = load_config([], str(config)).moe.routing_varies
            for spec, emus in emus_by_spec.items():
                row, line = _row(name if len(sandbox) == 1 else f"{name}:{spec}", world, spec, emus, real_all,
                                 peaks, per_iteration, varies, config)
                rows.append(row)
                _write(path, args, cluster, calibration_from, rows)  # after every row: nothing is lost
                print(line, flush=True)
    if not args.no_real:
        errors = [abs(r["iter_err_pct"]) for r in rows]
        print(f"mean |iteration error| {statistics.mean(errors):.2f}%, max {max(errors):.2f}%; "
              f"max |memory error| {max(abs(r['mem_err_pct']) for r in rows):.4f}%")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
