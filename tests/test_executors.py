"""Where capture slices run (capture/executors.py): local processes, submitit's local executor (what a
SLURM setup runs, here), a local Ray (the `ray` marker: with the `[ray]` extra). A slice's exit status and log come back through each; a
job on this machine ends when the capture is SIGKILLed; a capture through submitit equals one of
local processes; a bad executor setting is one line and exit 2 before any work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prism_megatron import cli
from prism_megatron.capture.executors import ExecutorSpec, open_executor
from prism_megatron.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
           PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
TINY = ["emulation.virtual_world_size=16", "parallel.tp=2", "parallel.pp=2", "model.num_layers=4",
        "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16", "train.micro_batch_size=1",
        "train.global_batch_size=8", "train.iters=2", "train.device=cpu", "parallel.sequence_parallel=false",
        "emulation.execution=fake"]
# Ray comes with the `[ray]` extra; its cases run with `pytest -m ray` where it is installed
RAY = pytest.param("ray", marks=pytest.mark.ray)
# submitit's jobs take seconds each to start and end: its cases run in the slow pass
SUBMITIT = pytest.param("submitit_local", marks=pytest.mark.slow)
KINDS = ["local", SUBMITIT, RAY]


def _wait(job, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while (rc := job.poll()) is None:
        assert time.monotonic() < deadline, "the slice's job did not end"
        time.sleep(0.05)
    return rc


@pytest.mark.parametrize("kind", KINDS)
def test_a_slices_exit_status_and_log_come_back_through_the_executor(kind, tmp_path):
    executor = open_executor(ExecutorSpec.parse(kind, []), tmp_path / "jobs", gpus_per_slice=0)
    try:
        jobs = [executor.start([sys.executable, "-c", f"import os; print('slice', os.getcwd()); raise SystemExit({rc})"],
                               dict(os.environ), str(tmp_path), tmp_path / f"s{rc}.log", slot=rc) for rc in (0, 3)]
        assert [_wait(j) for j in jobs] == [0, 3]
    finally:
        executor.close()
    for rc in (0, 3):  # the command ran in the given folder and its output is the slice's log
        assert (tmp_path / f"s{rc}.log").read_text().strip() == f"slice {tmp_path}"


@pytest.mark.parametrize("kind", [SUBMITIT, RAY])
def test_a_job_on_this_machine_ends_when_the_capture_is_sigkilled(kind, tmp_path):
    """The capture process (here a stand-in that starts one slice of `sleep`) is SIGKILLed: the
    slice's command must not outlive it."""
    pidfile = tmp_path / "slice.pid"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from prism_megatron.capture.executors import ExecutorSpec, open_executor
        ex = open_executor(ExecutorSpec.parse({kind!r}, []), Path({str(tmp_path / 'jobs')!r}), gpus_per_slice=0)
        job = ex.start([sys.executable, "-c", "import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"],
                       {{}}, {str(tmp_path)!r}, Path({str(tmp_path / 'slice.log')!r}), slot=0)
        while job.poll() is None:
            time.sleep(0.1)
    """)
    capture = subprocess.Popen([sys.executable, "-c", script], env=ENV, cwd=REPO)
    try:
        deadline = time.monotonic() + 90
        while not (pidfile.exists() and pidfile.read_text()):
            assert capture.poll() is None, "the stand-in capture ended early"
            assert time.monotonic() < deadline, "the slice never started"
            time.sleep(0.1)
        slice_pid = int(pidfile.read_text())
        os.kill(capture.pid, signal.SIGKILL)
        capture.wait()
        deadline = time.monotonic() + 10
        while _alive(slice_pid):
            assert time.monotonic() < deadline, f"slice {slice_pid} outlived the SIGKILLed capture"
            time.sleep(0.1)
    finally:
        if capture.poll() is None:
            capture.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("argv, words", [
    (["--executor", "slurmx"], "expected one of local"),
    (["--executor", "local", "--executor-option", "partition=gpu"], "takes none"),
    (["--executor", "submitit_local", "--executor-option", "partition"], "expected KEY=VALUE"),
    (["--executor", "ray", "--executor-option", "partition=gpu"], "ray"),  # refused as unknown or as absent
])
def test_a_bad_executor_setting_is_one_line_and_exit_2_before_any_work(argv, words, tmp_path, capsys):
    for command in (["capture", *TINY, "--out", str(tmp_path / "cap")],
                    ["sweep", "-m", *TINY, "--out", str(tmp_path / "sweep")]):
        try:
            code = cli.main([*command, *argv])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert words in lines[0], lines[0]
        assert not (tmp_path / "cap").exists() and not (tmp_path / "sweep").exists()


def test_slurm_without_sbatch_is_refused_with_what_to_do(monkeypatch):
    from prism_megatron.capture.executors import check_executor

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="sbatch is not on PATH"):
        check_executor(ExecutorSpec.parse("submitit_slurm", ["partition=gpu", "timeout_min=90"]))
    assert ExecutorSpec.parse("submitit_slurm", ["timeout_min=90"]).options == (("timeout_min", 90),)


@pytest.mark.slow
def test_a_capture_through_submitit_equals_one_of_local_processes(tmp_path):
    from prism_megatron.graph.io import load_graph
    from prism_megatron.graph.model import structure_difference

    for kind in ("local", "submitit_local"):
        run = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "capture", *TINY, "--executor", kind,
                              "--out", str(tmp_path / kind)], env=ENV, cwd=REPO, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
    a, b = (load_graph(str(tmp_path / kind / "graph.prism")) for kind in ("local", "submitit_local"))
    assert set(a.roles) == set(b.roles) and len(a.roles) == 4
    for role, ga in a.roles.items():
        gb = b.roles[role]
        assert structure_difference(ga, a.strings, gb, b.strings) is None, role
        assert ga.peak_bytes == gb.peak_bytes
        assert (ga.columns["duration_s"] == gb.columns["duration_s"]).all(), role  # fake execution: equal
    assert list((tmp_path / "submitit_local" / "jobs").iterdir()), "submitit kept no record of its jobs"
