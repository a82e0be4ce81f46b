"""Where the files the package ships lie: its configs (`configs/`) and example scripts (`examples/`).

They are package data (setup.cfg `package_data`), found through `importlib.resources`, so an installed
package (`pip install .`, not editable) finds them as a checkout does. A checkout's top-level
`configs` and `examples` are links to these folders, so the paths the README and the tests use stay
valid. Known limit: the package must be installed as files (not run from a zip), since the example
scripts run as processes and the native backend compiles its sources where they lie.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

PACKAGE_DIR = Path(str(files("prism_megatron")))
"""The package's own folder (a site-packages folder once installed, the checkout's otherwise)."""

CONFIG_DIR = PACKAGE_DIR / "configs"
"""The shipped configs: `default.yaml` (the built-in default job), presets, `cluster/`, `deepspeed/`."""

EXAMPLE_DIR = PACKAGE_DIR / "examples"
"""The built-in example training scripts (`pretrain_gpt.py`, `deepspeed_train.py`)."""

DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
"""The config commands use without `--config`."""


def package_path(relative: str) -> Path:
    """`relative` (e.g. `configs/deepspeed/zero2.json`) inside the package folder."""
    return PACKAGE_DIR / relative
