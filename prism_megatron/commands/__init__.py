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
