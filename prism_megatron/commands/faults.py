"""`prism-megatron faults`: inject stragglers, throttling, slow links or host stalls into the replay
and report their impact; or `--fit` the straggler behind a measured log (faults/cli.py)."""

from __future__ import annotations


def add_arguments(cmd) -> None:
    from prism_megatron.faults.cli import add_arguments as faults_arguments

    faults_arguments(cmd)


def run(args) -> int:
    from prism_megatron.faults.cli import run as faults_run

    return faults_run(args)
