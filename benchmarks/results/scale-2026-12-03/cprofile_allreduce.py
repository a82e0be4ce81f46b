"""cProfile of benchmarks/backend_instructions.py's workload: synchronous all-reduces through the prism
backend (group of 8, one real member, recorder timed), profiled only inside the calls (the same
`functools.reduce` toggle callgrind uses). Prints the Python and C calls per operation and the
functions by own time. Profiling inflates every call alike; read the counts, not the seconds.

    python benchmarks/results/scale-2026-12-03/cprofile_allreduce.py [CALLS]
"""

from __future__ import annotations

import cProfile
import functools
import os
import pstats
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

import megatron.core  # noqa: E402,F401 - imported before reduce is replaced (dynamo checks its signature)
import torch._dynamo  # noqa: E402,F401

import backend_instructions  # noqa: E402


def main() -> int:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    profile = cProfile.Profile()
    reduce = functools.reduce

    def profiled(*args):
        profile.enable()
        try:
            return reduce(*args)
        finally:
            profile.disable()

    functools.reduce = profiled
    try:
        backend_instructions.workload(calls, 8)
    finally:
        functools.reduce = reduce
    stats = pstats.Stats(profile)
    total = sum(entry[1] for entry in stats.stats.values())
    print(f"python and C calls per operation: {total / calls:.1f}")
    stats.sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
