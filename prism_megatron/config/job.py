"""The training job a command emulates: the user's own script and its arguments, or a built-in example.

    prism-megatron capture --out DIR [key=value ...] -- pretrain_gpt.py --num-layers 96 ... \\
        --prism-virtual-world-size 8192

A job given after `--` (torchrun's convention) is the script and its arguments exactly as the user
runs them; capture slices and emulation sandboxes run it under `prism-megatron launch`, which
installs the hooks and hands the script its arguments without the `--prism-*` ones. What the
emulator needs to know of the job (its parallel sizes, layers, batch sizes: the virtual world, the
roles and the microbatches of the capture) is read from the script's Megatron-LM flags
(config/flags.py `MEGATRON_FLAGS`), so the script's arguments are the one source of its shape:

- a `key=value` override of a key that has a Megatron flag rewrites that flag in the script's
  arguments (replaced where present; added where absent for a megatron script, since Megatron-LM
  takes every mapped flag), so a sweep of `parallel.tp=2,4,8` sweeps the script's own
  `--tensor-model-parallel-size`; for a DeepSpeed script, whose flags are its own, an absent flag
  stays a config value and the script must agree with it (the capture checks the world it built);
- `--prism-*` flags among the script's arguments configure the emulation, as under `launch`;
- where a Megatron-LM default differs from the config's, the config takes Megatron-LM's: a global
  batch of micro batch x data-parallel size when `--global-batch-size` is absent.

Without a script the job is the built-in example of `train.framework`, driven by the config itself
(one path: it too runs under `launch`). The job travels in the config (`train.script`,
`train.script_args`, `train.workdir`), so a graph's meta names the job it was captured from and
`emulate GRAPH` runs that job again.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from prism_megatron.config.flags import MEGATRON_FLAGS, config_from_args, split_prism_tokens
from prism_megatron.config.schema import ConfigError, PrismConfig, TrainConfig
from prism_megatron.resources import DEFAULT_CONFIG as _SHIPPED_DEFAULT_CONFIG
from prism_megatron.resources import EXAMPLE_DIR

DEFAULT_CONFIG = Path(os.environ.get("PRISM_DEFAULT_CONFIG") or _SHIPPED_DEFAULT_CONFIG)
"""The config used without --config (`PRISM_DEFAULT_CONFIG` names another, as the tests do)."""

EXAMPLE = EXAMPLE_DIR / "pretrain_gpt.py"
DEEPSPEED_EXAMPLE = EXAMPLE_DIR / "deepspeed_train.py"

SCRIPT_ITERATIONS = 3
"""Iterations a capture slice or a sandbox of a user's script runs before the hooks end it, unless
emulation.stop_after says otherwise: the first allocates and warms up, two-pass recording labels one
iteration and times the next, and the last has no end."""


def config_file(arg: Optional[str]) -> Optional[str]:
    """The config file a subcommand reads: `--config`'s argument, else DEFAULT_CONFIG if it exists."""
    if arg is not None:
        return arg
    return str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None


def job_of(args, overrides: Optional[list[str]] = None) -> PrismConfig:
    """The job config of a subcommand: `-- SCRIPT ARGS` when given (with `--config` only if named:
    the built-in default describes the built-in job), else the config file and overrides. The
    capture chooses the ranks it runs, so a config's sandbox ranks are cleared."""
    overrides = list(args.overrides if overrides is None else overrides)
    script = getattr(args, "script", None)
    chosen = args.config if script else config_file(args.config)
    return job_config(["emulation.sandbox_ranks=[]", *overrides], chosen, script)


_FLAG_OF_KEY = {key: flag for flag, key in MEGATRON_FLAGS.items()}
_DTYPE_FLAGS = {"bf16": "--bf16", "fp16": "--fp16"}


def example_for(framework: str) -> Path:
    """The built-in example script of `train.framework`."""
    return DEEPSPEED_EXAMPLE if framework == "deepspeed" else EXAMPLE


