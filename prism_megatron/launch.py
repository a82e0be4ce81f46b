"""`prism-megatron launch` / `python -m prism_megatron.launch`: run an unmodified training script
(Megatron-LM's `pretrain_gpt.py`, our examples) with the hooks installed.

    prism-megatron launch [--nproc-per-node P] -- SCRIPT [script args] --prism-virtual-world-size 8192 ...

The `--prism-*` arguments (the same flags `add_prism_args` defines) configure the emulation. The
Megatron flags we know (`--tensor-model-parallel-size`, `--num-layers`, ...) are read as well, and stay
in the script's arguments. The hooks are installed once, in this process, before the script runs.
The script then sees its arguments without the `--prism-*` ones, because an unmodified Megatron-LM
parser rejects unknown flags, and the environment torchrun would give its rank of the virtual world
(`present_virtual_world`).

A script that reads the `--prism-*` flags itself (through `add_prism_args`, as our examples do)
gets the launch's arguments as their defaults through the environment
(`PRISM_MEGATRON_LAUNCH_ARGS`). Its own
`prism_megatron.install(cfg)` returns the installation already made. With P > 1, torchrun starts P
copies of this launcher, one process per sandbox rank.

This is the one way to run a script that knows nothing of prism: no patched copy of Megatron-LM's
`pretrain_gpt.py` is kept beside it (one would have to follow every Megatron-LM release).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Optional


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(parsed prism and known Megatron flags, the `--prism-*` tokens, the script's own tokens);
    config/flags.py `split_prism_tokens`."""
    from prism_megatron.config.flags import split_prism_tokens

    return split_prism_tokens(argv)


def install_from_argv(argv: Optional[list[str]] = None):
    """Install the hooks from the `--prism-*` (and known Megatron) flags in `argv` (default:
    sys.argv[1:]); returns (the Installation, the `--prism-*` tokens, the other tokens). Raises
    ConfigError on bad input."""
    import prism_megatron
    from prism_megatron.config.flags import config_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    known, prism_tokens, rest = split_args(argv)
    cfg = config_from_args(known)
    if cfg.emulation.virtual_world_size is None:
        cfg.check_world(int(os.environ.get("WORLD_SIZE", "1")))
    return prism_megatron.install(cfg), prism_tokens, rest


def present_virtual_world(emulation, environ=os.environ) -> None:
    """Give the script the environment torchrun would give rank r of the virtual world.

    RANK is this process's sandbox rank and WORLD_SIZE the virtual world's size, so the script's
    own checks (Megatron-LM's `validate_args`: world size divisible by TP x PP x CP) and its
    `init_process_group(world_size=..., rank=...)` see the job it stands for. LOCAL_RANK and
    LOCAL_WORLD_SIZE stay physical: a script picks its GPU by LOCAL_RANK
    (`torch.cuda.set_device`), and this machine has the physical devices only. The physical rank
    and process count move to PRISM_PHYSICAL_RANK / PRISM_PHYSICAL_WORLD_SIZE, where the
    init_process_group hook finds them (hooks/torch_dist.py). MASTER_ADDR/PORT are the physical
    processes' meeting point, set for a lone process too, since scripts read them. Without a
    virtual world (`--prism-virtual-world-size` absent) nothing changes."""
    from prism_megatron.util import PHYSICAL_RANK_ENV, PHYSICAL_WORLD_SIZE_ENV

    n = emulation.virtual_world_size
    if n is None or PHYSICAL_WORLD_SIZE_ENV in environ:
        return
    p_rank, p_size = int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))
    sandbox = list(emulation.sandbox_ranks) or list(range(p_size))
    environ[PHYSICAL_RANK_ENV], environ[PHYSICAL_WORLD_SIZE_ENV] = str(p_rank), str(p_size)
    environ["RANK"] = str(sandbox[p_rank] if p_rank < len(sandbox) else p_rank)
    environ["WORLD_SIZE"] = str(n)
    environ.setdefault("LOCAL_RANK", "0")
    environ.setdefault("LOCAL_WORLD_SIZE", "1")
    environ.setdefault("MASTER_ADDR", "127.0.0.1")
    environ.setdefault("MASTER_PORT", "29500")


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
    # As `python SCRIPT` would, and before the hooks install: the CPU runtime adapts the script's
    # own Megatron-LM (megatron.legacy) where it is importable.
    sys.path.insert(0, str(path.resolve().parent))
    try:
        inst, prism_tokens, rest = install_from_argv(argv)
    except ConfigError as err:
        print(f"prism-megatron launch: error: {err}", file=sys.stderr)
        return 2
    os.environ[LAUNCH_ENV] = json.dumps(prism_tokens)
    present_virtual_world(inst.cfg.emulation)
    install_mod.set_launched(inst)
    saved = sys.argv
    sys.argv = [str(path), *rest]
    code = 1  # until the script ends without an error: a failed one writes no summary and no graph
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as done:  # sys.exit, or the hooks' stop after emulation.stop_after iterations
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
        install_mod.set_launched(None)
        try:
            if code == 0:
                _write_launch_summary(inst, str(path), split_args(argv)[0].prism_summary_json)
        finally:
            inst.uninstall(complete=code == 0)
    return code


def _write_launch_summary(inst, script: str, path: Optional[str]) -> None:
    """`--prism-summary-json PATH` for a script that does not write one itself (Megatron-LM's
    `pretrain_gpt.py`): what the hooks saw of the rank (its training iterations, each one's wall time
    and the backend's host time in it: hooks/iterations.py), with its peak memory and communication
    counts (`Installation.write_summary`)."""
    if not path or inst.summary_written is not None:
        return
    if inst.session is not None:
        rank, size = inst.session.virtual_rank, inst.session.world_size
    else:  # a plain run (no virtual world): the rank torchrun gave
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    summary = {"script": script, "virtual_world_size": size, "virtual_rank": rank,
               **inst.iterations.figures()}
    inst.write_summary(summary, path)


def main(argv: Optional[list[str]] = None) -> int:
    from prism_megatron import procs

    procs.adopt()  # a torchrun worker of a job this tool started dies with torchrun
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
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "-m", "prism_megatron.launch", *argv]
        return procs.call(cmd)
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
