"""`prism-megatron moe-check`: every EP rank's peak memory under an imbalance model, against capacity.

1. Load (pure): from the imbalance model, the tokens each rank's local experts receive, summed over
   the sources of its TP x EP group, per MoE layer of its pipeline stage and microbatch of the
   recorded iteration; a rank's load is the largest per-microbatch sum over its layers (the tokens
   whose expert activations are alive together at a forward's end).
2. Memory model, per pipeline stage: peak = base + bytes_per_token x load. Two sandbox runs of the
   stage, its most and least loaded ranks, fix the two numbers (one run, and no slope, when all of the
   stage's ranks carry the same load); the summary states the form and the fit.
3. Prediction for all N ranks, against the capacity (the cluster's GPU memory, or `--capacity`):
   the ranks that would run out of memory and every rank's margin. The hottest rank's sandbox
   measurement is the confirmation (`confirmed`); a real OOM there is reported as the finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from prism_megatron.config.schema import PrismConfig
from prism_megatron.moe.imbalance import Imbalance
from prism_megatron.world import VirtualWorld


@dataclass
class StageFit:
    """peak = base_bytes + bytes_per_token * load, from sandbox runs of this stage's ranks."""

    stage: int
    base_bytes: float
    bytes_per_token: float
    measured: dict[int, int] = field(default_factory=dict)
    """Virtual rank -> its sandbox-measured peak bytes."""


def rank_loads(cfg: PrismConfig, world: VirtualWorld) -> np.ndarray:
    """Tokens per rank's local experts, per the imbalance model (see the module docstring)."""
    model: Imbalance = cfg.moe.model()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    experts, topk, ep = int(m.num_experts), int(m.moe_router_topk), p.ep
    local = experts // ep
    tokens = t.micro_batch_size * m.seq_length // (p.tp if p.sequence_parallel else 1) // p.cp
    microbatches = t.global_batch_size // (t.micro_batch_size * world.dp)
    iteration = max(0, t.iters - 2) if t.iters >= 2 else 0  # the recorded (last full) iteration
    per_stage = m.num_layers // p.pp
    cache: dict[tuple, np.ndarray] = {}

    def counts(layer: int, mb: int, source: int) -> np.ndarray:
        key = (layer, mb, source) if model.kind in ("uniform", "dirichlet") else (layer, mb)
        if key not in cache:
            cache[key] = model.counts(experts=experts, tokens=tokens, topk=topk, layer=layer,
                                      microbatch=mb, iteration=iteration, source=source)
        return cache[key]

    loads = np.zeros(world.world_size, dtype=np.int64)
    dim = "tp_ep" if p.tp > 1 else "ep"
    for rank in range(world.world_size):
        c = world.coords(rank)
        first = c["pp"] * per_stage + 1
        sources = world.group(rank, dim) if ep > 1 or p.tp > 1 else (rank,)
        lo = c["ep"] * local
        best = 0
        for mb in range(microbatches):
            total = 0
            for layer in range(first, first + per_stage):
                total += int(sum(counts(layer, mb, s)[lo:lo + local].sum() for s in sources))
            best = max(best, total)
        loads[rank] = best
    return loads


def calibration_ranks(world: VirtualWorld, loads: np.ndarray) -> dict[int, list[int]]:
    """Per pipeline stage: its most and least loaded ranks (one when all carry the same load)."""
    out = {}
    stages = np.asarray([world.coords(r)["pp"] for r in range(world.world_size)])
    for stage in sorted(set(stages.tolist())):
        ranks = np.nonzero(stages == stage)[0]
        hot = int(ranks[np.argmax(loads[ranks])])
        cold = int(ranks[np.argmin(loads[ranks])])
        out[stage] = [hot] if loads[hot] == loads[cold] else [hot, cold]
    return out


def fit(stage: int, loads: np.ndarray, measured: dict[int, int]) -> StageFit:
    ranks = list(measured)
    if len(ranks) == 1 or loads[ranks[0]] == loads[ranks[-1]]:
        return StageFit(stage, float(measured[ranks[0]]), 0.0, dict(measured))
    (a, b) = ranks[:2]
    slope = (measured[a] - measured[b]) / float(loads[a] - loads[b])
    return StageFit(stage, measured[a] - slope * float(loads[a]), slope, dict(measured))


def predict(world: VirtualWorld, loads: np.ndarray, fits: dict[int, StageFit]) -> np.ndarray:
    stages = [world.coords(r)["pp"] for r in range(world.world_size)]
    return np.asarray([round(fits[s].base_bytes + fits[s].bytes_per_token * float(loads[r]))
                       for r, s in enumerate(stages)], dtype=np.int64)


