"""`prism-megatron run`: capture (if not cached), simulate and emulate a config."""

from __future__ import annotations

from prism_megatron.commands import add_config_arguments
from prism_megatron.commands.emulate import add_sandbox_arguments, check_fault_specs


def add_arguments(cmd) -> None:
    add_config_arguments(cmd, "config overrides (parallel.tp=2 ...) and cluster=NAME, "
                              "cluster.KEY=V, calibration=FILE")
    cmd.add_argument("--workers", type=int, default=None, help="capture slices at once")
    add_sandbox_arguments(cmd)


def run(args) -> int:
    from prism_megatron.emulate.cli import run_command

    check_fault_specs(args.faults)
    return run_command(args)
