"""`prism-megatron launch`: unmodified training scripts run as a rank of a virtual world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
DENSE = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--num-layers", "16",
         "--num-attention-heads", "8", "--global-batch-size", "128", "--micro-batch-size", "1"]

# A script that knows nothing of prism: Megatron-LM-style strict flags (unknown ones are an error),
# torch.distributed and megatron-core's parallel state, as pretrain_gpt.py sets them up.
STRICT = textwrap.dedent('''
    import argparse, json, os, sys
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()  # a --prism-* flag here would be an error
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    dist.init_process_group(backend="gloo", rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    t = __import__("torch").ones(4)
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    json.dump({"world": dist.get_world_size(), "rank": dist.get_rank(),
               "tp": ps.get_tensor_model_parallel_world_size(),
               "stage": ps.get_pipeline_model_parallel_rank(), "reduced": t.tolist(),
               "argv": sys.argv[1:]}, open(args.out, "w"))
    dist.destroy_process_group()
''')


def _launch(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "prism_megatron.cli", "launch", *args], capture_output=True,
                          text=True, env=ENV, timeout=timeout, cwd=REPO)


def test_an_unmodified_strict_script_runs_as_a_rank_of_the_virtual_world(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STRICT)
    out = tmp_path / "out.json"
    proc = _launch("--", str(script), "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size",
                   "2", "--global-batch-size", "16", "--micro-batch-size", "1", "--prism-virtual-world-size",
                   "64", "--prism-sandbox-ranks", "37", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["world"], got["rank"], got["tp"], got["stage"]) == (64, 37, 4, 1)
    assert got["reduced"] == [4.0] * 4  # three ghost peers mirror the sandbox's ones
    assert not any(a.startswith("--prism") for a in got["argv"])  # the script never saw them


@pytest.mark.slow
def test_the_example_through_launch_is_the_example_run_directly(tmp_path):
    """examples/pretrain_gpt.py reads the --prism-* flags itself: under launch they reach it through
    the environment, and its own install() is the launch's; the run is the same, number for number."""
    example = str(REPO / "examples" / "pretrain_gpt.py")
    common = ["--device", "cpu", *DENSE, "--prism-virtual-world-size", "8192",
              "--prism-sandbox-ranks", "4711"]
    launched = _launch("--", example, *common, "--prism-summary-json", str(tmp_path / "a.json"))
    assert launched.returncode == 0, launched.stderr[-3000:]
    direct = subprocess.run([sys.executable, example, *common, "--prism-summary-json",
                             str(tmp_path / "b.json")], capture_output=True, text=True, env=ENV,
                            timeout=600, cwd=REPO)
    assert direct.returncode == 0, direct.stderr[-3000:]
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    assert (a["virtual_world_size"], a["virtual_rank"]) == (8192, 4711)
    assert a["grad_norms"] == b["grad_norms"] and a["peak_tracked_bytes"] == b["peak_tracked_bytes"]


@pytest.mark.parametrize("args,message", [
    ([], "no training script"),
    (["--", "no_such_script.py"], "is not a file"),
    (["--nproc-per-node", "0", "--", "x.py"], "expected a process count"),
])
def test_bad_launch_input_is_one_line_and_exit_2(args, message):
    proc = _launch(*args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_the_prism_flags_and_only_they_are_taken_out_of_the_script_arguments():
    from prism_megatron.launch import split_args

    argv = ["--num-layers", "2", "--prism-ghost-policy", "mirror", "mirror", "--prism-sandbox-ranks", "0",
            "last-stage", "--lr", "0.1", "--prism-virtual-world-size=64", "--seq-length", "2"]
    known, prism, rest = split_args(argv)
    assert prism == ["--prism-ghost-policy", "mirror", "--prism-sandbox-ranks", "0", "last-stage",
                     "--prism-virtual-world-size=64"]
    assert rest == ["--num-layers", "2", "mirror", "--lr", "0.1", "--seq-length", "2"]
    assert known.prism_virtual_world_size == 64 and known.prism_sandbox_ranks == ["0", "last-stage"]


def test_a_started_job_runs_this_checkout_without_a_launchers_ranks(monkeypatch):
    """`job_env`: the jobs the tool starts (capture slices, sandboxes, calibration jobs) import the
    prism_megatron of the tool that started them (this checkout first on the path, before the
    user's), are worlds of their own (no launcher rank variables) and take one OpenMP thread on CPU
    unless one is set."""
    from pathlib import Path

    import prism_megatron
    from prism_megatron.util import job_env

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = job_env(cpu=True, EXTRA="1")
    root = str(Path(prism_megatron.__file__).resolve().parents[1])
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/somewhere/else"]
    assert "RANK" not in env and env["OMP_NUM_THREADS"] == "1" and env["EXTRA"] == "1"
    assert job_env(cpu=False).get("OMP_NUM_THREADS") is None
    # from another directory, as a job started elsewhere, the import answers this checkout
    where = subprocess.run([sys.executable, "-c", "import prism_megatron; print(prism_megatron.__file__)"],
                           env=env, cwd="/", capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).resolve().parents[1] == Path(root)
