"""`prism-megatron sweep [-m] [overrides] [hydra overrides] --out DIR [-- SCRIPT ARGS]` (app.py).

Everything a sweep reads is checked before any job starts; a mistake is one line and exit 2: a bad
`--jobs`/`--workers`, an unknown cluster, a broken config file, an override outside Hydra's grammar,
a sweep none of whose points is a valid config (an unknown key, a layout that cannot divide), a
launcher or sweeper setting Hydra refuses.
"""

from __future__ import annotations

from pathlib import Path

from prism_megatron.config.schema import ConfigError
from prism_megatron.util import atomic_write_text


def sweep_command(args) -> int:
    import os

    from prism_megatron.capture.executors import ExecutorSpec, check_executor
    from prism_megatron.config.job import config_file as config_file_of
    from prism_megatron.config.loader import MODEL_PRESETS, check_config_file
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.sweep.evaluate import SweepSettings, point_config
    from prism_megatron.sweep.points import parse_space, split_hydra
    from prism_megatron.sweep.results import plot_frontier, print_ranking, summary_json

    if args.jobs < 1 or (args.workers is not None and args.workers < 1):
        raise ConfigError(f"--jobs {args.jobs} / --workers {args.workers}: expected 1 or more")
    # where the points' captures run their slices: checked before any job
    check_executor(ExecutorSpec.parse(args.executor, list(args.executor_option)))
    cluster = load_cluster(args.cluster)  # fail fast on a bad cluster name
    config_file = args.config if args.script else config_file_of(args.config)
    if config_file:  # every point reads it: a broken file is one error, not one skipped point each
        check_config_file(config_file)
    mine, hydra = split_hydra(list(args.overrides))
    space = parse_space(mine, sorted(MODEL_PRESETS))
    settings = SweepSettings(out=str(args.out), cluster=args.cluster, config_file=config_file,
                             script=args.script, workers=args.workers, cwd=os.getcwd(),
                             executor=args.executor, executor_options=list(args.executor_option))
    if not args.script:  # a point that does not validate is skipped; a sweep of only those is a typo
        errors = []
        for point in space.points():
            try:
                point_config(settings, point)
                break
            except ConfigError as err:
                errors.append(err)
        else:
            raise ConfigError(f"none of the sweep's {len(errors)} point(s) is a valid config; the first: "
                              f"{errors[0]}")
    table = _run(settings, mine, _with_jobs(hydra, args.jobs))
    out = Path(args.out)
    print_ranking(table, out)
    if table.ranked():
        plot_frontier(out / "frontier.png", table.rows, cluster.gpu_memory_bytes)
    atomic_write_text(str(out / "summary.json"), summary_json(table))
    if args.json:
        atomic_write_text(args.json, summary_json(table))
    return 0


def _with_jobs(hydra: list[str], jobs: int) -> list[str]:
    """`--jobs N`: the joblib launcher's n_jobs (points at once, each its own process when N > 1)."""
    launcher = [o.partition("=")[2] for o in hydra if o.lstrip("+").startswith("hydra/launcher=")]
    if (not launcher or launcher[-1] == "joblib") and not any(o.startswith("hydra.launcher.n_jobs=")
                                                               for o in hydra):
        return [*hydra, f"hydra.launcher.n_jobs={jobs}"]
    return hydra


def _run(settings, mine: list[str], hydra: list[str]):
    """The Hydra multirun; what Hydra refuses (a launcher it does not know, a setting of the wrong
    type) as one ConfigError line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from prism_megatron.sweep.app import multirun

    try:
        return multirun(settings, [*mine, *hydra])
    except (HydraException, OmegaConfBaseException) as err:
        if isinstance(err.__cause__, ConfigError):  # the sweeper's own settings
            raise err.__cause__ from None
        text = str(err) + (f"\n{err.__cause__}" if err.__cause__ else "")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if any(line.startswith("Available options") for line in lines):
            at = next(i for i, line in enumerate(lines) if line.startswith("Available options"))
            options = [o for o in lines[at + 1:] if not o.endswith(":") and "=" not in o]
            options = options[:options.index("Config search path:")] if "Config search path:" in options else options
            reason = f"{lines[0]}; the options: {', '.join(options)}"
            if "hydra/launcher/" in lines[0]:
                reason += " (another launcher needs its Hydra plugin: pip install hydra-ray-launcher for ray)"
        else:
            reason = "; ".join(lines[:2]) or type(err).__name__
        given = " ".join(o for o in hydra if not o.startswith("hydra.launcher.n_jobs=")) or "the sweep"
        raise ConfigError(f"sweep: Hydra refused {given}: {reason}") from None
