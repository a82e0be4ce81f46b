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

from prism_megatron.commands import add_config_arguments
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
    return rank_tokens(cfg, world).sum(axis=2).max(axis=1)


def rank_tokens(cfg: PrismConfig, world: VirtualWorld) -> np.ndarray:
    """[rank, microbatch, layer of its stage]: tokens its local experts receive, per the model."""
    model: Imbalance = cfg.moe.model()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    experts, topk, ep = int(m.num_experts), int(m.moe_router_topk), p.ep
    local = experts // ep
    tokens = t.micro_batch_size * m.seq_length // (p.tp if p.sequence_parallel else 1) // p.cp
    microbatches = t.global_batch_size // (t.micro_batch_size * world.dp)
    iterations = cfg.iterations_run()
    iteration = max(0, iterations - 2) if iterations >= 2 else 0  # the recorded (last full) iteration
    per_stage = m.num_layers // p.pp
    cache: dict[tuple, np.ndarray] = {}

    def counts(layer: int, mb: int, source: int) -> np.ndarray:
        # (replay reads each source's own log)
        key = (layer, mb, source) if model.depends_on_source else (layer, mb)
        if key not in cache:
            cache[key] = model.counts(experts=experts, tokens=tokens, topk=topk, layer=layer,
                                      microbatch=mb, iteration=iteration, source=source)
        return cache[key]

    table = np.zeros((world.world_size, microbatches, per_stage), dtype=np.int64)
    dim = "tp_ep" if p.tp > 1 else "ep"
    for rank in range(world.world_size):
        c = world.coords(rank)
        first = c["pp"] * per_stage + 1
        sources = world.group(rank, dim) if ep > 1 or p.tp > 1 else (rank,)
        lo = c["ep"] * local
        for mb in range(microbatches):
            for i, layer in enumerate(range(first, first + per_stage)):
                table[rank, mb, i] = int(sum(counts(layer, mb, s)[lo:lo + local].sum() for s in sources))
    return table


