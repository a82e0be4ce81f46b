"""The module host table (kernels/host.py): exclusive time per module call, the table's arithmetic,
fake execution adding it per op, and `calibrate --host-modules` end to end on this CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prism_megatron.kernels.host import OUTSIDE, ModuleStack, calibrate_host_modules, module_key, module_table
from prism_megatron.kernels.model import KernelCostModel, shipped_calibration
from prism_megatron.runtime.fake import CostClock, FakeExecution

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Inner(torch.nn.Module):
    def forward(self, x):
        _busy(0.004)
        return x + 1


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        _busy(0.002)
        x = self.inner(x)
        return self.inner(x * 2)


class Failing(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom")


def test_a_call_is_timed_by_its_own_code_not_its_childrens():
    seen, windows = [], []
    stack = ModuleStack(on_change=lambda key, entered: seen.append((key, entered)), timed=True,
                        window_root=1, on_window=lambda: windows.append(len(seen))).install()
    try:
        Outer()(torch.ones(3))  # before the window: followed, not counted
        assert stack.calls == {} and stack.durations == {} and not windows
        start = time.perf_counter()
        Outer()(torch.ones(3))
        outer_wall = time.perf_counter() - start
        with pytest.raises(ValueError):
            Failing()(torch.ones(3))  # the exit hook still runs: the stack stays balanced
        window_wall = time.perf_counter() - start
    finally:
        stack.remove()
    outer, inner = module_key(Outer()), module_key(Inner())
    assert windows == [6] and stack.roots == 3
    assert stack.calls == {outer: 1, inner: 2, module_key(Failing()): 1}
    assert stack.current is None
    assert seen[6:12] == [(outer, True), (inner, True), (outer, False), (inner, True), (outer, False),
                          (None, False)]
    # Busy waits end by the wall clock, so a loaded machine only adds time; the bounds are what the
    # test itself saw around the calls. The outer call's own time excludes its children's 8 ms.
    inner_s, outer_s = stack.durations[inner], stack.durations[outer][0]
    assert min(inner_s) >= 0.004 and 0.002 <= outer_s <= outer_wall - sum(inner_s)
    assert sum(inner_s) + outer_s <= outer_wall
    assert 0.010 <= stack.root_s <= window_wall
    Outer()(torch.ones(3))  # removed: nothing more is recorded
    assert stack.calls[outer] == 1


def test_the_table_spreads_what_a_call_lacks_over_its_ops_or_adds_it_per_call():
    launch = 10e-6
    real = {"a": {"calls": 10, "mean_s": 300e-6}, "b": {"calls": 4, "mean_s": 80e-6},
            "c": {"calls": 2, "mean_s": 5e-6}, "real-only": {"calls": 1, "mean_s": 1.0}}
    counted = {"a": {"calls": 5, "kernels": 50, "views": 40},  # per call 10 + 8 ops
               "b": {"calls": 2, "kernels": 0, "views": 0},
               "c": {"calls": 2, "kernels": 2, "views": 0},
               "fake-only": {"calls": 1, "kernels": 1, "views": 0}}
    table = module_table(real, counted, launch)
    assert set(table) == {"a", "b", "c"}
    modelled_a = (50 * launch + 40 * launch / 4) / 5  # 120 us per call
    assert table["a"]["modelled_s_per_call"] == pytest.approx(modelled_a)
    assert table["a"]["per_op_s"] == pytest.approx((300e-6 - modelled_a) / 18)
    assert table["a"]["per_call_s"] == 0.0
    assert table["b"]["per_call_s"] == pytest.approx(80e-6) and table["b"]["per_op_s"] == 0.0
    assert table["c"]["per_op_s"] == 0.0 and table["c"]["per_call_s"] == 0.0  # the model is already slower


def test_fake_execution_adds_a_modules_figure_to_each_of_its_ops():
    model = KernelCostModel.for_gpu("h200")
    linear = torch.nn.Linear(64, 64)
    key = module_key(linear)

    def host_s(table: dict) -> tuple[float, int]:
        clock = CostClock(model)
        clock.model = KernelCostModel(model.spec, host_modules=table)
        clock.by_module = {}
        def on_change(k, entered):
            per_op, per_call = table.get(k, (0.0, 0.0))
            clock.enter_module(k, per_op, per_call if entered else 0.0)

        stack = ModuleStack(on_change).install()
        try:
            with FakeExecution(clock=clock):
                x = torch.randn(8, 64)
                before = clock.host_s
                linear(x)
                x + 1  # outside every module
                spent = clock.host_s - before
        finally:
            stack.remove()
        kernels, views = clock.by_module[key]
        return spent, kernels + views

    plain, ops = host_s({})
    assert ops >= 1
    per_op, per_call = host_s({key: (1e-3, 0.0)}), host_s({key: (0.0, 5e-3)})
    assert per_op[0] - plain == pytest.approx(1e-3 * ops)
    assert per_call[0] - plain == pytest.approx(5e-3)


@pytest.mark.slow
def test_calibrate_host_modules_measures_a_job_and_the_model_reads_its_table(tmp_path):
    calibration = tmp_path / "cal.json"
    shutil.copy(shipped_calibration("h200"), calibration)
    job = {"small": ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                     "model.seq_length=16", "train.iters=2"]}
    table = calibrate_host_modules(str(calibration), job, log=lambda s: None, keep=str(tmp_path / "jobs"),
                                   device="cpu")
    layer = "megatron.core.transformer.transformer_layer.TransformerLayer"
    assert layer in table and table[layer]["calls"] == 2 * 2 * 2  # 2 layers, 2 microbatches, 2 counted iterations
    assert table[layer]["ops_per_call"] >= 1
    outside = table[OUTSIDE]  # the backward and the optimizer: many ops per iteration
    assert outside["calls"] == 2 and outside["ops_per_call"] > table[layer]["ops_per_call"]
    data = json.loads(calibration.read_text())
    assert data["host_modules"]["modules"] == table and data["exact"]  # added, the kernels kept
    model = KernelCostModel.from_file(calibration, KernelCostModel.for_gpu("h200").spec)
    assert model.host_modules == {k: (r["per_op_s"], r["per_call_s"]) for k, r in table.items()
                                  if r["per_op_s"] or r["per_call_s"]}
    assert model.host_modules  # a CPU's real run is slower than the H200's launch model everywhere
    with pytest.raises(ValueError, match="not a kernel calibration"):
        calibrate_host_modules(str(tmp_path / "jobs" / "small-real.json"), job, device="cpu")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: cannot read a kernel calibration"):
        calibrate_host_modules(str(tmp_path / "broken.json"), job, device="cpu")
    with pytest.raises(ValueError, match="train.iters=1; expected 2 or more"):
        calibrate_host_modules(str(calibration), {"short": ["train.iters=1"]}, device="cpu")
    assert json.loads(calibration.read_text())["host_modules"]["modules"] == table  # left as it was


def test_calibrate_host_modules_without_a_calibration_or_a_gpu_is_one_line_and_exit_2(tmp_path):
    for args, message in [(["--out", str(tmp_path / "none.json")], "does not exist"),
                          (["--kernels", "--out", str(tmp_path / "k.json")], "none is visible here")]:
        proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "calibrate", "--host-modules", *args],
                              capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
