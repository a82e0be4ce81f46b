"""`prism-megatron sweep`: capture and simulate every point of a config-override sweep, resumably
(a Hydra multirun application: sweep/cli.py)."""

from __future__ import annotations

from prism_megatron.commands import add_config_arguments, add_executor_arguments


def add_arguments(cmd) -> None:
    add_config_arguments(cmd, "Hydra multirun overrides: parallel.tp=2,4,8 parallel.pp=range(1,5) ...; "
                              "and Hydra's own: hydra/launcher=submitit_slurm hydra.sweeper.search=optuna")
    cmd.add_argument("-m", "--multirun", action="store_true", help="accepted for Hydra habit")
    cmd.add_argument("--out", required=True, help="directory for results.csv and the points")
    cmd.add_argument("--cluster", default="dgx_h100", help="cluster the points are simulated on")
    cmd.add_argument("--jobs", type=int, default=1, help="points at once (the joblib launcher's n_jobs)")
    cmd.add_argument("--workers", type=int, default=None, help="capture slices at once per point")
    add_executor_arguments(cmd)
    cmd.add_argument("--json", default=None, help="write the points, ranking and best here too")


def run(args) -> int:
    from prism_megatron.sweep.cli import sweep_command

    return sweep_command(args)
