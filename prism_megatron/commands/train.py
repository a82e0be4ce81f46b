"""`prism-megatron train`: run examples/pretrain_gpt.py as one rank of the virtual world."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

from prism_megatron import resources
from prism_megatron.commands import add_config_arguments
from prism_megatron.config import ConfigError, load_config, to_yaml
from prism_megatron.config.job import config_file as _config_file


def add_arguments(cmd) -> None:
    add_config_arguments(cmd)
    cmd.add_argument("--json", default=None, help="write the run summary JSON here (default: "
                     "runs/train-<config>-<hash>/summary.json)")


def run(args) -> int:
    example = resources.EXAMPLE_DIR / "pretrain_gpt.py"
    if not example.is_file():
        raise ConfigError(f"{example} not found: the package was installed without its example "
                          "scripts; reinstall it (`pip install .` ships them)")
    from prism_megatron.hooks.fake import check_execution

    check_execution(load_config(args.overrides, _config_file(args.config)))  # fail fast, before megatron
    spec = importlib.util.spec_from_file_location("pretrain_gpt", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--prism-override", *args.overrides]
    config_file = _config_file(args.config)
    if config_file:
        argv += ["--prism-config", config_file]
    argv += ["--prism-summary-json", args.json or summary_path(args.overrides, config_file)]
    return module.main(argv)


def summary_path(overrides: list[str], config_file: Optional[str]) -> str:
    """Where `train` writes its summary without `--json`: `runs/train-<config>-<hash>/summary.json`
    under the current folder, the hash of the resolved config, so that another job never overwrites
    it and the same job does."""
    import hashlib

    text = to_yaml(load_config(overrides, config_file))
    name = Path(config_file).stem if config_file else "schema-defaults"
    return str(Path("runs", f"train-{name}-{hashlib.sha1(text.encode()).hexdigest()[:8]}", "summary.json"))
