"""`prism-megatron emulate`: sandbox ranks run for real, the other ranks replayed from the graph."""

from __future__ import annotations

from typing import Optional

from prism_megatron.config import ConfigError


def add_arguments(cmd) -> None:
    cmd.add_argument("graph", help="graph file written by `capture`")
    cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="cluster=NAME|FILE, cluster.KEY=V, calibration=FILE")
    add_sandbox_arguments(cmd)


def add_sandbox_arguments(cmd) -> None:
    """The options `emulate` and `run` share: the sandboxes, where and how they run, the output."""
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


def check_fault_specs(text: Optional[str]) -> None:
    """`--faults SPEC` read before any work (its ranks are checked against the graph's world later)."""
    from prism_megatron.faults.spec import FaultError, parse_faults

    try:
        parse_faults(text)
    except FaultError as err:
        raise ConfigError(f"--faults: {err}") from None


def run(args) -> int:
    from prism_megatron.emulate.cli import emulate_command

    check_fault_specs(args.faults)
    return emulate_command(args)
