"""`prism-megatron launch` / `python -m prism_megatron.launch`: run an unmodified training script
(Megatron-LM's `pretrain_gpt.py`, our examples) with the hooks installed.

    prism-megatron launch [--nproc-per-node P] -- SCRIPT [script args] --prism-virtual-world-size 8192 ...

The `--prism-*` arguments (the same flags `add_prism_args` defines) configure the emulation. The
Megatron flags we know (`--tensor-model-parallel-size`, `--num-layers`, ...) are read as well, and stay
in the script's arguments. The hooks are installed once, in this process, before the script runs.
The script then sees its arguments without the `--prism-*` ones, because an unmodified Megatron-LM
parser rejects unknown flags.

A script that reads the `--prism-*` flags itself (through `add_prism_args`, as our examples and the
patched `pretrain_gpt.py` do) gets the launch's arguments as their defaults through the environment
(`PRISM_MEGATRON_LAUNCH_ARGS`). Its own
`prism_megatron.install(cfg)` returns the installation already made. With P > 1, torchrun starts P
copies of this launcher, one process per sandbox rank.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Callable, Optional


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(parsed prism and known Megatron flags, the `--prism-*` tokens, the script's own tokens).

    The `--prism-*` options and their values are taken out by the parser's own table of options
    (how many values each takes), in order; every other token stays, in order."""
    from prism_megatron.config.flags import (
        OneLineParser,
        add_megatron_args,
        add_prism_args,
    )

    prism = OneLineParser(prog="prism-megatron launch", allow_abbrev=False, add_help=False)
    add_prism_args(prism)
    actions = {opt: a for a in prism._actions for opt in a.option_strings}
    removed, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        action = actions.get(token.split("=", 1)[0])
        if action is None:
            rest.append(token)
            i += 1
            continue
        taken = 1
        if "=" not in token and action.nargs != 0:
            if action.nargs in ("+", "*"):
                while i + taken < len(argv) and not argv[i + taken].startswith("-"):
                    taken += 1
            else:
                taken += 1 if action.nargs is None else int(action.nargs)
        removed += argv[i:i + taken]
        i += taken
    both = OneLineParser(prog="prism-megatron launch", allow_abbrev=False, add_help=False)
    add_megatron_args(add_prism_args(both))
    known, _ = both.parse_known_args(argv)
    return known, removed, rest


def install_from_argv(argv: Optional[list[str]] = None):
    """Install the hooks from the `--prism-*` (and known Megatron) flags in `argv` (default:
    sys.argv[1:]); returns (the Installation, the `--prism-*` tokens, the other tokens). Raises
    ConfigError on bad input. For Megatron-LM's `pretrain_gpt.py` (patches/)."""
    import prism_megatron
    from prism_megatron.config.flags import config_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    known, prism_tokens, rest = split_args(argv)
    cfg = config_from_args(known)
    if cfg.emulation.virtual_world_size is None:
        cfg.check_world(int(os.environ.get("WORLD_SIZE", "1")))
    return prism_megatron.install(cfg), prism_tokens, rest


def extra_args_provider(inner: Optional[Callable] = None) -> Callable:
    """A Megatron-LM `extra_args_provider` that adds the `--prism-*` flags after `inner`'s, so
    Megatron's own parser accepts them (patches/)."""
    from prism_megatron.config.flags import add_prism_args

    def provider(parser):
        if inner is not None:
            parser = inner(parser) or parser
        return add_prism_args(parser)

    return provider


def run(script: str, argv: list[str]) -> int:
    """Install the hooks from `argv`'s `--prism-*` flags and run `script` with the rest."""
    from prism_megatron.config.flags import LAUNCH_ENV
    from prism_megatron.config.schema import ConfigError
    from prism_megatron.hooks import install as install_mod

    path = Path(script)
    if not path.is_file():
        print(f"prism-megatron launch: error: {script} is not a file; give the training script to run "
              "after --", file=sys.stderr)
        return 2
    try:
        inst, prism_tokens, rest = install_from_argv(argv)
    except ConfigError as err:
        print(f"prism-megatron launch: error: {err}", file=sys.stderr)
        return 2
    os.environ[LAUNCH_ENV] = json.dumps(prism_tokens)
    install_mod.set_launched(inst)
    saved = sys.argv
    sys.argv = [str(path), *rest]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
        install_mod.set_launched(None)
        inst.uninstall()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    nproc = 1
    if argv[:1] == ["--nproc-per-node"] or (argv and argv[0].startswith("--nproc-per-node=")):
        value = argv[0].split("=", 1)[1] if "=" in argv[0] else (argv[1] if len(argv) > 1 else "")
        argv = argv[1:] if "=" in argv[0] else argv[2:]
        if not value.isdigit() or int(value) < 1:
            print(f"prism-megatron launch: error: --nproc-per-node {value!r}: expected a process count "
                  ">= 1", file=sys.stderr)
            return 2
        nproc = int(value)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0].startswith("-"):
        print("prism-megatron launch: error: no training script; usage: prism-megatron launch "
              "[--nproc-per-node P] -- SCRIPT [args]", file=sys.stderr)
        return 2
    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        import subprocess

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "-m", "prism_megatron.launch", *argv]
        return subprocess.call(cmd)
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
