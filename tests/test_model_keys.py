"""Each model/recompute key changes what megatron builds and what fake execution sees.

One tiny job per key (bf16, one rank, CPU): the parameter count of the real run's exact memory tracker
(shapes), and under fake execution the op signatures the cost model priced (`PRISM_FAKE_OPS`: op names
and their calls per run) and the modelled peak memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest

from prism_megatron.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
BASE = ["model=tiny", "model.params_dtype=bf16", "model.num_attention_heads=4", "model.hidden_size=64",
        "train.device=cpu", "emulation.virtual_world_size=1", "emulation.sandbox_ranks=[0]", "parallel.tp=1",
        "parallel.pp=1", "parallel.sequence_parallel=false", "train.global_batch_size=2",
        "train.micro_batch_size=1", "train.iters=2"]


@lru_cache(maxsize=None)
def _run(extra: tuple, fake: bool, tmp: str) -> tuple[dict, Counter]:
    name = str(abs(hash((extra, fake))))
    summary, ops = Path(tmp) / f"{name}.json", Path(tmp) / f"{name}.ops.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PRISM_FAKE_OPS=str(ops))
    mode = "emulation.execution=fake" if fake else "emulation.execution=real"
    proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "train", *BASE, *extra, mode,
                           "--json", str(summary)], capture_output=True, text=True, env=env, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = Counter()
    if fake:
        data = json.loads(ops.read_text())
        for sig, n in zip(data["ops"], data["calls"]):
            calls[sig["op"]] += n
    return json.loads(summary.read_text()), calls


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("keys"))
    return lambda *extra, fake=True: _run(tuple(extra), fake, tmp)


def _params(summary: dict) -> int:
    return summary["memory"]["peak_by_category"]["params"] // 2  # bf16


def test_fused_attention_replaces_the_score_matrix(run):
    _, local = run()
    _, flash = run("model.attention_backend=flash", "model.num_query_groups=2")
    assert local["aten._softmax.default"] and not local["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    layers = 4 * 2 * 2  # layers x micro-batches x iterations
    assert flash["aten._scaled_dot_product_flash_attention_for_cpu.default"] == layers
    assert flash["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] == layers
    assert flash["aten._softmax.default"] < local["aten._softmax.default"]  # only the loss's is left


def test_fused_attention_is_priced_from_the_attention_calibration():
    from prism_megatron.kernels.attention import AttentionCosts, AttentionShape
    from prism_megatron.kernels.model import GPU_SPECS, KernelCostModel

    rows = [{"backend": "flash", "direction": "fwd", "batch": 1, "q_heads": 32, "kv_heads": 8, "q_len": s,
             "kv_len": s, "head_dim": 128, "dtype": "bfloat16", "causal": True, "s": t}
            for s, t in ((4096, 1e-3), (16384, 12e-3))]
    costs = AttentionCosts(rows)
    exact = AttentionShape("fwd", 1, 32, 8, 4096, 4096, 128, "bfloat16", True)
    assert costs.predict(exact, "flash") == (1e-3, "exact")
    between = AttentionShape("fwd", 1, 32, 8, 8192, 8192, 128, "bfloat16", True)
    seconds, source = costs.predict(between, "flash")
    rates = sorted(s.flops / t for s, t in ((exact, 1e-3), (AttentionShape(
        "fwd", 1, 32, 8, 16384, 16384, 128, "bfloat16", True), 12e-3)))
    assert source == "attention-fit" and rates[0] <= between.flops / seconds <= rates[1]
    assert costs.predict(between, "cudnn") is None  # another backend: nothing measured
    model = KernelCostModel(GPU_SPECS["h100"])  # roofline, no calibration: FLOPs of the causal half
    assert between.flops == pytest.approx(2 * 2 * 32 * 8192 * 8192 * 128 / 2)
    assert model.attention.predict(between, "flash") is None


def test_rmsnorm_is_one_fused_op_each_way(run):
    _, layer = run()
    _, rms = run("model.normalization=RMSNorm")
    norms = 4 * 2 + 1  # two per layer and the final one
    assert layer["aten.native_layer_norm.default"] == norms * 4
    assert rms["prism.fused_rms_norm.default"] == norms * 4
    assert rms["aten._fused_rms_norm_backward.default"] == norms * 4
    assert not rms["aten.native_layer_norm.default"]


def test_rmsnorm_drops_the_norm_biases_and_rope_the_position_table(run):
    base, _ = run(fake=False)
    rms, _ = run("model.normalization=RMSNorm", fake=False)
    rope, rope_ops = run("model.position_embedding_type=rope")
    _, base_ops = run()
    h, norms = 64, 4 * 2 + 1
    assert _params(base) - _params(rms) == norms * h  # RMSNorm has a weight, no bias
    rope_real, _ = run("model.position_embedding_type=rope", fake=False)
    assert _params(base) - _params(rope_real) == 32 * h  # no learned positions (seq 32)
    assert rope_ops["aten.cos.default"] > base_ops["aten.cos.default"]


def test_kv_channels_set_the_attention_projections(run):
    base, _ = run(fake=False)
    wide, _ = run("model.kv_channels=32", fake=False)  # 4 heads of 32 instead of 16
    h, layers = 64, 4
    per_layer = lambda proj: h * 3 * proj + 3 * proj + proj * h  # QKV weight and bias, output weight
    assert _params(wide) - _params(base) == layers * (per_layer(128) - per_layer(64))
    assert load_config(["model.kv_channels=32"]).model.head_dim == 32


def test_dropout_draws_masks(run):
    _, none = run()
    _, drop = run("model.attention_dropout=0.1", "model.hidden_dropout=0.1")
    assert not none["aten.bernoulli_.float"] and drop["aten.bernoulli_.float"] > 0  # a mask per dropout


def test_full_recompute_runs_the_forward_twice_and_keeps_less(run):
    plain, plain_ops = run()
    again, again_ops = run("train.recompute_granularity=full", "train.recompute_method=uniform")
    assert again_ops["aten.mm.default"] > plain_ops["aten.mm.default"]
    assert again_ops["aten.gelu.default"] == 2 * plain_ops["aten.gelu.default"]
    assert again["execution"]["peak_allocated_bytes"] <= plain["execution"]["peak_allocated_bytes"]


def test_selective_recompute_of_core_attention(run):
    _, plain = run()
    _, selective = run("train.recompute_granularity=selective")
    assert selective["aten._softmax.default"] > plain["aten._softmax.default"]
    assert selective["aten.gelu.default"] == plain["aten.gelu.default"]


@pytest.mark.slow
def test_moe_shared_expert_and_sigmoid_router(run):
    moe = ["model=tiny_moe", "model.hidden_size=64", "moe.imbalance=force-balanced"]
    base, base_ops = run(*moe)
    shared, _ = run(*moe, "model.moe_shared_expert_intermediate_size=32", fake=False)
    plain, _ = run(*moe, fake=False)
    assert _params(shared) - _params(plain) == 4 * 2 * 64 * 32  # per layer: fc1 and fc2, no biases
    _, sigmoid = run(*moe, "model.moe_router_score_function=sigmoid")
    assert sigmoid["aten.sigmoid.default"] > base_ops["aten.sigmoid.default"]


def test_fp8_runs_the_layers_gemms_through_scaled_mm(run):
    plain, plain_ops = run()
    fp8, fp8_ops = run("model.fp8=hybrid")
    gemms = 4 * 4 * 3 * 2 * 2  # layers x linears (qkv, proj, fc1, fc2) x GEMMs x micro-batches x iterations
    assert not plain_ops["aten._scaled_mm.default"] and fp8_ops["aten._scaled_mm.default"] == gemms
    assert fp8_ops["aten.mm.default"] + fp8_ops["aten.addmm.default"] + gemms == (
        plain_ops["aten.mm.default"] + plain_ops["aten.addmm.default"])  # the output layer stays bf16
    assert fp8_ops["aten.linalg_vector_norm.default"] > plain_ops["aten.linalg_vector_norm.default"]  # amax
    real_plain, _ = run(fake=False)
    real_fp8, _ = run("model.fp8=hybrid", fake=False)
    losses = [r["losses"] for r in (real_plain, real_fp8)]
    assert losses[0] != losses[1] and all(abs(a - b) < 0.02 * a for a, b in zip(*losses))


@pytest.mark.parametrize("sequence_parallel, recipe", [(True, "tensorwise"), (True, "delayed"),
                                                       (False, "delayed")])
def test_fp8_keeps_megatrons_tensor_parallel_communication_at_te_precision(run, sequence_parallel, recipe):
    tp2 = ["emulation.virtual_world_size=2", "parallel.tp=2", f"parallel.sequence_parallel={sequence_parallel}"]
    plain, _ = run(*tp2)
    fp8, fp8_ops = run(*tp2, "model.fp8=e4m3", f"model.fp8_recipe={recipe}")
    assert fp8_ops["aten._scaled_mm.default"] == 4 * 4 * 3 * 2 * 2
    if not sequence_parallel:
        assert fp8["comm"] == plain["comm"]  # the same collectives, calls and bytes
        return
    comm = [{(c["op"], c["dim"]): (c["calls"], c["bytes"]) for c in r["comm"]} for r in (plain, fp8)]
    gathers = 2 * 4 * 2 * 2 * 2  # qkv and fc1 inputs x layers x (forward, backward) x micro-batches x iterations
    gathered_bf16_bytes = 32 * 1 * 64 * 2  # seq x micro-batch x hidden x 2 bytes
    calls, moved = comm[0][("all_gather", "world")]
    assert comm[1][("all_gather", "world")] == (calls, moved - gathers * gathered_bf16_bytes // 2)  # in FP8
    calls, moved = comm[0][("all_reduce", "world")]
    assert comm[1][("all_reduce", "world")] == (calls + gathers // 2, moved + 4 * gathers // 2)  # amax
    assert comm[1][("reduce_scatter", "world")] == comm[0][("reduce_scatter", "world")]


def test_fp8_linear_matches_the_bf16_product_and_keeps_a_delayed_history():
    import types

    import torch

    from prism_megatron.runtime.fp8_linear import _FP8Linear, _Scaling

    def module(recipe: str, fmt: str = "hybrid"):
        config = types.SimpleNamespace(fp8=fmt, fp8_recipe=recipe, fp8_amax_history_len=4,
                                       fp8_amax_compute_algo="max", fp8_margin=0)
        return types.SimpleNamespace(config=config, _prism_fp8_scaling={
            name: _Scaling(config) for name in ("input", "weight", "grad")})

    torch.manual_seed(0)
    x = torch.randn(8, 2, 256, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(128, 256) / 16).to(torch.bfloat16).requires_grad_()
    ref = torch.matmul(x.float(), w.float().t())
    (ref * ref).sum().backward()
    gx, gw = x.grad.float().clone(), w.grad.float().clone()
    for recipe in ("tensorwise", "delayed"):
        m = module(recipe)
        for _ in range(3):
            x.grad = w.grad = None
            out = _FP8Linear.apply(x, w, None, m, False, False, None)
            (out.float() ** 2).sum().backward()
        for got, want in ((out.float(), ref), (x.grad.float(), gx), (w.grad.float(), gw)):
            assert (got - want).norm() / want.norm() < 0.08, recipe
    history = m._prism_fp8_scaling["input"].history
    assert history.shape == (4,) and (history[:3] > 0).all() and history[3] == 0  # three forwards kept
    assert torch.allclose(history[:3], x.detach().abs().amax().float().expand(3))


def test_fp8_gemms_are_priced_at_the_fp8_peak():
    import torch

    from prism_megatron.kernels.model import FP8_OF_BF16_EFFICIENCY, KernelCostModel
    from prism_megatron.kernels.signature import OpCall

    model = KernelCostModel.for_gpu("h200")
    a = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    b = torch.empty(6144, 4096, dtype=torch.bfloat16, device="meta").t()  # the layout _scaled_mm takes
    bf16 = model.predict(OpCall(torch.ops.aten.mm.default, (a, b), {}, None))
    one = torch.ones((), device="meta")
    a8, b8 = a.to(torch.float8_e4m3fn), torch.empty(6144, 4096, device="meta").to(torch.float8_e4m3fn).t()
    fp8 = model.predict(OpCall(torch.ops.aten._scaled_mm.default, (a8, b8, one, one), {}, None))
    assert fp8[1] == "gemm-grid-scaled" and bf16[1] == "gemm-grid"
    assert fp8[0] == pytest.approx(bf16[0] / (2 * FP8_OF_BF16_EFFICIENCY), rel=0.02)


def test_megatron_flags_map_onto_the_keys():
    from prism_megatron.config.flags import OneLineParser, add_megatron_args, config_from_args

    args = add_megatron_args(OneLineParser()).parse_args(
        ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "500000",
         "--attention-backend", "flash", "--kv-channels", "16", "--recompute-granularity", "selective",
         "--recompute-modules", "core_attn", "mlp", "--attention-dropout", "0.0"])
    cfg = config_from_args(args)
    assert (cfg.model.normalization, cfg.model.position_embedding_type, cfg.model.rotary_base) == (
        "RMSNorm", "rope", 500000)
    assert cfg.model.attention_backend == "flash" and cfg.model.kv_channels == 16
    assert cfg.train.recompute_modules == ["core_attn", "mlp"]
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "16",
           "--fp8-amax-compute-algo", "max", "--bf16"]
    cfg = config_from_args(add_megatron_args(OneLineParser()).parse_args(fp8))
    assert (cfg.model.fp8, cfg.model.fp8_recipe, cfg.model.fp8_amax_history_len, cfg.model.fp8_amax_compute_algo) == (
        "hybrid", "tensorwise", 16, "max")


def test_fp8_with_a_recompute_only_te_runs_is_refused():
    with pytest.raises(ConfigError, match="Transformer Engine only"):
        load_config(["model.fp8=e4m3", "model.params_dtype=bf16", "train.recompute_granularity=selective",
                     "train.recompute_modules=[core_attn,mlp]"])


@pytest.mark.parametrize("bad", [
    "model.normalization=BatchNorm", "model.attention_backend=xformers", "model.rotary_percent=0",
    "model.attention_dropout=1.5", "model.position_embedding_type=alibi", "train.recompute_granularity=full",
    "train.recompute_method=uniform", "model.kv_channels=0", "model.norm_epsilon=0",
    "model.fp8=e5m2", "model.fp8_recipe=mxfp8", "model.fp8_amax_history_len=0", "model.fp8=hybrid",
    "model.fp8_amax_compute_algo=mean", "model.fp8_margin=-1",
])
def test_bad_values_are_refused_in_one_line(bad):
    with pytest.raises(ConfigError) as err:
        load_config([bad])
    assert "\n" not in str(err.value)
