"""Job figures from a replay: tokens/s/GPU, MFU, per-rank rows; and the `simulate` overrides.

Model FLOPs per iteration (no recomputation; Narayanan et al. 2021 counted per token): forward per
layer 2 x its matmul parameters a token meets (Q and output h^2 each, K and V h*kv each with kv the
grouped-query width, the MLP 2h*f or 3h*f with SwiGLU, times top-k for MoE) + 4sh (scores and
context); the logits 2hV; training is three times the forward. For a dense GPT with f = 4h this is
Megatron's 72*B*s*L*h^2*(1 + s/6h + V/12Lh).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Optional

import yaml

from prism_megatron.config.schema import ConfigError
from prism_megatron.comm.cost import Calibration
from prism_megatron.sim.cluster import ClusterConfig, load_calibration, load_cluster


def model_flops(config_yaml: str) -> tuple[float, int]:
    """(model FLOPs of one iteration, tokens of one iteration) from a graph's config."""
    try:
        cfg = yaml.safe_load(config_yaml or "") or {}
    except yaml.YAMLError:
        cfg = {}
    if not isinstance(cfg, dict):  # a graph without the job's config: no FLOPs to count
        return 0.0, 0
    m, t = cfg.get("model") or {}, cfg.get("train") or {}
    h, s, L = m.get("hidden_size", 0), m.get("seq_length", 0), m.get("num_layers", 0)
    V = m.get("vocab_size", 0)
    heads = m.get("num_attention_heads") or 1
    kv = (m.get("num_query_groups") or heads) * (h // heads if heads else 0)
    f = m.get("moe_ffn_hidden_size") if m.get("num_experts") else m.get("ffn_hidden_size")
    topk = m.get("moe_router_topk", 1) if m.get("num_experts") else 1
    f = (f or m.get("ffn_hidden_size") or 4 * h) * topk
    mlp = (3 if m.get("swiglu") else 2) * h * f
    tokens = t.get("global_batch_size", 0) * s
    per_token = 3 * (L * (2 * (2 * h * h + 2 * h * kv + mlp) + 4 * s * h) + 2 * h * V)
    return float(per_token) * tokens, int(tokens)


def job_figures(iteration_s: float, n_ranks: int, config_yaml: str, cluster: ClusterConfig) -> dict:
    flops, tokens = model_flops(config_yaml)
    return {"iteration_time_s": iteration_s, "tokens_per_iteration": tokens,
            "tokens_per_s_per_gpu": tokens / iteration_s / n_ranks if iteration_s > 0 else 0.0,
            "model_flops_per_iteration": flops,
            "mfu": flops / (iteration_s * n_ranks * cluster.peak_tflops * 1e12) if iteration_s > 0 else 0.0}


SIM_KEYS = ("cluster", "calibration", "slowdown.<rank>", "cluster.<field>", "microbatches")


@dataclass
class SimOverrides:
    """What-if settings of `simulate`, parsed from KEY=VALUE overrides."""

    cluster: Optional[str] = None
    """A shipped cluster name or a YAML path (default: dgx_h100)."""
    cluster_fields: dict = field(default_factory=dict)
    """cluster.<field>=value: fields of the cluster config replaced."""
    slowdown: dict[int, float] = field(default_factory=dict)
    """slowdown.<rank>=factor: that rank's compute takes factor times as long."""
    calibration: Optional[str] = None
    """A calibration file from `prism-megatron calibrate`."""
    microbatches: Optional[int] = None
    """Microbatches per iteration (1F1B and no-pipelining schedules; see sim/reschedule.py)."""


def parse_overrides(overrides: list[str]) -> SimOverrides:
    out = SimOverrides()
    known = {f.name for f in fields(ClusterConfig)}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. cluster=dgx_a100 or "
                              "slowdown.4711=1.5")
        if key == "cluster":
            out.cluster = value
        elif key == "calibration":
            out.calibration = value
        elif key == "microbatches":
            try:
                out.microbatches = int(value)
            except ValueError:
                out.microbatches = 0
            if out.microbatches < 1:
                raise ConfigError(f"override {item!r}: expected a positive number of microbatches per "
                                  "iteration, e.g. microbatches=64")
        elif key.startswith("cluster."):
            name = key[len("cluster."):]
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean cluster.{close[0]}?" if close else ""
                raise ConfigError(f"unknown cluster key {key!r}{hint}")
            out.cluster_fields[name] = yaml.safe_load(value)
        elif key.startswith("slowdown."):
            try:
                rank, factor = int(key[len("slowdown."):]), float(value)
            except ValueError:
                raise ConfigError(f"override {item!r}: expected slowdown.<rank>=<factor>, e.g. "
                                  "slowdown.4711=1.5") from None
            if not 0 < factor < float("inf"):  # NaN too
                raise ConfigError(f"override {item!r}: a slowdown factor must be > 0 (1.5 = 50% slower)")
            out.slowdown[rank] = factor
        else:
            close = difflib.get_close_matches(key.split(".")[0], ("cluster", "calibration", "slowdown",
                                                                  "microbatches"), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"unknown simulate override {key!r}{hint} (keys: {', '.join(SIM_KEYS)})")
    return out


def emulation_cluster(overrides: list[str]) -> tuple[ClusterConfig, Optional[Calibration]]:
    """The cluster and calibration of `emulate`/`faults` from their cluster=, cluster.KEY= and
    calibration= overrides; a what-if of `simulate` (slowdown, microbatches) is a ConfigError."""
    what_if = parse_overrides(overrides)
    if what_if.slowdown or what_if.microbatches:
        raise ConfigError("emulate takes cluster=, cluster.KEY= and calibration= overrides; slowdowns and "
                          "microbatches are what-ifs of `simulate`")
    return load_cluster(what_if.cluster or "dgx_h100", what_if.cluster_fields), load_calibration(
        what_if.calibration)


def memory_by_stage(graph, capacity_bytes: int) -> dict:
    """Each pipeline stage's largest peak (allocated, reserved) over its roles, and the verdict."""
    stages: dict = {}
    for role, g in graph.roles.items():
        row = stages.setdefault(role.pp, {"pp": role.pp, "peak_allocated_bytes": 0, "peak_reserved_bytes": 0,
                                          "source": g.memory_source})
        row["peak_allocated_bytes"] = max(row["peak_allocated_bytes"], int(g.peak_bytes))
        row["peak_reserved_bytes"] = max(row["peak_reserved_bytes"], int(g.peak_reserved_bytes))
    rows = [stages[k] for k in sorted(stages)]
    worst = max(rows, key=lambda r: r["peak_reserved_bytes"])
    return {"stages": rows, "max_reserved_bytes": worst["peak_reserved_bytes"],
            "max_allocated_bytes": max(r["peak_allocated_bytes"] for r in rows), "max_stage": worst["pp"],
            "capacity_bytes": int(capacity_bytes), "oom": worst["peak_reserved_bytes"] > capacity_bytes}
