"""`prism-megatron simulate`: the command around the DES (`sim/des.py`), its what-ifs and its outputs."""

from __future__ import annotations

import json

from prism_megatron.config import ConfigError
from prism_megatron.util import atomic_write_text


def parse_ranks(text: str) -> list[int]:
    """`--ranks 0,4711` as a list of virtual ranks."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--ranks {text!r}: expected comma-separated virtual ranks, e.g. 0,4711") from None


def simulate_command(args) -> int:
    """`prism-megatron simulate GRAPH [what-ifs]`: replay all N ranks of a graph in the DES and print
    (and write) the job's iteration time, tokens/s/GPU, MFU, per-stage memory and per-class figures."""
    from prism_megatron.graph import load_graph
    from prism_megatron.graph.perfetto import write_chrome_trace
    from prism_megatron.sim.cluster import load_calibration, load_cluster
    from prism_megatron.sim.des import Simulator
    from prism_megatron.sim.report import job_figures, memory_by_stage, parse_overrides
    from prism_megatron.sim.reschedule import RescheduleError, with_microbatches

    what_if = parse_overrides(args.overrides)
    slowdown, calibration_path = what_if.slowdown, what_if.calibration
    cluster = load_cluster(what_if.cluster or "dgx_h100", what_if.cluster_fields)
    calibration = load_calibration(calibration_path)
    ranks = parse_ranks(args.ranks) if args.perfetto else []
    graph = load_graph(args.graph)
    world = graph.world
    if what_if.microbatches is not None:
        try:
            graph = with_microbatches(graph, what_if.microbatches)
        except RescheduleError as err:
            raise ConfigError(f"microbatches={what_if.microbatches}: {err}") from None
    bad = [r for r in [*ranks, *slowdown] if not 0 <= r < world.world_size]
    if bad:
        raise ConfigError(f"ranks {bad} outside the virtual world of {world.world_size}; choose ranks "
                          f"in 0..{world.world_size - 1}")
    result = Simulator(graph, cluster.cost_model(calibration), slowdown=slowdown).run(tuple(ranks))
    figures = job_figures(result.iteration_s, world.world_size, str(graph.meta.get("config", "")),
                          cluster)
    summary = {**figures, "ranks": world.world_size, "classes": len(result.classes),
               "sim_wall_s": round(result.sim_wall_s, 4), "cluster": cluster.name,
               "calibration": calibration_path, "slowdown": {str(k): v for k, v in slowdown.items()},
               "microbatches": graph.meta.get("microbatches"),
               "compute_durations_from": graph.meta.get("device", "?"),
               "per_class": [dict(c.__dict__) for c in result.classes],
               "critical_path": critical_summary(result.critical_path)}
    print(f"N={world.world_size} ranks as {len(result.classes)} classes on {cluster.name} "
          f"(compute durations captured on {summary['compute_durations_from']}); simulated in "
          f"{result.sim_wall_s:.3f} s")
    mb = graph.meta.get("microbatches")
    if isinstance(mb, dict):  # rewritten by `microbatches=M` (an int: as captured)
        print(f"microbatches: {mb['simulated']} per iteration (captured with {mb['captured']}; the steady "
              "1F1B unit repeated or removed)")
    print(f"iteration time {result.iteration_s * 1e3:.3f} ms | {figures['tokens_per_s_per_gpu']:.1f} "
          f"tokens/s/GPU | MFU {figures['mfu'] * 100:.2f}%")
    summary["memory"] = memory_by_stage(graph, cluster.gpu_memory_bytes)
    for row in summary["memory"]["stages"]:
        print(f"  stage {row['pp']:>3}: peak allocated {row['peak_allocated_bytes'] / 2**30:8.2f} GiB, "
              f"reserved {row['peak_reserved_bytes'] / 2**30:8.2f} GiB ({row['source']})")
    m = summary["memory"]
    print(f"peak memory per rank: {m['max_reserved_bytes'] / 2**30:.2f} GiB reserved at most (stage "
          f"{m['max_stage']}) of {cluster.gpu_memory_bytes / 2**30:.1f} GiB: {'OOM' if m['oom'] else 'fits'}")
    slowest = max(result.classes, key=lambda c: c.iteration_s)
    print(f"slowest class (rank {slowest.representative}, {slowest.members} ranks): compute "
          f"{slowest.compute_s * 1e3:.3f} ms, exposed comm {slowest.exposed_comm_s * 1e3:.3f} ms, "
          f"bubble {slowest.bubble_s * 1e3:.3f} ms")
    if args.json:
        atomic_write_text(args.json, json.dumps(summary, indent=1))
    if args.csv:
        rows = ["rank,class,iteration_s,compute_s,exposed_comm_s,bubble_s"]
        for rank, c in enumerate(result.class_of_rank.tolist()):
            k = result.classes[c]
            rows.append(f"{rank},{c},{k.iteration_s:.9g},{k.compute_s:.9g},{k.exposed_comm_s:.9g},"
                        f"{k.bubble_s:.9g}")
        atomic_write_text(args.csv, "\n".join(rows) + "\n")
    if args.perfetto:
        write_chrome_trace(graph, ranks, args.perfetto, times=result.timelines, source="simulated")
    return 0


def critical_summary(path: list) -> dict:
    """Time on the critical path by kind of node, and its length."""
    share: dict[str, float] = {}
    for _, name, start, end in path:
        kind = "comm" if name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                  "all_to_all", "send", "recv", "barrier") else "compute"
        share[kind] = share.get(kind, 0.0) + max(0.0, end - start)
    return {"nodes": len(path), "seconds_by_kind": share}
