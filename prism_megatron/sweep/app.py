"""`prism-megatron sweep` as a Hydra multirun application.

The app's primary config (`prism_sweep`, in Hydra's ConfigStore) is the prism config's sections with
their defaults (so `parallel.tp=2,4` overrides a key Hydra knows), the model presets as the config
group `model` (`model=tiny`, `model=glob(llama*)`), and a `sweep:` section (evaluate.SweepSettings:
the output folder, the cluster, the config file, the script). Its defaults choose
`hydra/launcher=joblib` and `hydra/sweeper=prism` (sweeper.py); any Hydra override changes them:
`hydra/launcher=submitit_slurm hydra.launcher.partition=gpu`, `hydra/launcher=submitit_local`,
`hydra/launcher=ray`, `hydra.launcher.n_jobs=4`, `hydra.sweeper.search=optuna`.

Every job's folder is `<out>/points/<id>/` (Hydra's `.hydra/` record of the job's config and its
log there too); the job (`run_point`, in the launcher's process) evaluates the point and writes its
row there (evaluate.py). Jobs on other machines (SLURM) need `<out>` on a filesystem they share.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from prism_megatron.sweep.evaluate import SweepSettings, evaluate, finished, read_row, write_row

CONFIG_NAME = "prism_sweep"


def _register(settings: SweepSettings) -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from prism_megatron.config.loader import MODEL_PRESETS
    from prism_megatron.config.schema import PrismConfig
    from prism_megatron.sweep.sweeper import PrismSweeperConf

    store = ConfigStore.instance()
    sections = OmegaConf.to_container(OmegaConf.structured(PrismConfig), enum_to_str=True)
    out = str(Path(settings.out).resolve())
    node = {"defaults": ["_self_", {"model": None}, {"override hydra/launcher": "joblib"},
                         {"override hydra/sweeper": "prism"}],
            **sections,
            "sweep": {**asdict(settings), "out": out, "point": "", "parent": os.getpid()},
            "hydra": {"job": {"chdir": False, "name": "point"},
                      "job_logging": {"root": {"level": "WARNING"}},
                      "sweep": {"dir": str(Path(out, "points")), "subdir": "${sweep.point}"},
                      "launcher": {}}}
    store.store(name=CONFIG_NAME, node=node)
    for name, preset in MODEL_PRESETS.items():
        store.store(group="model", name=name, node=OmegaConf.to_container(OmegaConf.structured(preset)))
    store.store(group="hydra/sweeper", name="prism", node=PrismSweeperConf)
    # Hydra finds plugins by walking `hydra_plugins`' path, which an editable install's import hook
    # (setuptools' finder for `pip install -e`) does not list: registered by hand, as Hydra documents
    from hydra.core.plugins import Plugins
    from hydra_plugins.prism_megatron_sweeper import PrismSweeper

    Plugins.instance().register(PrismSweeper)


def multirun(settings: SweepSettings, overrides: list[str]):
    """Run the sweep of `overrides` (points' and Hydra's) through Hydra; the sweeper's results.Table."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    _register(settings)
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="prism_sweep",
                                     config_search_path=create_config_search_path(None))
    try:
        return hydra.multirun(config_name=CONFIG_NAME, task_function=run_point, overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def run_point(cfg) -> dict:
    """One Hydra job: the point of `sweep.point`, evaluated in this process; its row (evaluate.py)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    import warnings

    from prism_megatron import procs

    # megatron-core warns on import that TE/Apex are absent; the local fallbacks are what we use
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    if os.getpid() != cfg.sweep.parent:  # a launcher's process: it dies with the sweep, as its slices do
        procs.die_with_parent()
    try:
        procs.guard()
    except ValueError:  # not this process's main thread (a threads launcher): the sweep's own guard holds
        pass
    given = OmegaConf.to_container(cfg.sweep, resolve=True)
    settings = SweepSettings(**{k: v for k, v in given.items() if k in SweepSettings.__dataclass_fields__})
    out, pid = Path(settings.out), str(cfg.sweep.point)
    done = read_row(out, pid)
    if finished(done):  # finished by an earlier run (a basic sweeper reruns every job)
        return asdict(done)
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("sweep.")]
    row = evaluate(settings, pid, overrides)
    write_row(out, row)
    return asdict(row)
