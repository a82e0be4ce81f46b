"""Job figures from a replay: tokens/s/GPU, MFU, per-rank rows; and the `simulate` overrides.

Model FLOPs per iteration (dense GPT, no recomputation; Narayanan et al. 2021 counted per token):
forward per layer 8h^2 (QKV and output projections) + 4sh (scores and context) + 4h*f (MLP, f the FFN
size, times top-k for MoE); the logits 2hV; training is three times the forward. With f = 4h this is
Megatron's 72*B*s*L*h^2*(1 + s/6h + V/12Lh).
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Optional

import yaml

from prism_megatron.config.schema import ConfigError
from prism_megatron.sim.cluster import ClusterConfig


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
    f = m.get("moe_ffn_hidden_size") if m.get("num_experts") else m.get("ffn_hidden_size")
    f = (f or 4 * h) * (m.get("moe_router_topk", 1) if m.get("num_experts") else 1)
    tokens = t.get("global_batch_size", 0) * s
    per_token = 3 * (L * (8 * h * h + 4 * s * h + 4 * h * f) + 2 * h * V)
    return float(per_token) * tokens, int(tokens)


def job_figures(iteration_s: float, n_ranks: int, config_yaml: str, cluster: ClusterConfig) -> dict:
    flops, tokens = model_flops(config_yaml)
    return {"iteration_time_s": iteration_s, "tokens_per_iteration": tokens,
            "tokens_per_s_per_gpu": tokens / iteration_s / n_ranks if iteration_s > 0 else 0.0,
            "model_flops_per_iteration": flops,
            "mfu": flops / (iteration_s * n_ranks * cluster.peak_tflops * 1e12) if iteration_s > 0 else 0.0}


SIM_KEYS = ("cluster", "calibration", "slowdown.<rank>", "cluster.<field>")


def parse_overrides(overrides: list[str]) -> tuple[Optional[str], dict, dict[int, float], Optional[str]]:
    """(cluster name/path, cluster field overrides, per-rank slowdown, calibration path)."""
    cluster, fields_, slowdown, calibration = None, {}, {}, None
    known = {f.name for f in fields(ClusterConfig)}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. cluster=dgx_a100 or "
                              "slowdown.4711=1.5")
        if key == "cluster":
            cluster = value
        elif key == "calibration":
            calibration = value
        elif key.startswith("cluster."):
            name = key[len("cluster."):]
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean cluster.{close[0]}?" if close else ""
                raise ConfigError(f"unknown cluster key {key!r}{hint}")
            fields_[name] = yaml.safe_load(value)
        elif key.startswith("slowdown."):
            try:
                rank, factor = int(key[len("slowdown."):]), float(value)
            except ValueError:
                raise ConfigError(f"override {item!r}: expected slowdown.<rank>=<factor>, e.g. "
                                  "slowdown.4711=1.5") from None
            if factor <= 0:
                raise ConfigError(f"override {item!r}: a slowdown factor must be > 0 (1.5 = 50% slower)")
            slowdown[rank] = factor
        else:
            close = difflib.get_close_matches(key.split(".")[0], ("cluster", "calibration", "slowdown"), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"unknown simulate override {key!r}{hint} (keys: {', '.join(SIM_KEYS)})")
    return cluster, fields_, slowdown, calibration
