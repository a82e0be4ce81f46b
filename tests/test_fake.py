"""Fake execution (emulation.execution=fake): the real megatron-core program on tensors without storage.

- A tiny TP2 PP2 job captured with real and with fake tensors gives the same graph: the same
  communication (op, group, bytes, dtype, sequence, peer), the same module-level compute sequence,
  dependencies and pipeline spans, the same memory breakdown by category.
- The aten ops of the training steps have the same shapes and dtypes, in the same order, with one
  documented exception: autograd replays views of tensor subclasses instead of using `as_strided`,
  so the backward of an in-place op on a view (CopySlices) differs in its bookkeeping ops.
- Data-dependent values come from the scalar model; object collectives carry real data.
- Memory is the CUDA caching allocator's (modelled); time is the kernel-cost model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_capture import _program  # what a rank does, strings resolved, timings left out

from prism_megatron.graph import load_graph
from prism_megatron.kernels.model import GPU_SPECS, KernelCostModel
from prism_megatron.kernels.signature import OpCall
from prism_megatron.runtime.fake import CostClock, FakeExecution, ScalarModel, is_fake

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
ARGS = ["--device", "cpu", "--prism-virtual-world-size", "8", "--prism-sandbox-ranks", "5",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--train-iters", "2"]


def _run(cmd: list[str], tmp: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fake")
    config = tmp / "job.yaml"
    config.write_text(
        "emulation: {virtual_world_size: 8}\nparallel: {tp: 2, pp: 2}\n"
        "model: {num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 16}\n"
        "train: {global_batch_size: 8, micro_batch_size: 2, iters: 2, device: cpu}\n")
    graphs = {}
    for execution in ("real", "fake"):
        _run([sys.executable, "-m", "prism_megatron.cli", "capture", "--config", str(config), "--out",
              str(tmp / execution), "--json", str(tmp / f"{execution}.json"),
              f"emulation.execution={execution}"], tmp)
        summary = json.loads((tmp / f"{execution}.json").read_text())
        graphs[execution] = load_graph(summary["graph_path"])
    graphs["fake_slices"] = tmp / "fake" / "slices"
    return graphs


@pytest.mark.parametrize("rank", [0, 3, 5, 6])
@pytest.mark.slow
def test_fake_and_real_capture_give_the_same_graph(captures, rank):
    real, fake = captures["real"], captures["fake"]
    a, b = _program(real, real.graph_of(rank)), _program(fake, fake.graph_of(rank))
    assert a["nodes"] == b["nodes"], f"rank {rank}: nodes (compute sequence, collectives, p2p) differ"
    assert a["deps"] == b["deps"] and a["spans"] == b["spans"]
    assert any(n[3] == "send" for n in a["nodes"]) and any(n[3] == "all_reduce" for n in a["nodes"])
    g_real, g_fake = real.graph_of(rank), fake.graph_of(rank)
    assert g_fake.peak_by_category == g_real.peak_by_category  # exact bytes per category
    assert g_fake.memory_source == "allocator-model" and g_real.memory_source == "tracker"
    # the allocator rounds every block to 512 bytes and reserves whole segments
    assert g_fake.peak_bytes >= g_real.peak_bytes and g_fake.peak_reserved_bytes >= g_fake.peak_bytes
    assert fake.meta["execution"] == "fake" and fake.meta["device"] == "fake:h200"
    assert real.meta["execution"] == "real" and real.meta["device"] == "cpu"


@pytest.mark.slow
def test_the_two_probes_of_a_fake_class_time_every_node_alike(captures):
    """The two probes of a verified class ran one program against one cost and host model under fake
    execution, two processes on a CPU shared with each other: nothing measured here enters a
    duration, so every node lasts the same in both, as each slice wrote it. One node is not the same
    program: megatron's gradient norm on tensor-parallel rank 0 also sums the parameters every TP rank
    holds (layer norms), which the other ranks leave out."""
    fake = captures["fake"]
    for pp in range(fake.world.pp):
        (tp0, a), (tp1, b) = sorted(((r.tp, g) for r, g in fake.roles.items() if r.pp == pp),
                                    key=lambda x: x[0])  # TP2: the class's two probes
        assert (tp0, tp1) == (0, 1) and a.source == b.source == "captured"
        own = [load_graph(str(captures["fake_slices"] / f"rank{g.representative}.prism"), check=False)
               for g in (a, b)]
        first, second = (next(iter(o.roles.values())).columns["duration_s"] for o in own)
        names = [own[0].strings[int(i)] for i in next(iter(own[0].roles.values())).columns["name"]]
        same = np.asarray([n != "optimizer.grad_norm" for n in names])
        assert len(first) > 50 and first.sum() > 0 and 1 <= (~same).sum() <= 4
        np.testing.assert_allclose(first[same], second[same], rtol=1e-9, atol=0)  # start times' rounding
        # TP rank 0's norm covers more tensors
        assert (first[~same] >= second[~same]).all() and (first[~same] > second[~same]).any()
        np.testing.assert_array_equal(a.columns["duration_s"], first)  # each probe keeps its own
        np.testing.assert_array_equal(b.columns["duration_s"], second)


def _copy_slices_free(ops: list) -> list:
    """Drop metadata-only ops and CopySlices' bookkeeping (see module docstring)."""
    kept = [op for op in ops if not op[0].startswith("prim.")
            and op[0] not in ("aten.view.default", "aten.as_strided.default", "aten.new_zeros.default")]
    out = []
    for op in kept:  # CopySlices' copy of the whole base (shape of the view's base, same dtype twice)
        if op[0] == "aten.copy_.default" and out and out[-1][0] == "aten._softmax_backward_data.default":
            continue
        out.append(op)
    return out


