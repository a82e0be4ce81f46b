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
import importlib
import signal
import sys
import warnings
from pathlib import Path
from typing import Optional

from prism_megatron.config import ConfigError
from prism_megatron.config.flags import OneLineParser

COMMANDS = (
    ("train", "train", "train a GPT as one rank of the virtual world"),
    ("world", "world", "show a virtual rank's coordinates, role and groups"),
    ("config", "config", "print the resolved config that train (or, given -- SCRIPT ARGS, capture) would run "
                         "(--keys: every key with its doc)"),
    ("capture", "capture", "capture the full-scale execution graph by running roles as slices"),
    ("export", "export", "export a graph: Perfetto/Chrome trace of ranks, Chakra ET files"),
    ("simulate", "simulate", "replay a captured graph over all N ranks on a modelled cluster"),
    ("faults", "faults", "inject stragglers, throttling, slow links or host stalls into the replay and report "
                         "their impact; or --fit the straggler behind a measured log"),
    ("calibrate", "calibrate", "time real collectives here and fit the network cost model"),
    ("emulate", "emulate", "run sandbox ranks for real, the other ranks replayed from the graph"),
    ("run", "run", "capture (if not cached), simulate and emulate a config"),
    ("moe-check", "moe_check", "predict every EP rank's peak memory under an MoE imbalance model"),
    ("sweep", "sweep", "capture and simulate every point of a config-override sweep, resumably"),
    ("report", "report", "write an HTML page and a Markdown summary of a run or emulation"),
)
"""(subcommand, its module in prism_megatron/commands/ with add_arguments(parser) and run(args), help)."""

OWN_PARSERS = (
    ("launch", "run an unmodified training script (Megatron-LM's pretrain_gpt.py) with the hooks installed: "
               "launch [--nproc-per-node P] -- SCRIPT ARGS"),
    ("validate", "the fidelity harness: real runs against their emulation, side by side (`validate --help` "
                 "lists its flags)"),
)
"""Subcommands that parse their own flags (main hands them the rest of the command line)."""

SCRIPT_COMMANDS = ("capture", "emulate", "run", "sweep", "moe-check", "config")
"""The subcommands that take the job as `-- SCRIPT ARGS` (config/job.py)."""


def _module(name: str):
    return importlib.import_module(f"prism_megatron.commands.{name}")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="prism-megatron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module, text in (*COMMANDS, *((name, None, text) for name, text in OWN_PARSERS)):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.error = parser.error  # subcommand usage errors: one line too
        if module is not None:
            _module(module).add_arguments(cmd)
    return parser


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
        from prism_megatron.validate import main as validate_main

        return validate_main(argv[1:])
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

    modules = {name: module for name, module, _ in COMMANDS}
    try:
        _check_outputs(args)
        return _module(modules[args.command]).run(args)
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
