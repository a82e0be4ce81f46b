"""A fault's impact at scale: the job with and without it, who waits, where the critical path goes.

`impact` replays the graph (sim/des.py) once clean and once per distinct perturbation of the
iterations asked for (time-varying faults give one per iteration at most; equal ones are replayed
once), and reports:

- the iteration time without and with the faults (per iteration, mean and worst), and the ratio;
- waiting per rank: the time a rank spends in the iteration without computing (exposed
  communication, pipeline bubble, waits for peers), with minus without the faults, in the worst
  iteration; listed by amount (how many ranks wait how much longer, the first of them);
- the critical path's share per class before and after: which ranks set the pace, and whether the
  faulted ones now do;
- per rank, the added waiting time and the compute factor as arrays, for a heatmap
  (`heatmap_png`: rank r at row r // width, column r % width).

Pure logic over the graph and the cost model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prism_megatron.faults.spec import FaultSet, Perturbation
from prism_megatron.sim.des import SimResult, Simulator


def replay(graph: Any, cost: Any, perturbation: Perturbation | None = None) -> SimResult:
    p = perturbation or Perturbation()
    return Simulator(graph, cost, slowdown=p.compute, link_slowdown=p.link, start_s=p.start_s).run()


def job_time(result: SimResult, perturbation: Perturbation) -> float:
    """From the earliest start to the last end (a stalled rank counts its own time from its start)."""
    starts = [perturbation.start_s.get(c.representative, 0.0) for c in result.classes]
    return max(c.iteration_s + t for c, t in zip(result.classes, starts)) - min(starts)


def rank_waits(result: SimResult, job_s: float, perturbation: Perturbation) -> np.ndarray:
    """Per rank: seconds of the iteration not spent computing."""
    waits = np.asarray([job_s - perturbation.start_s.get(c.representative, 0.0) - c.compute_s
                        for c in result.classes])
    return waits[result.class_of_rank]


def path_share(result: SimResult) -> dict[int, float]:
    """Seconds of the critical path per class representative."""
    share: dict[int, float] = {}
    for c, _, start, end in result.critical_path:
        rep = result.classes[c].representative
        share[rep] = share.get(rep, 0.0) + max(0.0, end - start)
    return share


def impact(graph: Any, cost: Any, faults: FaultSet, iterations: int = 1, top: int = 8) -> dict:
    """The report described in the module docstring (a JSON-able dict; arrays under `per_rank`)."""
    world = graph.world
    clean = Perturbation()
    base = replay(graph, cost)
    base_s = job_time(base, clean)
    runs: dict[tuple, tuple[SimResult, Perturbation, float]] = {}  # key -> (replay, perturbation, s)
    times, t = [], 0.0
    for i in range(max(1, iterations if faults.time_varying else 1)):
        p = faults.at(i, t)
        if p.key() not in runs:
            result = replay(graph, cost, p) if p else base
            runs[p.key()] = (result, p, job_time(result, p))
        times.append(runs[p.key()][2])
        t += times[-1]
    worst, worst_p, worst_s = max(runs.values(), key=lambda run: run[2])
    added = rank_waits(worst, worst_s, worst_p) - rank_waits(base, base_s, clean)
    compute = np.ones(world.world_size)
    for rank, factor in worst_p.compute.items():
        compute[rank] = factor
    levels: dict[float, list[int]] = {}  # who waits how much longer, grouped by the amount (1 us)
    for rank in np.nonzero(added > 1e-9)[0].tolist():
        levels.setdefault(round(float(added[rank]), 6), []).append(rank)
    waiting = [{"added_wait_s": amount, "ranks": len(ranks), "first_ranks": ranks[:8],
                "coords_of_first": _coords(world, ranks[0])}
               for amount, ranks in sorted(levels.items(), key=lambda kv: -kv[0])[:top]]
    before, after = path_share(base), path_share(worst)
    faulted = set(faults.affected())
    on_path = {r: s for r, s in after.items()
               if faulted & set(np.nonzero(worst.class_of_rank == worst.class_of_rank[r])[0].tolist())}
    return {
        "ranks": world.world_size, "faults": [f.__dict__ for f in faults.faults],
        "faulted_ranks": len(faulted), "iterations": len(times),
        "iteration_s_without": base_s, "iteration_s_with": times,
        "iteration_s_with_mean": float(np.mean(times)), "iteration_s_with_worst": worst_s,
        "slowdown": float(np.mean(times)) / base_s if base_s > 0 else float("nan"),
        "classes_without": len(base.classes), "classes_with": len(worst.classes),
        "waiting": waiting, "max_added_wait_s": float(added.max()),
        "ranks_waiting_longer": int(np.count_nonzero(added > 1e-9)),
        "critical_path_without": _top(before, world, top), "critical_path_with": _top(after, world, top),
        "critical_path_through_faulted_s": float(sum(on_path.values())),
        "per_rank": {"added_wait_s": added, "compute_factor": compute},
    }


def _top(share: dict[int, float], world: Any, top: int) -> list[dict]:
    total = sum(share.values()) or 1.0
    rows = sorted(share.items(), key=lambda kv: -kv[1])[:top]
    return [{"representative": r, "seconds": s, "share": s / total, "coords": _coords(world, r)}
            for r, s in rows]


def _coords(world: Any, rank: int) -> dict:
    out = {k: int(v) for k, v in world.coords(rank).items()}
    out["node"] = int(world.node(rank))
    return out


def heatmap(values: np.ndarray, width: int) -> np.ndarray:
    """Per-rank values as a 2-D array, rank r at (r // width, r % width); the tail padded with 0."""
    n = len(values)
    rows = -(-n // width)
    grid = np.zeros(rows * width)
    grid[:n] = values
    return grid.reshape(rows, width)
