"""Fidelity harness: the real job (N processes, plain megatron-core) against its emulation (1 process).

The harness is prism_megatron/validate.py (also `prism-megatron validate`, with the same flags; its
docstring says what it measures); run from here, its results go to benchmarks/results/ and on cuda
with <= 2 ranks it uses the calibration committed there.

    python benchmarks/fidelity.py [--configs ...] [--device cpu|cuda] [--reps 3] [--json PATH] [--list]
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not

from prism_megatron.validate import main  # noqa: E402 - after the path

if __name__ == "__main__":
    sys.exit(main(results_dir=REPO / "benchmarks" / "results"))
