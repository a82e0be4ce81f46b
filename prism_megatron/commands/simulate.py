"""`prism-megatron simulate`: replay a captured graph over all N ranks on a modelled cluster."""

from __future__ import annotations


def add_arguments(cmd) -> None:
    cmd.add_argument("graph", help="graph file written by `capture`")
    cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="cluster=dgx_h100|dgx_a100|h200x2|cpu_host|FILE, cluster.nic_Gbps=200, "
                          "slowdown.4711=1.5, calibration=FILE, microbatches=64")
    cmd.add_argument("--json", default=None, help="write the summary and per-class figures here")
    cmd.add_argument("--csv", default=None, help="write one row per rank here")
    cmd.add_argument("--perfetto", default=None, help="write the simulated timeline of --ranks")
    cmd.add_argument("--ranks", default="0", help="ranks for --perfetto, e.g. 0,4711")


def run(args) -> int:
    from prism_megatron.sim.cli import simulate_command

    return simulate_command(args)