def test_fake_and_real_training_steps_run_the_same_ops_with_the_same_shapes(tmp_path):
    logs = {}
    for execution in ("real", "fake"):
        path = tmp_path / f"{execution}.json"
        _run([sys.executable, str(REPO / "tests" / "op_log.py"), str(path), *ARGS,
              "--prism-execution", execution], tmp_path)
        logs[execution] = json.loads(path.read_text())
    real, fake = logs["real"], logs["fake"]
    assert any(op[0] == "prim.device.default" for op in fake)  # fake tensors answer .device by dispatch
    assert sum(op[0] == "aten.new_zeros.default" for op in real) > 0  # CopySlices on real tensors
    real, fake = _copy_slices_free(real), _copy_slices_free(fake)
    assert len(real) > 500
    assert real == fake


def test_scalars_object_collectives_and_cuda_semantics_under_fake_execution():
    scalars = ScalarModel(providers=[lambda t: [3, 1, 4, 1] if t.numel() == 4 else None])
    with FakeExecution(scalars=scalars):
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        assert is_fake(x) and x.untyped_storage().device.type == "meta"
        assert float(x.sum()) == 1.0 and not bool(torch.isinf(x).any())
        counts = (x > 0).sum(dim=1)  # integers computed from fake data: the provider answers
        assert is_fake(counts) and counts.tolist() == [3, 1, 4, 1]
        assert int(counts.sum()) == 1  # no provider for one element: the scalar model's integer
        # integer factories (counts, indices, masks decide shapes) are real, with real values
        index = torch.arange(5)
        assert not is_fake(index) and index.tolist() == [0, 1, 2, 3, 4]
        assert not is_fake(torch.zeros(3, dtype=torch.long)) and is_fake(torch.zeros(3))
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            a, b = torch.arange(3), torch.arange(3)
        assert bool(torch.all(a == b).item()) is True  # all-real inputs run for real
        _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [8], None, None, 1e-5)
        assert mean.dtype == rstd.dtype == torch.float32  # as CUDA keeps them
    assert not is_fake(torch.ones(1))


