"""Straggler detection in reverse: the fault profile that explains a measured per-rank log.

The log (JSON) holds, per rank, measured series of seconds per iteration:
`{"ranks": {"<rank>": {"iteration_s": [...], "compute_s": [...]}, ...}}`; either series may be left
out, ranks not in the log are not compared. `compute_s` is the rank's busy time (what profilers and
the recorder give: the iteration less its waits); `iteration_s` each rank's own iteration time, from
one of its iteration ends to the next, which the replay's steady-state periods give
(`Simulator.rank_periods`).

The model is one straggler: `slow(r, f)`. For every candidate rank r (the logged ranks, or all ranks
of the world when the log names `"candidates": "all"`), the factor f in [1, `max_factor`] minimizing
the relative squared error between the replay's per-rank figures (sim/des.py with that slowdown) and
the logged medians is found by golden-section search; candidates are ranked by that error. Ranks in
one equivalence class of the faulted replay explain a log equally well when the log cannot tell them
apart (e.g. only iteration times, which synchronous training makes equal on every rank): the result
then lists them together as `ties`, and says so, rather than naming one.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from prism_megatron.faults.spec import FaultError
from prism_megatron.sim.des import Simulator

GOLDEN = (math.sqrt(5) - 1) / 2


def load_log(data: dict, world_size: int) -> dict[int, dict[str, float]]:
    """rank -> metric -> median seconds; raises FaultError on a malformed log."""
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, dict) or not ranks:
        raise FaultError('the log has no "ranks": expected {"ranks": {"0": {"iteration_s": [...], '
                         '"compute_s": [...]}, ...}}')
    out = {}
    for key, series in ranks.items():
        try:
            rank = int(key)
        except ValueError:
            raise FaultError(f"log rank {key!r} is not an integer") from None
        if not 0 <= rank < world_size:
            raise FaultError(f"log rank {rank} is outside the graph's virtual world of {world_size} ranks")
        figures = {}
        for metric in ("iteration_s", "compute_s"):
            values = (series or {}).get(metric)
            if values:
                if not all(isinstance(v, (int, float)) and v >= 0 for v in values):
                    raise FaultError(f"log rank {rank} {metric}: expected a list of seconds >= 0")
                figures[metric] = float(statistics.median(values))
        if figures:
            out[rank] = figures
    if not out:
        raise FaultError("the log has no iteration_s or compute_s series for any rank")
    return out


def predicted(graph: Any, cost: Any, rank: int | None, factor: float) -> tuple[dict, np.ndarray]:
    """Per-rank iteration and compute seconds of the replay with `rank` slowed by `factor`."""
    slowdown = {rank: factor} if rank is not None and factor != 1.0 else {}
    sim = Simulator(graph, cost, slowdown=slowdown)
    result = sim.run()
    iteration = sim.rank_periods(result)
    compute = np.asarray([c.compute_s for c in result.classes])[result.class_of_rank]
    return {"iteration_s": iteration, "compute_s": compute}, result.class_of_rank


def error(figures: dict, log: dict[int, dict[str, float]]) -> float:
    total = 0.0
    for rank, measured in log.items():
        for metric, value in measured.items():
            total += ((float(figures[metric][rank]) - value) / max(value, 1e-12)) ** 2
    return total


def fit_straggler(graph: Any, cost: Any, log: dict[int, dict[str, float]], *, candidates=None,
                  max_factor: float = 4.0, tol: float = 1e-3, top: int = 5) -> dict:
    """The best `slow(rank, factor)` for `log` (see the module docstring)."""
    ranks = sorted(log) if candidates is None else list(candidates)
    baseline, _ = predicted(graph, cost, None, 1.0)
    rows = [{"rank": None, "factor": 1.0, "error": error(baseline, log)}]
    for rank in ranks:
        lo, hi = 1.0, max_factor
        cache: dict[float, float] = {}

        def f(x: float) -> float:
            if x not in cache:
                figures, _ = predicted(graph, cost, rank, x)
                cache[x] = error(figures, log)
            return cache[x]

        a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
        while hi - lo > tol:
            if f(a) <= f(b):
                hi, b = b, a
                a = hi - GOLDEN * (hi - lo)
            else:
                lo, a = a, b
                b = lo + GOLDEN * (hi - lo)
        best = (lo + hi) / 2
        rows.append({"rank": rank, "factor": best, "error": f(best)})
    rows.sort(key=lambda r: r["error"])
    best = rows[0]
    ties = [r["rank"] for r in rows if r["rank"] is not None
            and abs(r["error"] - best["error"]) <= 1e-9 + 1e-6 * best["error"]
            and abs(r["factor"] - best["factor"]) <= 10 * tol]
    return {"fault": None if best["rank"] is None else f"slow({best['rank']}, {best['factor']:.3f})",
            "rank": best["rank"], "factor": best["factor"], "error": best["error"],
            "no_fault_error": rows_no_fault(rows), "ties": ties if len(ties) > 1 else [],
            "identifiable": len(ties) <= 1, "candidates": rows[:top]}


def rows_no_fault(rows: list[dict]) -> float:
    return next(r["error"] for r in rows if r["rank"] is None)