def report(world: VirtualWorld, loads: np.ndarray, peaks: np.ndarray, fits: dict[int, StageFit],
           capacity: int, imbalance: str, confirmed: Optional[dict]) -> dict:
    oom = np.nonzero(peaks > capacity)[0].tolist()
    hottest = int(np.argmax(peaks))
    return {
        "imbalance": imbalance, "ranks": world.world_size, "capacity_bytes": int(capacity),
        "oom_ranks": oom, "per_rank_peak_bytes": peaks.tolist(), "per_rank_tokens": loads.tolist(),
        "hottest_rank": hottest, "min_margin_bytes": int(capacity - peaks.max()),
        "model": {"form": "peak = base + bytes_per_token * tokens (per pipeline stage, from sandbox runs)",
                  "stages": [{"stage": f.stage, "base_bytes": f.base_bytes,
                              "bytes_per_token": f.bytes_per_token,
                              "measured": {str(k): v for k, v in f.measured.items()}}
                             for f in fits.values()]},
        "confirmed": confirmed,
    }


def moe_check_command(args) -> int:
    """The CLI: loads, calibration sandboxes, prediction, verdict (exit 3 when a rank runs out)."""
    import json
    from pathlib import Path

    from prism_megatron.capture.run import world_of
    from prism_megatron.cli import _config_file
    from prism_megatron.comm.calibrate import parse_size
    from prism_megatron.config import load_config
    from prism_megatron.config.loader import to_yaml
    from prism_megatron.config.schema import ConfigError
    from prism_megatron.emulate.run import EmulationFailed, run_sandboxes
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.util import atomic_write_text

    cluster_name = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("cluster=")), None)
    job = [o for o in args.overrides if not o.startswith("cluster=")]
    cfg = load_config(["emulation.sandbox_ranks=[]", *job], _config_file(args.config))
    if cfg.moe.imbalance == "none" or not cfg.model.num_experts:
        raise ConfigError("moe-check needs an MoE model and an imbalance model: e.g. model=tiny_moe "
                          "moe.imbalance=zipf(1.2)")
    world = world_of(cfg)
    if args.capacity:
        capacity = parse_size(args.capacity)
    else:
        capacity = load_cluster(cluster_name or "dgx_h100").gpu_memory_bytes
    if not capacity:
        raise ConfigError(f"--capacity {args.capacity!r}: expected a size such as 80GiB or 1048576")
    loads = rank_loads(cfg, world)
    device = cfg.train.device if cfg.train.device != "auto" else "cpu"
    cfg.trace.path = None
    text = to_yaml(cfg)
    out = Path(args.out)
    fits, oom_found = {}, {}
    for stage, ranks in calibration_ranks(world, loads).items():
        measured = {}
        for rank in ranks:
            try:
                (g, _), = run_sandboxes(text, [rank], out / f"rank{rank}", device=device).values()
                measured[rank] = int(g.peak_bytes)
            except EmulationFailed as err:
                log = (out / f"rank{rank}" / "run.log")
                if log.exists() and "out of memory" in log.read_text(errors="replace").lower():
                    oom_found[rank] = str(err)
                    continue
                raise
        if not measured:
            raise EmulationFailed(f"every calibration sandbox of stage {stage} ran out of memory: "
                                  f"{sorted(oom_found)}; the stage does not fit")
        fits[stage] = fit(stage, loads, measured)
    peaks = predict(world, loads, fits)
    hottest = int(np.argmax(peaks))
    measured_all = {r: v for f in fits.values() for r, v in f.measured.items()}
    confirmed = {"rank": hottest, "predicted_peak_bytes": int(peaks[hottest]),
                 "measured_peak_bytes": measured_all.get(hottest),
                 "sandbox_out_of_memory": hottest in oom_found}
    summary = report(world, loads, peaks, fits, capacity, cfg.moe.imbalance, confirmed)
    atomic_write_text(str(out / "moe_check.json"), json.dumps(summary, indent=1))
    if args.json:
        atomic_write_text(args.json, json.dumps(summary, indent=1))
    order = np.argsort(-peaks, kind="stable")
    print(f"moe-check: {cfg.moe.imbalance} over {int(cfg.model.num_experts)} experts, EP{cfg.parallel.ep}, "
          f"N={world.world_size}; capacity {capacity / 2**30:.2f} GiB per GPU")
    print(f"{'rank':>7}{'tokens':>10}{'predicted peak MiB':>20}{'margin MiB':>12}")
    for r in order[:8].tolist():
        print(f"{r:>7}{int(loads[r]):>10}{peaks[r] / 2**20:>20.2f}{(capacity - peaks[r]) / 2**20:>12.2f}")
    print(f"hottest rank {hottest}: predicted {peaks[hottest] / 2**20:.2f} MiB, sandbox measured "
          + (f"{confirmed['measured_peak_bytes'] / 2**20:.2f} MiB" if confirmed["measured_peak_bytes"]
             else "out of memory"))
    if summary["oom_ranks"]:
        shown = ", ".join(map(str, summary["oom_ranks"][:16]))
        print(f"OUT OF MEMORY predicted on {len(summary['oom_ranks'])} rank(s): {shown}"
              f"{' ...' if len(summary['oom_ranks']) > 16 else ''}")
        return 3
    print(f"no rank runs out of memory (smallest margin {summary['min_margin_bytes'] / 2**20:.2f} MiB)")
    return 0