@dataclass(frozen=True)
class TrainingJob:
    """A job's script, its arguments and where it runs; `command` starts it under `launch`."""

    script: Path
    args: tuple[str, ...]
    workdir: Path
    builtin: bool

    @classmethod
    def of(cls, t: TrainConfig) -> "TrainingJob":
        """The job of a config's train section."""
        if t.script is None:
            script = example_for(t.framework)
            if not script.is_file():
                raise ConfigError(f"{script} not found: the package was installed without its example "
                                  "scripts; reinstall it (`pip install .` ships them), or give your script after --")
            # the caller's folder, not the package's: relative paths in the config mean what they say
            # where the command runs, and nothing is written inside an installed package
            return cls(script=script, args=(), workdir=Path.cwd(), builtin=True)
        return cls(script=Path(t.script), args=tuple(t.script_args),
                   workdir=Path(t.workdir or Path(t.script).parent), builtin=False)

    def command(self, prism_tokens: Iterable[str], *, nproc: int = 1,
                master_port: Optional[int] = None) -> list[str]:
        """The command line that runs the job with `prism_tokens` (`--prism-*` flags) as `nproc`
        processes (torchrun's launcher when more than one)."""
        launch = ["-m", "prism_megatron.launch", "--", str(self.script), *self.args, *prism_tokens]
        if nproc == 1:
            return [sys.executable, *launch]
        port = ["--master-port", str(master_port)] if master_port else []
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *port, *launch]

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the script's directory on the path, as `python SCRIPT` would have it (Megatron-LM's
        `megatron.training` lies beside `pretrain_gpt.py`)."""
        env = dict(env)
        parts = [str(self.script.parent), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
        return env


def job_config(overrides: Iterable[str] = (), config_file: Optional[str] = None,
               script_tokens: Optional[list[str]] = None, *, cwd: Optional[str] = None) -> PrismConfig:
    """The validated config of the job: `script_tokens` (`SCRIPT ARGS` given after `--`), else the
    script the config names (`train.script`), else the built-in example driven by the config alone.
    `overrides` rewrite the script's flags where they have one (module docstring)."""
    from prism_megatron.config.loader import load_config

    overrides = list(overrides)
    if script_tokens:
        script, args = script_tokens[0], list(script_tokens[1:])
        if script.startswith("-"):
            raise ConfigError(f"{script!r} after --: expected the training script first, then its arguments "
                              "(-- pretrain_gpt.py --num-layers 16 ...)")
        path = Path(cwd or os.getcwd(), script).resolve()
        if not path.is_file():
            raise ConfigError(f"{script} after -- is not a file; give the path of the training script")
        # the framework only (how flags are rewritten); the world is checked once the flags are read
        base = load_config([*(o for o in overrides if not _is_job_key(o)), "emulation.virtual_world_size=null",
                            "emulation.sandbox_ranks=[]"], config_file)
        return _script_config(str(path), args, str(Path(cwd or os.getcwd()).resolve()), base.train.framework,
                              overrides, config_file)
    cfg = load_config(overrides, config_file)
    if cfg.train.script is None:
        return cfg
    script_overrides = [o for o in overrides if not o.startswith(("train.script=", "train.script_args=",
                                                                  "train.workdir="))]
    return _script_config(cfg.train.script, list(cfg.train.script_args), cfg.train.workdir,
                          cfg.train.framework, script_overrides, config_file)


def _is_job_key(override: str) -> bool:
    key = override.partition("=")[0]
    return key in _FLAG_OF_KEY or key == "model.params_dtype"