def test_torch_optimizers_take_the_gpus_multi_tensor_step_on_fake_tensors():
    """As on CUDA tensors, Adam runs `_foreach_` ops (one kernel over all parameters, their
    temporaries live together) on fake ones, not its per-parameter loop; plain CPU tensors keep the
    loop, as torch gives them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from prism_megatron.hooks.fake import _optimizers_as_on_the_gpu
    from prism_megatron.runtime.patching import PatchSet

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    class Inst:
        def __init__(self):
            self.patches = PatchSet()

        def patch(self, owner, name, value):
            self.patches.patch(owner, name, value)

    def step_ops(make):
        params = [torch.nn.Parameter(make(8, 4)), torch.nn.Parameter(make(4))]
        for p in params:
            p.grad = make(*p.shape)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        with Ops() as ops:
            optimizer.step()
        return ops.names

    import torch.optim.adam as adam
    from torch.optim import optimizer as base

    original = base._default_to_fused_or_foreach
    inst = Inst()
    _optimizers_as_on_the_gpu(inst)
    assert adam._default_to_fused_or_foreach is not original
    try:
        assert any("_foreach_" in n for n in step_ops(torch.randn)) is False  # real CPU tensors: the loop
        with FakeExecution():
            fake = step_ops(torch.randn)
        assert any("_foreach_mul_" in n for n in fake) and any("_foreach_addcdiv_" in n for n in fake)
        assert not any(n.startswith("aten.addcdiv_") for n in fake)
    finally:
        inst.patches.restore()
    assert adam._default_to_fused_or_foreach is original and base._default_to_fused_or_foreach is original


def test_cost_clock_models_host_launches_and_device_time():
    model = KernelCostModel.for_gpu("h200")
    clock = CostClock(model)
    with FakeExecution(clock=clock):
        a = torch.randn(4096, 4096, dtype=torch.bfloat16)
        start = clock.mark()
        for _ in range(10):
            a @ a
        end = clock.mark()
        tiny = torch.ones(4)
        torch.cuda.synchronize()  # the host waits for the GEMMs: from here the host is the bottleneck
        t0 = clock.mark()
        for _ in range(100):
            tiny.add_(1)
        t1 = clock.mark()
    gemm_s = (end - start) / 10
    assert 2 * 4096 ** 3 / gemm_s == pytest.approx(650e12, rel=0.2)  # about what the H200 reaches
    assert (t1 - t0) / 100 == pytest.approx(model.host_launch_s, rel=0.05)  # launch-bound stream
    assert clock.by_source.get("exact", [0])[0] + clock.by_source.get("gemm-grid", [0])[0] >= 10


def test_host_time_is_modelled_not_measured_here():
    """Nothing of the host time is measured on this CPU: the program sleeping or busy between ops
    (another process's turn, a slow CPU, a loaded machine) leaves the modelled host and device time
    as they are; each op costs the GPU host's launch figure, whatever this CPU spent."""
    import time

    def busy(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def modelled(pause) -> tuple[float, float]:
        clock = CostClock(KernelCostModel.for_gpu("h200"))
        with FakeExecution(clock=clock):
            x = torch.ones(64, 64)
            for _ in range(3):
                x = x @ x
                pause()
                x.add_(1)
        return clock.host_s, clock.device_s

    idle = modelled(lambda: None)
    assert modelled(lambda: time.sleep(0.03)) == idle
    assert modelled(lambda: busy(0.03)) == idle
    # seven kernels (the fill of `ones`, three matmuls, three adds), each the GPU host's launch
    assert idle[0] == pytest.approx(7 * KernelCostModel.for_gpu("h200").host_launch_s)


def test_roofline_gpus_and_the_shipped_calibration():
    h200 = KernelCostModel.for_gpu("h200")
    assert h200.source.startswith("calibrated") and h200.exact and h200.grids and h200.families
    with FakeExecution():
        a = torch.randn(8192, 8192, dtype=torch.bfloat16)
        call = OpCall(torch.ops.aten.mm.default, (a, a), {}, a @ a)
        big = torch.randn(1 << 26)
        add = OpCall(torch.ops.aten.add.Tensor, (big, big), {}, big + big)
    h100, a100 = KernelCostModel(GPU_SPECS["h100"]), KernelCostModel.for_gpu("a100")  # no calibration
    assert h100.source == a100.source == "roofline"
    shipped_h100 = KernelCostModel.for_gpu("h100")  # the shipped H100 calibration
    assert shipped_h100.source.startswith("calibrated (h100-") and shipped_h100.attention
    assert shipped_h100.predict(call)[1] in ("gemm-grid", "exact")
    t_h100, t_a100 = h100.predict(call)[0], a100.predict(call)[0]
    assert t_h100 == pytest.approx(2 * 8192 ** 3 / (GPU_SPECS["h100"].peak_flops["bfloat16"] * 0.8))
    assert t_a100 / t_h100 == pytest.approx(989 / 312)
    assert h200.predict(call)[1] in ("gemm-grid", "exact")
    assert h200.predict(call)[0] == pytest.approx(t_h100, rel=0.35)
    assert add.bytes == 3 * (1 << 28)
    assert a100.predict(add)[0] / h100.predict(add)[0] == pytest.approx(3.35 / 2.039)
    with pytest.raises(ValueError, match="unknown target GPU"):
        KernelCostModel.for_gpu("v100")


def test_an_exact_elementwise_time_holds_for_other_scalar_values():
    """Adam's step sizes change every step; the kernel measured with one step's values times the next."""
    from prism_megatron.kernels.signature import key_of

    with FakeExecution():
        xs = [torch.randn(4096, 1024) for _ in range(3)]
        ys = [torch.randn(4096, 1024) for _ in range(3)]
        scaled = [OpCall(torch.ops.aten._foreach_addcdiv_.ScalarList, (xs, ys, ys, [step] * 3), {}, None)
                  for step in (-1e-3, -5.26e-4)]
        a = torch.randn(512, 512, dtype=torch.bfloat16)
        gemms = [OpCall(torch.ops.aten.addmm.default, (a, a, a), {"beta": beta}, a) for beta in (0.0, 1.0)]
    model = KernelCostModel(GPU_SPECS["h200"], exact={key_of(scaled[0].sig): 1.25e-3, key_of(gemms[0].sig): 7e-6})
    assert model.predict(scaled[0]) == model.predict(scaled[1]) == (1.25e-3, "exact")
    assert model.predict(gemms[0]) == (7e-6, "exact")
    assert model.predict(gemms[1])[1] != "exact"  # a GEMM's beta decides whether it reads C: not reused


def test_gemm_grid_predicts_the_measured_model_gemms():
    """Off the exact table, the grid's interpolation predicts the large GEMMs of the [D] configs that
    were measured as they are (hidden 4096, TP2 shards): median error within 25 %. (The grid, swept for
    a minute back to back, reads 10-20 % slower than the same shapes replayed in short bursts.)"""
    model = KernelCostModel.for_gpu("h200")
    errors = []
    grid_only = KernelCostModel(model.spec, grids=model.grids, families=model.families)
    for key, seconds in model.exact.items():
        sig = json.loads(key)
        if sig["op"] not in ("aten.mm.default", "aten.addmm.default") or seconds < 50e-6:
            continue
        call = OpCall.__new__(OpCall)
        call.sig, call.kind = sig, "gemm"
        from prism_megatron.kernels.signature import gemm_dims

        batch, m, n, k, _, _ = gemm_dims(sig)
        call.flops, call.bytes = 2.0 * batch * m * n * k, 0.0
        predicted, source = grid_only.predict(call)
        assert source == "gemm-grid"
        errors.append(abs(predicted / seconds - 1))
    errors.sort()
    assert len(errors) >= 10
    assert errors[len(errors) // 2] < 0.25


def test_bad_execution_settings_are_one_line_and_exit_2(tmp_path):
    for override, message in [("emulation.execution=maybe", "emulation.execution='maybe' is unknown"),
                              ("emulation.target_gpu=v100", "unknown target GPU 'v100'"),
                              ("train.framework=deepspeed", "runs megatron-core only")]:
        proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "train",
                               "emulation.virtual_world_size=8", "emulation.sandbox_ranks=[0]",
                               "parallel.tp=2", "parallel.pp=2", "emulation.execution=fake", override],
                              capture_output=True, text=True, env=ENV, timeout=300, cwd=REPO)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


MOE = ["--device", "cpu", "--prism-virtual-world-size", "2", "--prism-sandbox-ranks", "0",
       "--expert-model-parallel-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
       "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2"]


@pytest.mark.slow
def test_moe_under_fake_execution_routes_by_the_model_like_the_real_run(tmp_path):
    """Token counts are data: under fake execution they come from the routing model and are real
    integers, so the dispatcher's splits and every expert's tokens, hence memory and communication,
    equal the real run's."""
    summaries = {}
    for execution in ("real", "fake"):
        path = tmp_path / f"{execution}.json"
        _run([sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), *MOE, "--prism-moe-imbalance",
              "zipf(1.2)", "--prism-execution", execution, "--prism-summary-json", str(path)], tmp_path)
        summaries[execution] = json.loads(path.read_text())
    real, fake = summaries["real"], summaries["fake"]
    assert fake["memory"]["peak_by_category"] == real["memory"]["peak_by_category"]
    assert fake["memory"]["peak_allocated_bytes"] == real["memory"]["peak_allocated_bytes"]
    assert fake["comm"] == real["comm"] and any(r["op"] == "all_to_all" for r in real["comm"])
    assert fake["execution"]["mode"] == "fake" and fake["execution"]["peak_reserved_bytes"] > 0
    # the backend's CPU time, which fake execution takes off the program's host work, is counted
    # there only (two clock reads per operation saved in a real run)
    assert len(fake["backend_host_cpu_s_per_iteration"]) == 2
    assert all(s > 0 for s in fake["backend_host_cpu_s_per_iteration"])
    assert real["backend_host_cpu_s_per_iteration"] == [None, None]
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), *MOE,
                           "--prism-execution", "fake"], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "needs a routing model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_replayed_indexing_ops_get_valid_spread_indices():
    """The kernel calibration replays an op from its signature alone; an indexing op's indices are
    drawn uniformly over the indexed dim (zeros sent a whole MoE unpermute to one row, 144x slower
    on the H200), expanded indices keep their shared values, and every replay runs."""
    from prism_megatron.kernels.calibrate import _build, _valid_indices, replay_ops

    t = lambda dt, shape, st: {"T": shape, "dt": dt, "st": st}  # noqa: E731
    unpermute = {"op": "aten.scatter_add_.default", "kwargs": [],
                 "args": [t("float32", [64, 8], [8, 1]), 0, t("int64", [128, 8], [1, 0]),
                          t("float32", [128, 8], [8, 1])]}
    args = _build(torch, unpermute["args"], "cpu")
    _valid_indices(torch, unpermute["op"], args)
    index = args[2]
    assert 0 <= int(index.min()) and int(index.max()) < 64 and index[:, 0].unique().numel() > 16
    assert (index == index[:, :1]).all()  # an expanded index: one value per row
    listed = {"op": "aten.index.Tensor", "kwargs": [],
              "args": [t("float32", [10, 5], [5, 1]), [t("int64", [30], [1]), None]]}
    args = _build(torch, listed["args"], "cpu")
    _valid_indices(torch, listed["op"], args)
    assert int(args[1][0].max()) < 10 and int(args[1][0].max()) > 0
    embedding_bwd = {"op": "aten.embedding_dense_backward.default", "kwargs": [],
                     "args": [t("float32", [6, 4], [4, 1]), t("int64", [6], [1]), 50, -1, False]}
    rows = replay_ops(torch, lambda fn: (fn(), 0.0)[1], [unpermute, listed, embedding_bwd],
                      lambda s: None, device="cpu")
    assert all("error" not in r for r in rows), rows
