"""Test-wide settings.

The built-in default config (configs/default.yaml) is a GPT-175B rank that a CPU runs only under fake
execution. Tests that run a command without `--config` get the same 8192-rank world with tiny layers
instead (configs/tiny_8192.yaml), which runs for real in seconds; subprocesses inherit this."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("PRISM_DEFAULT_CONFIG", str(Path(__file__).resolve().parents[1] / "configs" /
                                                  "tiny_8192.yaml"))