def _script_config(script: str, args: list[str], workdir: Optional[str], framework: str,
                   overrides: list[str], config_file: Optional[str]) -> PrismConfig:
    known, prism_tokens, rest = split_prism_tokens(args)
    rest, emulation = rewrite_flags(rest, overrides, framework)
    known, _, _ = split_prism_tokens([*rest, *prism_tokens])
    if framework == "megatron" and known.global_batch_size is None and not any(
            o.startswith("train.global_batch_size=") for o in emulation):
        gbs = _megatron_global_batch(known, emulation, config_file)
        if gbs is not None:
            emulation.append(f"train.global_batch_size={gbs}")
    known.prism_override = [*(known.prism_override or []), *emulation]
    cfg = config_from_args(known, config_file)
    cfg.train.script, cfg.train.script_args, cfg.train.workdir = script, list(rest), workdir
    if cfg.emulation.stop_after == 0:
        cfg.emulation.stop_after = min(cfg.train.iters, SCRIPT_ITERATIONS)
    return cfg


def rewrite_flags(args: list[str], overrides: list[str], framework: str) -> tuple[list[str], list[str]]:
    """(the script's arguments with every override of a key that has a Megatron flag applied to
    that flag, the overrides left for the config)."""
    args, left = list(args), []
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "model.params_dtype":
            args = [a for a in args if a not in _DTYPE_FLAGS.values()]
            if value in _DTYPE_FLAGS:
                args.append(_DTYPE_FLAGS[value])
            continue
        flag = _FLAG_OF_KEY.get(key)
        if flag is None:
            left.append(item)
            continue
        present = [i for i, a in enumerate(args) if a == flag or a.startswith(flag + "=")]
        if _is_switch(key):
            on = value.strip().lower() in ("true", "1", "yes")
            args = [a for i, a in enumerate(args) if i not in present]
            if on and (present or framework == "megatron"):
                args.append(flag)
            elif on:
                left.append(item)
            continue
        if _is_list(key):
            args = _drop_flag(args, flag)
            items = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()]
            if framework == "megatron" or present:
                args += [flag, *items] if items else []
            else:
                left.append(item)
            continue
        if not present:
            if framework == "megatron":
                args += [flag, value]
            else:
                left.append(item)
            continue
        for i in reversed(present):
            if "=" in args[i]:
                args[i] = f"{flag}={value}"
            elif i + 1 < len(args):
                args[i + 1] = value
            else:
                args.append(value)
    return args, left


def _kind(key: str):
    from dataclasses import fields

    from prism_megatron.config.schema import SECTIONS

    section, name = key.split(".")
    return next(f.type for f in fields(SECTIONS[section]) if f.name == name)


def _is_switch(key: str) -> bool:
    return _kind(key) in (bool, "bool")


def _is_list(key: str) -> bool:
    return "List" in str(_kind(key))


def _drop_flag(args: list[str], flag: str) -> list[str]:
    """`args` without `flag` and the values after it (up to the next option)."""
    out, i = [], 0
    while i < len(args):
        if args[i] == flag or args[i].startswith(flag + "="):
            i += 1
            while "=" not in args[i - 1] and i < len(args) and not args[i].startswith("-"):
                i += 1
            continue
        out.append(args[i])
        i += 1
    return out


def _megatron_global_batch(known, overrides: list[str], config_file: Optional[str]) -> Optional[int]:
    """Megatron-LM's global batch without `--global-batch-size`: micro batch x data-parallel size."""
    from omegaconf import OmegaConf

    layers = [OmegaConf.load(config_file)] if config_file and os.path.isfile(config_file) else []
    layers.append(OmegaConf.from_dotlist([o for o in overrides if "=" in o]))
    merged = OmegaConf.merge(*layers)
    world = known.prism_virtual_world_size or OmegaConf.select(merged, "emulation.virtual_world_size")
    if not world:
        return None
    tp = known.tensor_model_parallel_size or 1
    pp = known.pipeline_model_parallel_size or 1
    cp = known.context_parallel_size or 1
    mbs = (known.micro_batch_size or OmegaConf.select(merged, "train.micro_batch_size")
           or TrainConfig().micro_batch_size)  # the micro batch the config will hold
    if int(world) % (tp * pp * cp):
        return None  # the config's own check names the mismatch
    return int(mbs) * int(world) // (tp * pp * cp)
