"""`prism-megatron faults GRAPH --inject SPEC` (impact) and `--fit LOG` (straggler detection)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from prism_megatron.config.schema import ConfigError
from prism_megatron.faults.spec import EXAMPLE, FaultError, FaultSet
from prism_megatron.util import atomic_write_text


def add_arguments(cmd) -> None:
    cmd.add_argument("graph", help="graph file written by `capture`")
    cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="cluster=NAME|FILE, cluster.KEY=V, calibration=FILE")
    cmd.add_argument("--inject", default=None, help=f"fault specs separated by ';', e.g. \"{EXAMPLE}\"")
    cmd.add_argument("--iterations", type=int, default=20,
                     help="iterations replayed for time-varying faults (throttle, periodic, stall)")
    cmd.add_argument("--fit", default=None, metavar="LOG",
                     help='find the straggler that explains a measured log: JSON {"ranks": {"0": '
                          '{"iteration_s": [...], "compute_s": [...]}}}')
    cmd.add_argument("--candidates", choices=("logged", "all"), default="logged",
                     help="ranks --fit tries: those in the log, or every rank of the world")
    cmd.add_argument("--heatmap", default=None, help="PNG of the added waiting time per rank")
    cmd.add_argument("--json", default=None, help="write the report here")


def run(args) -> int:
    from prism_megatron.graph import load_graph
    from prism_megatron.sim.report import emulation_cluster

    if (args.inject is None) == (args.fit is None):
        raise ConfigError(f"faults: give --inject SPEC (the impact of faults, e.g. \"{EXAMPLE}\") or --fit "
                          "LOG (the straggler that explains a measured log), one of the two")
    if args.iterations < 1:
        raise ConfigError(f"--iterations {args.iterations}: expected >= 1")
    cluster, calibration = emulation_cluster(args.overrides)
    graph = load_graph(args.graph)
    cost = cluster.cost_model(calibration)
    try:
        report = _fit(graph, cost, args) if args.fit else _impact(graph, cost, args)
    except FaultError as err:
        raise ConfigError(str(err)) from None
    report["cluster"] = cluster.name
    if args.json:
        atomic_write_text(args.json, json.dumps(report, indent=1, default=_jsonable))
    return 0


def _impact(graph, cost, args) -> dict:
    from prism_megatron.faults.impact import heatmap, impact

    world = graph.world
    faults = FaultSet.parse(args.inject, world.world_size, world.gpus_per_node)
    if not faults.faults:
        raise FaultError(f"--inject {args.inject!r} names no fault; e.g. \"{EXAMPLE}\"")
    report = impact(graph, cost, faults, args.iterations)
    base, worst = report["iteration_s_without"], report["iteration_s_with_worst"]
    print(f"N={world.world_size}, {report['faulted_ranks']} ranks faulted; classes "
          f"{report['classes_without']} -> {report['classes_with']}")
    print(f"iteration {base * 1e3:.3f} ms without, {report['iteration_s_with_mean'] * 1e3:.3f} ms with "
          f"(mean of {report['iterations']}; worst {worst * 1e3:.3f} ms): x{report['slowdown']:.4f}")
    for row in report["waiting"][:5]:
        print(f"  {row['ranks']} ranks wait {row['added_wait_s'] * 1e3:+.3f} ms longer (e.g. rank "
              f"{row['first_ranks'][0]}: {row['coords_of_first']})")
    for when in ("without", "with"):
        top = report[f"critical_path_{when}"][:3]
        print(f"critical path {when}: " + ", ".join(f"rank {r['representative']} {r['share'] * 100:.0f}%"
                                                      for r in top))
    print(f"  of it through faulted ranks: {report['critical_path_through_faulted_s'] * 1e3:.3f} ms")
    if args.heatmap:
        from prism_megatron.moe.pictures import heatmap_png

        g = world.gpus_per_node
        width = g * max(1, round(world.world_size ** 0.5 / g))  # near square, whole nodes per row
        heatmap_png(args.heatmap, heatmap(report["per_rank"]["added_wait_s"], width))
        report["heatmap"] = {"path": args.heatmap, "width": width,
                             "layout": "rank r at row r // width, column r % width"}
        print(f"heatmap of the added waiting time: {args.heatmap} ({width} ranks per row)")
    return report


def _fit(graph, cost, args) -> dict:
    from prism_megatron.faults.fit import fit_straggler, load_log

    try:
        data = json.loads(Path(args.fit).read_text())
    except (OSError, ValueError) as err:
        raise FaultError(f"--fit {args.fit}: not a readable JSON log ({err})") from None
    world = graph.world
    log = load_log(data, world.world_size)
    candidates = range(world.world_size) if args.candidates == "all" else None
    result = fit_straggler(graph, cost, log, candidates=candidates)
    if result["rank"] is None:
        print(f"no straggler explains the log better than none (error {result['error']:.3g})")
    elif result["ties"]:
        print(f"a straggler slowed x{result['factor']:.3f} explains the log, but the log cannot tell which "
              f"of ranks {result['ties'][:8]} it is (log each rank's compute_s to tell them apart)")
    else:
        print(f"{result['fault']} explains the log (error {result['error']:.3g}; without a fault "
              f"{result['no_fault_error']:.3g})")
    return result


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
