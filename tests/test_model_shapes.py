"""Model presets with their published sizes, and GQA / SwiGLU / untied embeddings really built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism_megatron.config import load_config
from prism_megatron.config.loader import MODEL_PRESETS

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.mark.parametrize("name,billions", [
    ("gpt3_175b", 175.0), ("llama3_8b", 8.03), ("llama3_70b", 70.6), ("llama3_405b", 405.9),
    ("mixtral_8x7b", 46.7),
])
def test_presets_have_their_published_parameter_counts(name, billions):
    assert MODEL_PRESETS[name].parameters() / 1e9 == pytest.approx(billions, rel=0.01)
    assert load_config([f"model={name}"]).model == MODEL_PRESETS[name]


def test_deepseek_shaped_preset_loads_with_its_routing():
    m = load_config(["model=deepseek_v3_shaped"]).model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.num_layers) == (256, 8, 2048, 61)


def test_gqa_swiglu_and_untied_embeddings_are_what_megatron_builds(tmp_path):
    shape = ["model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=2",
             "model.swiglu=true", "model.seq_length=32", "model.num_layers=2", "model.tie_embeddings=false"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), "--device", "cpu", "--global-batch-size",
         "4", "--micro-batch-size", "2", "--train-iters", "2", "--prism-override", *shape,
         "--prism-summary-json", str(tmp_path / "s.json")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = load_config(shape).model
    params = json.loads((tmp_path / "s.json").read_text())["memory"]["peak_by_category"]["params"] // 4
    h, layers = m.hidden_size, m.num_layers
    # parameters() leaves out the norms (2 LayerNorms per layer and the final one, weight and bias)
    # and the local spec's learned position embeddings
    assert params == m.parameters() + layers * 4 * h + 2 * h + m.seq_length * h
    mha = load_config([s for s in shape if "num_query_groups" not in s]).model
    kv = m.num_query_groups * (h // m.num_attention_heads)
    assert mha.parameters() - m.parameters() == layers * 2 * h * (h - kv)  # GQA: K and V of 2 groups


def test_model_flops_follow_gqa_and_swiglu():
    from prism_megatron.config.loader import to_yaml
    from prism_megatron.sim.report import model_flops

    cfg = load_config(["model=llama3_8b", "train.global_batch_size=64", "train.micro_batch_size=1"])
    flops, tokens = model_flops(to_yaml(cfg))
    m = cfg.model
    h, s, L, V = m.hidden_size, m.seq_length, m.num_layers, m.vocab_size
    matmul = m.parameters() - 2 * V * h  # every layer weight, not the two embedding tables
    assert tokens == 64 * s
    assert flops / tokens == pytest.approx(3 * (2 * matmul + 4 * s * h * L + 2 * h * V))
