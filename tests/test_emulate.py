"""`prism-megatron run`: capture (cached), then emulate, on CPU; and its bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
JOB = ["emulation.virtual_world_size=4", "parallel.tp=1", "parallel.pp=2", "model.num_layers=2",
       "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.iters=2", "train.device=cpu",
       "cluster=cpu_host"]


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "prism_megatron.cli", "run", *args], capture_output=True,
                          text=True, env=ENV, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_run_captures_once_then_emulates_the_sandbox(tmp_path):
    first = _run(*JOB, "--out", str(tmp_path / "r"), "--sandbox", "last-stage", "--json",
                 str(tmp_path / "a.json"))
    assert first.returncode == 0, first.stderr[-3000:]
    out = json.loads((tmp_path / "a.json").read_text())
    assert out["ranks"] == 4 and out["physical_fraction"] == 0.25 and out["sandbox_count"] == 1
    (row,) = out["sandbox"]
    assert row["virtual_rank"] == 2  # stage 1 of DP2 PP2 starts at rank 2
    assert row["peak_allocated_bytes"] > 0 and 0 < row["iteration_time_s"] <= out["iteration_time_s"]
    # the emulator's own cost: on CPU the device time of the backend's operations is host time
    # inside them, less the wrapper's bookkeeping around them (the graph's durations are medians over
    # the timed iterations, the host time is the timed iteration's: some slack)
    assert row["comm_ops_per_iteration"] > 0 and row["compute_s"] > 0
    assert 0 < row["backend_device_s_per_iteration"] <= row["backend_host_s_per_iteration"] * 1.5
    assert row["overhead_ratio"] == pytest.approx(row["backend_host_s_per_iteration"] / row["compute_s"])
    assert "host_bound" not in row  # on CPU the host is the device
    assert row["device_overhead_ratio"] == pytest.approx(
        row["backend_device_s_per_iteration"] / row["compute_s"])
    assert Path(out["graph_path"]).is_file() and (tmp_path / "r" / "run.json").is_file()
    assert "iteration" in first.stdout and "tokens/s/GPU" in first.stdout
    again = _run(*JOB, "--out", str(tmp_path / "r"), "--sandbox", "first-stage")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(0 slices run" in again.stdout  # the cached capture is reused


@pytest.mark.parametrize("args,message", [
    (["--sandbox", "middle"], "expected a virtual rank or one of"),
    (["emulation.clock=fast"], "expected one of virtual, realtime"),
    (["cluster=nope"], "not found"),
])
def test_run_bad_input_is_one_line_and_exit_2(tmp_path, args, message, capsys, monkeypatch):
    from test_bad_inputs import run_in_process  # cli.main in this process; real processes: test_bad_inputs

    monkeypatch.chdir(REPO)
    code, err = run_in_process(["run", *JOB, "--out", str(tmp_path / "r"), *args], capsys)
    assert code == 2 and message in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1


def test_validate_is_the_fidelity_harness():
    proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "validate", "--list"],
                          capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and {"tp2", "pp2_1f1b", "dp2_distopt_overlap", "moe_ep2"} <= {
        line.split(":")[0] for line in proc.stdout.splitlines()}
    bad = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "validate", "--configs", "nope"],
                         capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0


def test_a_host_bound_sandbox_is_reported_and_warned_from_a_quarter_of_its_compute(capsys):
    from prism_megatron.emulate.cli import _print
    from prism_megatron.emulate.run import HOST_BOUND_WARN_SHARE, _capture_share, _host_bound

    assert _host_bound({"device": "cpu"}) == {}
    figures = {"ops": 400, "idle_ops": 37, "compute_s": 0.092, "idle_compute_s": 0.023, "share": 0.25}
    # the threshold itself warns, a hair below it does not
    assert _host_bound({"host_bound": dict(figures, share=HOST_BOUND_WARN_SHARE)})["host_bound"]["warning"]
    assert not _host_bound({"host_bound": dict(figures, share=HOST_BOUND_WARN_SHARE - 1e-9)})["host_bound"]["warning"]
    row = {"virtual_rank": 4711, "iteration_time_s": 1.0, "recorded_iteration_s": 0.5,
           "peak_allocated_bytes": 2**20, "peak_reserved_bytes": 2**21, **_host_bound({"host_bound": figures})}
    assert row["host_bound"]["warning"]
    summary = {"ranks": 8192, "sandbox_count": 1, "physical_fraction": 1 / 8192, "materialized_ghosts": 9,
               "classes": 30, "cluster": "dgx_h200", "clock": "virtual", "sim_wall_s": 1.0,
               "iteration_time_s": 1.0, "tokens_per_s_per_gpu": 1.0, "mfu": 0.5, "sandbox": [row]}
    _print(summary)
    warned = capsys.readouterr().out
    assert "WARNING" in warned and "37 of 400 operations' begin; 25.0% of its compute" in warned
    row.update(_host_bound({"host_bound": dict(figures, idle_compute_s=0.005, share=0.05)}))
    _print(summary)
    quiet = capsys.readouterr().out
    assert not row["host_bound"]["warning"] and "WARNING" not in quiet and "5.0%" in quiet
    summary["capture_host_bound_share"] = _capture_share({"host_bound_share": {"0": 0.02, "4711": 0.4}})
    _print(summary)
    assert "capture was host-bound: 40% of rank 4711's compute ended with its device waiting" in \
        capsys.readouterr().out
    assert _capture_share({}) is None and not _capture_share({"host_bound_share": {"1": 0.1}})["warning"]
    row.update(realtime_iteration_s=1.01, realtime_vs_virtual_pct=1.0, realtime_vs_replay_pct=0.5,
               realtime_host_bound=dict(figures, share=0.119))
    _print(summary)
    assert "+0.50% against the replay of this run's own compute); 11.9% of its compute ended with its " \
        "device waiting for the host" in capsys.readouterr().out
    row.update(realtime_vs_own_iterations_pct=0.21, paced_vs_own_iterations_pct=-0.13)
    _print(summary)
    assert "each iteration's wall against the replay of its own compute (median): realtime run +0.21%, " \
        "paced run -0.13%" in capsys.readouterr().out


def test_capture_warns_of_its_host_bound_slices_by_rank():
    from prism_megatron.capture.run import host_bound_warning

    assert host_bound_warning({}) is None and host_bound_warning({3: 0.05}) is None
    text = host_bound_warning({3: 0.05, 4711: 0.31, 7: 0.2})
    assert text.startswith("capture: WARNING") and "rank 7 (20%), rank 4711 (31%)" in text
    assert "rank 3" not in text and "\n" not in text
    many = host_bound_warning({r: 0.5 for r in range(10)})
    assert "rank 7 (50%) and 2 more" in many
