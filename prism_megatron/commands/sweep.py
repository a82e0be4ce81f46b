"""`prism-megatron sweep`: capture and simulate every point of a config-override sweep, resumably."""

from __future__ import annotations

from prism_megatron.config import ConfigError
from prism_megatron.config.job import config_file as _config_file


def add_arguments(cmd) -> None:
    cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="Hydra multirun overrides: parallel.tp=2,4,8 parallel.pp=range(1,5) ...")
    cmd.add_argument("-m", "--multirun", action="store_true", help="accepted for Hydra habit")
    cmd.add_argument("--config", default=None,
                     help="YAML config file (default: configs/default.yaml)")
    cmd.add_argument("--out", required=True, help="directory for results.csv and the points")
    cmd.add_argument("--cluster", default="dgx_h100", help="cluster the points are simulated on")
    cmd.add_argument("--jobs", type=int, default=1, help="points at once (local threads)")
    cmd.add_argument("--workers", type=int, default=None, help="capture slices at once per point")
    cmd.add_argument("--json", default=None, help="write the points, ranking and best here too")


def run(args) -> int:
    from prism_megatron.config.loader import check_config_file
    from prism_megatron.sweep.cli import sweep_command

    config_file = args.config if args.script else _config_file(args.config)
    if config_file:  # every point reads it: a broken file is one error, not one skipped point each
        check_config_file(config_file)
    if not args.script:  # a point that does not validate is skipped; a sweep of only those is a typo
        from prism_megatron.config.job import job_config
        from prism_megatron.sweep.run import expand

        errors = []
        for point in expand(list(args.overrides)):
            try:
                job_config(["emulation.sandbox_ranks=[]", *point], config_file, None)
                break
            except ConfigError as err:
                errors.append(err)
        else:
            raise ConfigError(f"none of the sweep's {len(errors)} point(s) is a valid config; the first: "
                              f"{errors[0]}")

    return sweep_command(args)