def calibration_ranks(world: VirtualWorld, loads: np.ndarray) -> dict[int, list[int]]:
    """Per pipeline stage: its most loaded, a median and its least loaded rank (fewer when loads
    repeat). The line goes through the median and the coldest; the hottest is measured, which is
    the confirmation and, where it lies above the line, the model's stated error there."""
    out = {}
    stages = np.asarray([world.coords(r)["pp"] for r in range(world.world_size)])
    for stage in sorted(set(stages.tolist())):
        ranks = np.nonzero(stages == stage)[0]
        order = ranks[np.argsort(loads[ranks], kind="stable")]
        picks = [int(order[-1]), int(order[len(order) // 2]), int(order[0])]
        chosen, seen = [], set()
        for r in picks:
            if int(loads[r]) not in seen:
                seen.add(int(loads[r]))
                chosen.append(r)
        out[stage] = chosen
    return out


def fit(stage: int, loads: np.ndarray, measured: dict[int, int]) -> StageFit:
    """The line through the two least loaded measured ranks (the hottest may sit above it: a
    different moment of the iteration holds its peak; its own measurement is used for it)."""
    ranks = sorted(measured, key=lambda r: loads[r])
    if len(ranks) == 1:
        return StageFit(stage, float(measured[ranks[0]]), 0.0, dict(measured))
    a, b = ranks[0], ranks[1]
    slope = (measured[b] - measured[a]) / float(loads[b] - loads[a])
    return StageFit(stage, measured[a] - slope * float(loads[a]), slope, dict(measured))


def predict(world: VirtualWorld, loads: np.ndarray, fits: dict[int, StageFit],
            tokens: Optional[np.ndarray] = None) -> np.ndarray:
    """The stage's line for every rank; a measured rank, and every rank of its stage that receives
    the same tokens in every layer and microbatch (`tokens`: rank_tokens), keeps the measurement."""
    same: dict[tuple, int] = {}
    for f in fits.values():
        for r, v in f.measured.items():
            same[(f.stage, tokens[r].tobytes() if tokens is not None else r)] = v
    out = np.zeros(world.world_size, dtype=np.int64)
    for r in range(world.world_size):
        stage = world.coords(r)["pp"]
        f = fits[stage]
        key = (stage, tokens[r].tobytes() if tokens is not None else r)
        out[r] = same.get(key, round(f.base_bytes + f.bytes_per_token * float(loads[r])))
    return out


def line_error(loads: np.ndarray, fits: dict[int, StageFit]) -> dict[str, float]:
    """Per stage: the line against its hottest measured rank (relative, + = the rank is above it)."""
    out = {}
    for f in fits.values():
        if len(f.measured) < 3:
            continue
        hot = max(f.measured, key=lambda r: loads[r])
        line = f.base_bytes + f.bytes_per_token * float(loads[hot])
        out[str(f.stage)] = f.measured[hot] / line - 1
    return out


def report(world: VirtualWorld, loads: np.ndarray, peaks: np.ndarray, fits: dict[int, StageFit],
           capacity: int, imbalance: str, confirmed: dict) -> dict:
    oom = np.nonzero(peaks > capacity)[0].tolist()
    hottest = confirmed["rank"]
    return {
        "imbalance": imbalance, "ranks": world.world_size, "capacity_bytes": int(capacity),
        "oom_ranks": oom, "per_rank_peak_bytes": peaks.tolist(), "per_rank_tokens": loads.tolist(),
        "hottest_rank": hottest, "min_margin_bytes": int(capacity - peaks.max()),
        "model": {"form": "peak = base + bytes_per_token * tokens per pipeline stage, the line through its "
                          "median and least loaded sandbox runs; measured ranks keep their measurement",
                  "line_error_at_hottest": line_error(loads, fits),
                  "stages": [{"stage": f.stage, "base_bytes": f.base_bytes,
                              "bytes_per_token": f.bytes_per_token,
                              "measured": {str(k): v for k, v in f.measured.items()}}
                             for f in fits.values()]},
        "confirmed": confirmed,
    }


def add_arguments(cmd) -> None:
    add_config_arguments(cmd, "config overrides, e.g. model=tiny_moe moe.imbalance=zipf(1.2); "
                              "cluster=NAME")
    cmd.add_argument("--out", required=True, help="directory for the calibration sandboxes")
    cmd.add_argument("--capacity", default=None,
                     help="device memory per GPU, e.g. 80GiB (default: the cluster's GPU memory)")
    cmd.add_argument("--json", default=None, help="write the verdict JSON here too")


def moe_check_command(args) -> int:
    """The CLI: loads, calibration sandboxes, prediction, verdict (exit 3 when a rank runs out)."""
    import json
    from pathlib import Path

    from prism_megatron.capture.run import world_of
    from prism_megatron.config.job import job_of
    from prism_megatron.commands.calibrate import parse_size
    from prism_megatron.config.loader import to_yaml
    from prism_megatron.config.schema import ConfigError
    from prism_megatron.emulate.run import EmulationFailed, run_sandboxes
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.util import atomic_write_text

    cluster_name = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("cluster=")), None)
    job = [o for o in args.overrides if not o.startswith("cluster=")]
    cfg = job_of(args, job)
    cfg.emulation.sandbox_ranks = []
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
    tokens = rank_tokens(cfg, world)
    loads = tokens.sum(axis=2).max(axis=1)
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
    peaks = predict(world, loads, fits, tokens)
    measured_all = {r: v for f in fits.values() for r, v in f.measured.items()}
    top = [r for r in (*measured_all, *oom_found) if r in measured_all and peaks[r] == peaks.max()]
    hottest = top[0] if top else int(np.argmax(peaks))  # among equals, the one the sandbox ran
    confirmed = {"rank": hottest, "predicted_peak_bytes": int(peaks[hottest]),
                 "measured_peak_bytes": measured_all.get(hottest),
                 "sandbox_out_of_memory": hottest in oom_found}
    summary = report(world, loads, peaks, fits, capacity, cfg.moe.imbalance, confirmed)
    summary["pictures"], summary["tokens_per_expert"] = _pictures(out, cfg, world, peaks)
    atomic_write_text(str(out / "moe_check.json"), json.dumps(summary, indent=1))
    if args.json:
        atomic_write_text(args.json, json.dumps(summary, indent=1))
    order = np.argsort(-peaks, kind="stable")
    print(f"moe-check: {cfg.moe.imbalance} over {int(cfg.model.num_experts)} experts, EP{cfg.parallel.ep}, "
          f"N={world.world_size}; capacity {capacity / 2**30:.2f} GiB per GPU")
    print(f"{'rank':>7}{'tokens':>10}{'predicted peak MiB':>20}{'margin MiB':>12}")
    for r in order[:8].tolist():
        print(f"{r:>7}{int(loads[r]):>10}{peaks[r] / 2**20:>20.2f}{(capacity - peaks[r]) / 2**20:>12.2f}")
    seen = confirmed["measured_peak_bytes"]
    print(f"hottest rank {hottest}: predicted {peaks[hottest] / 2**20:.2f} MiB, sandbox measured "
          + (f"{seen / 2**20:.2f} MiB" if seen else
             "out of memory" if confirmed["sandbox_out_of_memory"] else "(not run)"))
    if summary["oom_ranks"]:
        shown = ", ".join(map(str, summary["oom_ranks"][:16]))
        print(f"OUT OF MEMORY predicted on {len(summary['oom_ranks'])} rank(s): {shown}"
              f"{' ...' if len(summary['oom_ranks']) > 16 else ''}")
        return 3
    print(f"no rank runs out of memory (smallest margin {summary['min_margin_bytes'] / 2**20:.2f} MiB)")
    return 0


def _pictures(out, cfg: PrismConfig, world: VirtualWorld, peaks: np.ndarray) -> dict:
    """tokens.png: MoE layers of stage 0 (rows) x experts (columns), tokens each expert receives in
    the first microbatch from the first EP group; peak_memory.png: the predicted peak of every rank,
    ranks row-major in rows of the EP size. Viridis: minimum dark, maximum yellow (moe/pictures.py).
    The same numbers are in the JSON (per_rank_peak_bytes, tokens_per_expert)."""
    from prism_megatron.moe.pictures import heatmap_png

    m, t, p = cfg.model, cfg.train, cfg.parallel
    model = cfg.moe.model()
    tokens = t.micro_batch_size * m.seq_length // (p.tp if p.sequence_parallel else 1) // p.cp
    sources = world.group(0, "tp_ep" if p.tp > 1 else "ep") if p.ep > 1 or p.tp > 1 else (0,)
    iteration = max(0, cfg.iterations_run() - 2)
    shape = dict(experts=int(m.num_experts), tokens=tokens, topk=int(m.moe_router_topk), microbatch=0,
                 iteration=iteration)
    grid = np.asarray([sum(model.counts(layer=layer, source=s, **shape) for s in sources)
                       for layer in range(1, m.num_layers // p.pp + 1)])
    paths = {"tokens": str(out / "tokens.png"), "peak_memory": str(out / "peak_memory.png")}
    heatmap_png(paths["tokens"], grid)
    rows = peaks.reshape(-1, p.ep) if len(peaks) % p.ep == 0 else peaks[None, :]
    heatmap_png(paths["peak_memory"], rows, cell=6)
    return paths, grid.tolist()


run = moe_check_command
