"""Kill tests: `capture`, `emulate` and `sweep` SIGKILLed at a random point leave no process behind
(slices, torchrun, its sandbox workers) and no partial file; a stopped sandbox peer ends `emulate`
with an error naming it within `emulation.peer_timeout_s`."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

from prism_megatron.graph import load_graph  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
PEER_TIMEOUT_S = 8
JOB = ("emulation: {virtual_world_size: 4, peer_timeout_s: %d}\n"
       "parallel: {tp: 1, pp: 1}\n"
       "model: {num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 16}\n"
       "train: {global_batch_size: 4, micro_batch_size: 1, iters: 150, device: cpu}\n" % PEER_TIMEOUT_S)
CLI = [sys.executable, "-m", "prism_megatron.cli"]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, Path]:
    """(the job's config file, its captured graph): one role, 150 short iterations (longer than the checks wait)."""
    tmp = tmp_path_factory.mktemp("kill")
    config = tmp / "job.yaml"
    config.write_text(JOB)
    done = subprocess.run([*CLI, "capture", "--config", str(config), "--out", str(tmp / "capture")],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return config, tmp / "capture" / "graph.prism"


def _workers(pid: int) -> list:
    """The job processes (prism_megatron.launch, not torchrun) below `pid`."""
    found = []
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in below:
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "prism_megatron.launch" in line and "torch.distributed.run" not in line:
            found.append(child)
    return found


def _start(cmd: list[str], log: Path, want: int) -> tuple[subprocess.Popen, list]:
    """Start `cmd` in a session of its own; return it once `want` job processes run below it."""
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ENV,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        workers = _workers(proc.pid)
        if len(workers) >= want:
            return proc, workers
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    _reap(proc, [])
    pytest.fail(f"{cmd[3]} started no {want} job process(es) in 120 s")


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _reap(proc: subprocess.Popen, tree: list) -> None:
    """Test hygiene after a failure: nothing of ours outlives the test."""
    for p in [*tree, *_session(proc.pid)]:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _session(sid: int) -> list:
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != sid and os.getsid(p.pid) == sid and _alive(p):
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def _kill_and_check(proc: subprocess.Popen, out: Path) -> None:
    """SIGKILL `proc` alone at a random point; nothing below it may survive, nothing partial stay."""
    time.sleep(random.uniform(0.0, 1.5))
    tree = psutil.Process(proc.pid).children(recursive=True)  # torchrun's workers: sessions of their own
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 3  # a child that dies with its parent is gone at once; a survivor ends later
    left = [p for p in tree if _alive(p)] + _session(proc.pid)
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = [p for p in tree if _alive(p)] + _session(proc.pid)
    try:
        assert not left, f"left running after the parent was killed: {[p.cmdline()[:4] for p in left]}"
    finally:
        _reap(proc, tree)
    files = [f for f in out.rglob("*") if f.is_file()]
    assert not [f for f in files if ".tmp" in f.name], files
    for f in files:
        if f.suffix == ".prism":
            load_graph(str(f), check=False)  # whole or absent, never half


def test_a_killed_capture_leaves_no_slice_and_no_partial_file(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(JOB)
    proc, _ = _start([*CLI, "capture", "--config", str(config), "--out", str(tmp_path / "out")],
                     tmp_path / "log", want=1)
    _kill_and_check(proc, tmp_path / "out")


def test_a_killed_emulate_leaves_no_torchrun_no_sandbox_and_no_partial_file(job, tmp_path):
    _, graph = job
    proc, _ = _start([*CLI, "emulate", str(graph), "--sandbox", "0,1", "--out", str(tmp_path / "out")],
                     tmp_path / "log", want=2)
    _kill_and_check(proc, tmp_path / "out")


def test_a_killed_sweep_leaves_no_slice_and_no_partial_file(tmp_path):
    sweep = ["emulation.virtual_world_size=4", "parallel.tp=1,2", "parallel.pp=1", "model.num_layers=2", "model.hidden_size=32",
             "model.num_attention_heads=4", "model.seq_length=16", "train.global_batch_size=4",
             "train.micro_batch_size=1", "train.iters=2", "train.device=cpu"]
    proc, _ = _start([*CLI, "sweep", "-m", *sweep, "--cluster", "cpu_host", "--out", str(tmp_path / "out")],
                     tmp_path / "log", want=1)
    _kill_and_check(proc, tmp_path / "out")


def test_a_killed_two_process_sweep_leaves_no_point_process_and_no_slice(tmp_path):
    """--jobs 2: each point runs in a joblib (loky) worker process, which dies with the sweep."""
    sweep = ["emulation.virtual_world_size=4", "parallel.tp=2,4", "parallel.pp=1", "model.num_layers=2",
             "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
             "train.global_batch_size=4", "train.micro_batch_size=1", "train.iters=2", "train.device=cpu"]
    proc, _ = _start([*CLI, "sweep", "-m", *sweep, "--cluster", "cpu_host", "--jobs", "2", "--out",
                      str(tmp_path / "out")], tmp_path / "log", want=2)
    _kill_and_check(proc, tmp_path / "out")


@pytest.mark.slow
def test_a_stopped_sandbox_peer_is_an_error_naming_it_within_the_peer_timeout(job, tmp_path):
    _, graph = job
    out = tmp_path / "out"
    proc, workers = _start([*CLI, "emulate", str(graph), "--sandbox", "0,1", "--out", str(out)],
                           tmp_path / "log", want=2)
    try:
        log = out / "sandbox" / "run.log"
        deadline = time.time() + 120
        while time.time() < deadline and "iteration 1/" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.05)
        (peer,) = [w for w in workers if w.environ().get("LOCAL_RANK") == "1"]  # sandbox rank 1
        peer.suspend()
        stopped = time.time()
        rc = proc.wait(timeout=PEER_TIMEOUT_S + 30)
        waited = time.time() - stopped
        text = (tmp_path / "log").read_text()
        assert rc != 0 and "no answer from sandbox rank 1 to sandbox rank 0" in text, text[-3000:]
        assert "peer_timeout_s" in text
        assert PEER_TIMEOUT_S - 1 < waited < PEER_TIMEOUT_S + 20, waited
        time.sleep(1)
        assert not _alive(peer) and not [w for w in workers if _alive(w)]
    finally:
        _reap(proc, workers)
