"""`prism-megatron`: the command line. Subcommands take omegaconf overrides (`parallel.tp=8`).

    prism-megatron train [--config FILE] [key=value ...] [--json PATH]   run examples/pretrain_gpt.py
                                          (summary: --json, else runs/train-<config>-<hash>/summary.json)
    prism-megatron world [--config FILE] [key=value ...] [--rank R]      a virtual rank's coordinates/groups
    prism-megatron config [--config FILE] [key=value ...]                the resolved config, or its keys
    prism-megatron capture [--config FILE] [key=value ...] --out DIR [--json PATH] [--workers P]
                                                                         slice capture of the full graph
    prism-megatron export GRAPH [--perfetto PATH --ranks R,...] [--chakra DIR --ranks R,...]
                                                                         Perfetto / Chakra ET exports
    prism-megatron simulate GRAPH [cluster=NAME] [cluster.KEY=V] [slowdown.RANK=F] [calibration=F]
    prism-megatron faults GRAPH --inject "slow(4711, 1.5); link(node3, 2)" [--heatmap PNG] [--json PATH]
    prism-megatron faults GRAPH --fit LOG.json [--candidates all]
                   [microbatches=M] [--json PATH] [--csv PATH] [--perfetto PATH --ranks R,...]
                                                                         replay all N ranks (DES)
    prism-megatron emulate GRAPH --out DIR [--sandbox first-stage,4711] [cluster=NAME] [--json PATH]
                                                                         sandboxes real, ghosts replayed
    prism-megatron run [--config FILE] [key=value ...] --out DIR [--sandbox ...] [--json PATH]
                                                                         capture (cached) + emulate
    prism-megatron moe-check [--config FILE] [key=value ...] --out DIR [--capacity 80GiB] [--json PATH]
                                                                         per-rank MoE peaks; exit 3 on OOM

capture, emulate, run, sweep and moe-check take the training job as `-- SCRIPT ARGS` (the user's own
script, Megatron-LM's `pretrain_gpt.py`; config/job.py); emulate's replaces the graph's job.

Without `--config`, `train`, `world` and `capture` use the built-in default `configs/default.yaml`
(rank 4711 of GPT-175B on 8192 H200s, TP8 PP16 DP64; on a CPU under fake execution). Bad input
prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Optional

from prism_megatron import resources
from prism_megatron.config import ConfigError, load_config, to_yaml
from prism_megatron.config.flags import _SECTIONS, OneLineParser, field_docs
from prism_megatron.config.job import config_file as _config_file
from prism_megatron.config.job import job_of
from prism_megatron.util import atomic_write_text


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="prism-megatron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "train a GPT as one rank of the virtual world"),
                       ("world", "show a virtual rank's coordinates, role and groups"),
                       ("config", "print the resolved config that train (or, given -- SCRIPT ARGS, capture) "
                                  "would run (--keys: every key with its doc)"),
                       ("capture", "capture the full-scale execution graph by running roles as slices"),
                       ("export", "export a graph: Perfetto/Chrome trace of ranks, Chakra ET files"),
                       ("simulate", "replay a captured graph over all N ranks on a modelled cluster"),
                       ("faults", "inject stragglers, throttling, slow links or host stalls into the replay "
                                  "and report their impact; or --fit the straggler behind a measured log"),
                       ("calibrate", "time real collectives here and fit the network cost model"),
                       ("emulate", "run sandbox ranks for real, the other ranks replayed from the graph"),
                       ("run", "capture (if not cached), simulate and emulate a config"),
                       ("moe-check", "predict every EP rank's peak memory under an MoE imbalance model"),
                       ("sweep", "capture and simulate every point of a config-override sweep, resumably"),
                       ("report", "write an HTML page and a Markdown summary of a run or emulation"),
                       ("launch", "run an unmodified training script (Megatron-LM's pretrain_gpt.py) with "
                                  "the hooks installed: launch [--nproc-per-node P] -- SCRIPT ARGS"),
                       ("validate", "the fidelity harness: real runs against their emulation, side by side "
                                    "(`validate --help` lists its flags)")):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.error = parser.error  # subcommand usage errors: one line too
        if name == "calibrate":
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
            continue
        if name == "faults":
            from prism_megatron.faults.cli import add_arguments

            add_arguments(cmd)
            continue
        if name == "simulate":
            cmd.add_argument("graph", help="graph file written by `capture`")
            cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                             help="cluster=dgx_h100|dgx_a100|h200x2|cpu_host|FILE, cluster.nic_Gbps=200, "
                                  "slowdown.4711=1.5, calibration=FILE, microbatches=64")
            cmd.add_argument("--json", default=None, help="write the summary and per-class figures here")
            cmd.add_argument("--csv", default=None, help="write one row per rank here")
            cmd.add_argument("--perfetto", default=None, help="write the simulated timeline of --ranks")
            cmd.add_argument("--ranks", default="0", help="ranks for --perfetto, e.g. 0,4711")
            continue
        if name in ("emulate", "run"):
            if name == "emulate":
                cmd.add_argument("graph", help="graph file written by `capture`")
                cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                                 help="cluster=NAME|FILE, cluster.KEY=V, calibration=FILE")
            else:
                cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                                 help="config overrides (parallel.tp=2 ...) and cluster=NAME, "
                                      "cluster.KEY=V, calibration=FILE")
                cmd.add_argument("--config", default=None,
                                 help="YAML config file (default: configs/default.yaml)")
                cmd.add_argument("--workers", type=int, default=None, help="capture slices at once")
            cmd.add_argument("--sandbox", default=None,
                             help="virtual ranks and role names, e.g. first-stage,last-stage,4711 (default: "
                                  "the config's sandbox ranks, else first-stage)")
            cmd.add_argument("--out", required=True, help="directory for the sandbox run and its results")
            cmd.add_argument("--device", choices=("cpu", "cuda"), default=None,
                             help="where the sandboxes run (default: the capture's device)")
            cmd.add_argument("--clock", choices=("virtual", "realtime"), default="virtual",
                             help="virtual: compute the iteration time; realtime: then run the sandboxes "
                                  "again with their communication held as the replay says and report "
                                  "their wall clock")
            cmd.add_argument("--pace", choices=("auto", "on", "off"), default="auto",
                             help="hold each of the sandbox's collectives on its device stream for the wait "
                                  "a ghost-only replay computes, so compute is measured at the production "
                                  "duty cycle (auto: on GPU, where the native backend has its CUDA part)")
            cmd.add_argument("--faults", default=None,
                             help="fault specs injected into the job, e.g. "
                                  "\"slow(4711, 1.5); link(node3, 2)\" (default: the config's faults.inject)")
            cmd.add_argument("--json", default=None, help="write the summary JSON here too")
            continue
        if name == "sweep":
            cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                             help="Hydra multirun overrides: parallel.tp=2,4,8 parallel.pp=range(1,5) ...; and "
                                      "Hydra's own: hydra/launcher=submitit_slurm hydra.sweeper.search=optuna")
            cmd.add_argument("-m", "--multirun", action="store_true", help="accepted for Hydra habit")
            cmd.add_argument("--config", default=None,
                             help="YAML config file (default: configs/default.yaml)")
            cmd.add_argument("--out", required=True, help="directory for results.csv and the points")
            cmd.add_argument("--cluster", default="dgx_h100", help="cluster the points are simulated on")
            cmd.add_argument("--jobs", type=int, default=1, help="points at once (the joblib launcher's n_jobs)")
            cmd.add_argument("--workers", type=int, default=None, help="capture slices at once per point")
            cmd.add_argument("--json", default=None, help="write the points, ranking and best here too")
            continue
        if name == "moe-check":
            cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                             help="config overrides, e.g. model=tiny_moe moe.imbalance=zipf(1.2); "
                                  "cluster=NAME")
            cmd.add_argument("--config", default=None,
                             help="YAML config file (default: configs/default.yaml)")
            cmd.add_argument("--out", required=True, help="directory for the calibration sandboxes")
            cmd.add_argument("--capacity", default=None,
                             help="device memory per GPU, e.g. 80GiB (default: the cluster's GPU memory)")
            cmd.add_argument("--json", default=None, help="write the verdict JSON here too")
            continue
        if name == "report":
            cmd.add_argument("run_dir", help="the --out directory of `run` or `emulate`")
            cmd.add_argument("--out", default=None, help="where report.html and report.md go (default: "
                                                         "beside the run's summary)")
            cmd.add_argument("--json", default=None, help="write the report's paths and headline here too")
            continue
        if name == "export":
            cmd.add_argument("graph", help="graph file written by `capture`")
            cmd.add_argument("--ranks", default="0", help="virtual ranks to export, e.g. 0,4711")
            cmd.add_argument("--perfetto", default=None, help="write a Chrome-trace JSON here")
            cmd.add_argument("--chakra", default=None, help="write Chakra ET files (one per rank) here")
            continue
        cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                         help="config overrides, e.g. model=tiny_moe parallel.tp=2")
        cmd.add_argument("--config", default=None, help="YAML config file (default: configs/default.yaml)")
        if name == "capture":
            cmd.add_argument("--out", required=True, help="directory for the slices and graph.prism")
            cmd.add_argument("--json", default=None, help="write the capture summary JSON here")
            cmd.add_argument("--workers", type=int, default=None,
                             help="slices at once (default: the GPUs present, else 2)")
            cmd.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                             help="where slices run (default: train.device)")
        if name == "train":
            cmd.add_argument("--json", default=None, help="write the run summary JSON here (default: "
                             "runs/train-<config>-<hash>/summary.json)")
        if name == "world":
            cmd.add_argument("--rank", type=int, default=None, help="virtual rank (default: sandbox)")
            cmd.add_argument("--json", default=None, help="write the description as JSON here")
        if name == "config":
            cmd.add_argument("--keys", action="store_true", help="list every key with its doc")
    return parser


def _cmd_train(args) -> int:
    example = resources.EXAMPLE_DIR / "pretrain_gpt.py"
    if not example.is_file():
        raise ConfigError(f"{example} not found: the package was installed without its example "
                          "scripts; reinstall it (`pip install .` ships them)")
    load_config(args.overrides, _config_file(args.config))  # fail fast, before importing megatron
    spec = importlib.util.spec_from_file_location("pretrain_gpt", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--prism-override", *args.overrides]
    config_file = _config_file(args.config)
    if config_file:
        argv += ["--prism-config", config_file]
    argv += ["--prism-summary-json", args.json or _train_summary_path(args.overrides, config_file)]
    return module.main(argv)


def _train_summary_path(overrides: list[str], config_file: Optional[str]) -> str:
    """Where `train` writes its summary without `--json`: `runs/train-<config>-<hash>/summary.json`
    under the current folder, the hash of the resolved config, so that another job never overwrites
    it and the same job does."""
    import hashlib

    text = to_yaml(load_config(overrides, config_file))
    name = Path(config_file).stem if config_file else "schema-defaults"
    return str(Path("runs", f"train-{name}-{hashlib.sha1(text.encode()).hexdigest()[:8]}", "summary.json"))


def _cmd_world(args) -> int:
    from prism_megatron.world import VirtualWorld

    cfg = load_config(args.overrides, _config_file(args.config))
    p, e = cfg.parallel, cfg.emulation
    if e.virtual_world_size is None:
        raise ConfigError("no virtual world: set emulation.virtual_world_size=N")
    world = VirtualWorld(world_size=e.virtual_world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                         etp=p.etp, vpp=p.vpp, order=p.order, gpus_per_node=e.gpus_per_node)
    rank = args.rank if args.rank is not None else (e.sandbox_ranks or [0])[0]
    if not 0 <= rank < world.world_size:
        raise ConfigError(f"--rank {rank} is outside the virtual world of {world.world_size} ranks")
    groups = {}
    for dim in ("tp", "cp", "dp", "pp", "ep", "etp", "expert_dp", "dp_cp", "tp_pp", "embedding"):
        members = world.group(rank, dim)
        if rank in members:
            groups[dim] = list(members)
    info = {"virtual_rank": rank, "virtual_world_size": world.world_size, "node": world.node(rank),
            "coords": world.coords(rank), "role": str(world.role(rank)), "roles": len(world.roles()),
            "dp": world.dp, "groups": groups}
    for key, value in info.items():
        if key != "groups":
            print(f"{key:>20}: {value}")
    for dim, members in groups.items():
        shown = members if len(members) <= 16 else members[:8] + ["..."] + members[-4:]
        print(f"{'group ' + dim:>20}: {len(members)} ranks {shown}")
    if args.json:
        atomic_write_text(args.json, json.dumps(info, indent=1))
    return 0


def _cmd_config(args) -> int:
    if args.keys:
        for section, cls in _SECTIONS.items():
            docs = field_docs(cls)
            for f in fields(cls):
                print(f"{section}.{f.name} = {getattr(cls(), f.name)!r}\n    {docs.get(f.name, '')}")
        return 0
    from prism_megatron.config.job import job_config

    # what `train` (the default config file) or a command given `-- SCRIPT ARGS` would run
    config_file = args.config if args.script else _config_file(args.config)
    print(to_yaml(job_config(args.overrides, config_file, args.script)), end="")
    return 0


SCRIPT_COMMANDS = ("capture", "emulate", "run", "sweep", "moe-check", "config")
"""The subcommands that take the job as `-- SCRIPT ARGS` (config/job.py)."""


def _cmd_capture(args) -> int:
    from prism_megatron.capture.run import Capture, CaptureFailed, write_summary
    from prism_megatron.graph.check import GraphFileError

    cfg = job_of(args)
    cfg.emulation.sandbox_ranks = []  # the capture chooses the ranks it runs
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: expected 1 or more slices at once")
    try:
        result = Capture(cfg, args.out, workers=args.workers, device=args.device).run()
    except GraphFileError as err:  # the merged graph is inconsistent: not the user's input
        raise CaptureFailed(str(err)) from None
    write_summary(result, args.json)
    print(f"captured {len(result.roles_captured)} of {result.roles_total} roles in "
          f"{result.slices_run} slices ({result.slices_reused} reused, {result.retries} retried); "
          f"{len(result.roles_inferred)} inferred from verified symmetric roles")
    for c in result.classes:
        verdict = "symmetric" if c["symmetric"] else "NOT symmetric: all captured"
        print(f"  class {c['key']:>20}: {c['roles']:4d} roles, probes {', '.join(c['probes'])}: {verdict}")
    print(f"graph: {result.graph_path} ({result.graph_bytes / 1024:.1f} KiB), wall {result.wall_s:.1f} s")
    return 0


def _cmd_export(args) -> int:
    from prism_megatron.sim.cli import parse_ranks
    from prism_megatron.graph import load_graph
    from prism_megatron.graph.chakra import write_chakra
    from prism_megatron.graph.perfetto import write_chrome_trace

    if not (args.perfetto or args.chakra):
        raise ConfigError("nothing to export: give --perfetto PATH and/or --chakra DIR")
    ranks = parse_ranks(args.ranks)
    graph = load_graph(args.graph)
    bad = [r for r in ranks if not 0 <= r < graph.world.world_size]
    if bad:
        raise ConfigError(f"--ranks {bad} outside the virtual world of {graph.world.world_size}; "
                          f"choose ranks in 0..{graph.world.world_size - 1}")
    if args.perfetto:
        write_chrome_trace(graph, ranks, args.perfetto)
        print(f"perfetto: {args.perfetto}")
    if args.chakra:
        for path in write_chakra(graph, ranks, args.chakra):
            print(f"chakra: {path}")
    return 0


def _cmd_simulate(args) -> int:
    from prism_megatron.sim.cli import simulate_command

    return simulate_command(args)


def _cmd_calibrate(args) -> int:
    from prism_megatron.commands.calibrate import command

    return command(args)


def _check_fault_specs(text: Optional[str]) -> None:
    """`--faults SPEC` read before any work (its ranks are checked against the graph's world later)."""
    from prism_megatron.faults.spec import FaultError, parse_faults

    try:
        parse_faults(text)
    except FaultError as err:
        raise ConfigError(f"--faults: {err}") from None


def _cmd_emulate(args) -> int:
    from prism_megatron.emulate.cli import emulate_command

    _check_fault_specs(args.faults)
    return emulate_command(args)


def _cmd_run(args) -> int:
    from prism_megatron.emulate.cli import run_command

    _check_fault_specs(args.faults)
    return run_command(args)


def _cmd_sweep(args) -> int:
    from prism_megatron.sweep.cli import sweep_command

    return sweep_command(args)


def _cmd_moe_check(args) -> int:
    from prism_megatron.commands.moe_check import moe_check_command

    return moe_check_command(args)


def _cmd_faults(args) -> int:
    from prism_megatron.faults.cli import run

    return run(args)


def _validate(argv: list[str]) -> int:
    """`prism-megatron validate ...`: the fidelity harness (validate.py), with these flags."""
    from prism_megatron.validate import main as validate_main

    return validate_main(argv)


def _cmd_report(args) -> int:
    from prism_megatron.report import write_report
    from prism_megatron.report.page import headline

    page, text, data = write_report(args.run_dir, args.out)
    print(f"report: {page}\nsummary: {text}")
    if args.json:
        rows = [{"figure": a, "value": b, "from": c} for a, b, c in headline(data)]
        atomic_write_text(args.json, json.dumps({"html": page, "markdown": text, "headline": rows}, indent=1))
    return 0


OUTPUT_FILES = ("json", "csv", "perfetto", "heatmap")
OUTPUT_DIRS = ("out", "chakra")
"""The options that name what a command writes: checked before it does any work."""


def _check_outputs(args) -> None:
    """Refuse, before any work, an output that cannot be written: below a regular file, in a folder
    this process may not write, or a file where a folder is meant (and the reverse). A probe file is
    made and removed in the nearest folder that exists; nothing is created for the output itself."""
    import tempfile

    for option in (*OUTPUT_FILES, *OUTPUT_DIRS):
        value = getattr(args, option, None)
        if not value:
            continue
        folder = option in OUTPUT_DIRS and not (args.command == "calibrate" and option == "out")
        path = Path(value)
        if path.exists() and path.is_dir() != folder:
            raise ConfigError(f"--{option} {value}: is {'a file' if path.is_file() else 'a folder'}, expected "
                              f"{'a folder' if folder else 'a file'} path; give another path")
        parent = path if folder else path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"--{option} {value}: cannot be written, {parent} is a file, not a folder; give "
                              "a path in a folder you can write")
        try:
            with tempfile.TemporaryFile(dir=parent):
                pass
        except OSError as err:
            reason = err.strerror or str(err)
            raise ConfigError(f"--{option} {value}: cannot be written ({reason} in {parent}); give a path "
                              "in a folder you can write") from None


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # everything after it belongs to the launcher and the script
        from prism_megatron.launch import main as launch_main

        return launch_main(argv[1:])
    if argv[:1] == ["validate"]:  # the harness parses its own flags
        return _validate(argv[1:])
    # megatron-core warns on import that TE/Apex are absent; the local fallbacks are what we use.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    if hasattr(signal, "SIGPIPE"):  # `prism-megatron config --keys | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    script = None
    if "--" in argv:  # `-- SCRIPT ARGS`: the job, as torchrun takes it (config/job.py)
        cut = argv.index("--")
        argv, script = argv[:cut], argv[cut + 1:]
        if argv[:1] and argv[0] not in SCRIPT_COMMANDS:
            print(f"prism-megatron: error: {argv[0]} takes no training script after --; the commands that "
                  f"do: {', '.join(SCRIPT_COMMANDS)}, and launch", file=sys.stderr)
            return 2
        if not script:
            print("prism-megatron: error: nothing after --; give the training script and its arguments "
                  "(-- pretrain_gpt.py --num-layers 16 ...)", file=sys.stderr)
            return 2
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    args.script = script
    # KEY=VALUE overrides may follow options (`--out D cluster=x`); argparse leaves those over.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from prism_megatron.capture.run import CaptureFailed
    from prism_megatron.emulate.run import EmulationFailed
    from prism_megatron.graph.check import GraphFileError

    commands = {"train": _cmd_train, "world": _cmd_world, "config": _cmd_config,
                "capture": _cmd_capture, "export": _cmd_export, "simulate": _cmd_simulate,
                "calibrate": _cmd_calibrate, "emulate": _cmd_emulate, "run": _cmd_run,
                "moe-check": _cmd_moe_check, "sweep": _cmd_sweep, "report": _cmd_report,
                "faults": _cmd_faults}
    try:
        _check_outputs(args)
        return commands[args.command](args)
    except (ConfigError, GraphFileError) as err:
        print(f"prism-megatron: error: {err}", file=sys.stderr)
        return 2
    except CaptureFailed as err:
        print(f"prism-megatron: capture failed: {err}", file=sys.stderr)
        return 1
    except EmulationFailed as err:
        print(f"prism-megatron: emulation failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
