"""The subcommands' own modules (`prism-megatron NAME`), one per command: cli.py parses the command
line and hands each its arguments. A command sits above every package it orchestrates (capture,
emulation, the replay, the hooks) and below cli.py only (.importlinter)."""

from __future__ import annotations

OVERRIDES_HELP = "config overrides, e.g. model=tiny_moe parallel.tp=2"


def add_config_arguments(cmd, overrides_help: str = OVERRIDES_HELP) -> None:
    """The options every command that builds a job's config takes: `key=value` overrides and
    `--config FILE` (default: the built-in configs/default.yaml)."""
    cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)
    cmd.add_argument("--config", default=None, help="YAML config file (default: configs/default.yaml)")


def add_executor_arguments(cmd) -> None:
    """Where capture slices run (capture/executors.py): `--executor KIND` and its `--executor-option`s."""
    from prism_megatron.capture.executors import EXECUTORS

    cmd.add_argument("--executor", default="local", metavar="KIND",
                     help=f"what runs the capture's slices: {', '.join(EXECUTORS)} (default: local processes)")
    cmd.add_argument("--executor-option", action="append", default=[], metavar="KEY=VALUE",
                     help="an option of the executor, repeatable: partition=gpu timeout_min=90 "
                          "(submitit), address=auto num_gpus=1 (ray)")


def executor_of(args):
    """The checked ExecutorSpec of `add_executor_arguments`' options (ConfigError if it cannot run here)."""
    from prism_megatron.capture.executors import ExecutorSpec, check_executor

    spec = ExecutorSpec.parse(args.executor, list(args.executor_option))
    check_executor(spec)
    return spec
