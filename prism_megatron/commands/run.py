"""`prism-megatron run`: capture (if not cached), simulate and emulate a config."""

from __future__ import annotations

from prism_megatron.commands.emulate import add_sandbox_arguments, check_fault_specs


def add_arguments(cmd) -> None:
    cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="config overrides (parallel.tp=2 ...) and cluster=NAME, "
                          "cluster.KEY=V, calibration=FILE")
    cmd.add_argument("--config", default=None,
                     help="YAML config file (default: configs/default.yaml)")
    cmd.add_argument("--workers", type=int, default=None, help="capture slices at once")
    add_sandbox_arguments(cmd)


def run(args) -> int:
    from prism_megatron.emulate.cli import run_command

    check_fault_specs(args.faults)
    return run_command(args)
