"""End to end: examples/pretrain_gpt.py as one rank of 8192, no-ghost equivalence, bad input.

These start real processes (python / torchrun) running megatron-core on CPU, so they take a while;
each asserts what a user relies on: the run completes with finite numbers, and emulation with no
ghosts reproduces the plain run exactly.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "pretrain_gpt.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

DENSE_8192 = ["--prism-virtual-world-size", "8192", "--tensor-model-parallel-size", "8",
              "--pipeline-model-parallel-size", "16", "--num-layers", "16", "--num-attention-heads",
              "8", "--global-batch-size", "128", "--micro-batch-size", "1"]
MOE_8192 = ["--prism-config", str(REPO / "configs" / "moe_8192.yaml")]


def _run(cmd, timeout_s=600):
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout_s, cwd=REPO)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Every stage (first, middle, last) and both models stay in the default run; the dense middle stage
# (its send and recv are the MoE middle stage's too) and the MoE first stage (the dense first stage's
# path, all_to_all checked by the other MoE cases) run in .ci/run's slow pass.
@pytest.mark.parametrize("name,args,rank,stage", [
    ("dense", DENSE_8192, 0, "first"),
    pytest.param("dense", DENSE_8192, 4711, "middle", marks=pytest.mark.slow),
    ("dense", DENSE_8192, 8191, "last"),
    # tied embeddings, first stage a ghost: the last stage's copy starts as the first stage's
    # embedding would (it stayed zero before: grad norm 0.0)
    ("dense-tied", [*DENSE_8192, "--prism-override", "model.tie_embeddings=true"], 8191, "last"),
    pytest.param("moe", MOE_8192, 0, "first", marks=pytest.mark.slow),
    ("moe", MOE_8192, 4100, "middle"),
    ("moe", MOE_8192, 8191, "last"),
])
def test_one_process_plays_a_rank_of_8192(tmp_path, name, args, rank, stage):
    out = tmp_path / "summary.json"
    proc = _run([sys.executable, EXAMPLE, "--device", "cpu", *args, "--prism-sandbox-ranks", str(rank),
                 "--prism-summary-json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["virtual_world_size"] == 8192 and summary["virtual_rank"] == rank
    assert len(summary["grad_norms"]) == 2
    assert all(math.isfinite(g) and g > 0 for g in summary["grad_norms"])
    if stage == "last":  # the loss lives on the last stage; elsewhere that stage is a ghost
        assert all(math.isfinite(x) for x in summary["losses"])
    else:
        assert summary["losses"] == [None, None]
    ops = {(row["op"], row["dim"]) for row in summary["comm"]}
    if stage != "first":
        assert ("recv", "pp") in ops
    if stage != "last":
        assert ("send", "pp") in ops
    assert any(op == "all_reduce" for op, _ in ops)
    if name == "moe":
        assert any(op == "all_to_all" for op, _ in ops)
    assert summary["peak_tracked_bytes"] >= summary["memory"]["by_category"]["params"] > 0
    assert summary["iteration_times_ms"] and "iteration 2/2" in proc.stdout


@pytest.mark.parametrize("name,args", [
    ("TP2 PP2", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ("DP2 EP2", ["--pipeline-model-parallel-size", "2", "--num-experts", "4",
                 "--expert-model-parallel-size", "2"]),
    # MoE over TP with sequence parallelism: megatron's uneven all-gather (padded on CPU)
    ("TP2 SP EP2", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "4",
                    "--expert-model-parallel-size", "2"]),
])
@pytest.mark.slow
def test_no_ghosts_reproduces_the_plain_run(tmp_path, name, args):
    common = ["--device", "cpu", "--global-batch-size", "8", "--train-iters", "2", *args]
    # The numbers must agree at once. Peak memory gets one more pair of runs: in two of three CI runs
    # (fresh 2-core machines) one rank's peak in one run moved by 16-48 KB, here and in
    # test_reschedule, while every repetition on this VM (under load, pinned to one core) was identical
    # byte for byte; the cause is not found. A real difference (a buffer the prism run keeps) shows in
    # both pairs.
    first_mismatch = None
    for attempt in range(2):
        results = {}
        for mode, extra in (("plain", []), ("prism", ["--prism-virtual-world-size", "4"])):
            proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                         "--master-port", str(_free_port()), EXAMPLE, *common, *extra,
                         "--prism-summary-json", str(tmp_path / f"{mode}.json")])
            assert proc.returncode == 0, proc.stderr[-3000:]
            results[mode] = [json.loads((tmp_path / f"{mode}.rank{r}.json").read_text()) for r in range(4)]
        for plain, prism in zip(results["plain"], results["prism"]):
            assert prism["losses"] == plain["losses"]  # bitwise: same floats
            assert prism["grad_norms"] == plain["grad_norms"]
            assert "comm" in prism and "comm" not in plain
        peaks = [(p["peak_tracked_bytes"], q["peak_tracked_bytes"]) for p, q in
                 zip(results["plain"], results["prism"])]
        categories = [(p["memory"]["peak_by_category"], q["memory"]["peak_by_category"]) for p, q in
                      zip(results["plain"], results["prism"])]
        if all(a == b for a, b in peaks) and all(a == b for a, b in categories):
            break
        first_mismatch = first_mismatch or peaks
        print(f"attempt {attempt + 1}: peak tracked bytes (plain, prism) per rank differ: {peaks}")
    else:
        pytest.fail(f"peak memory differs in two pairs of runs: {first_mismatch}, then {peaks}")


@pytest.mark.parametrize("args,needle", [
    (["--prism-virtual-world-size", "12", "--tensor-model-parallel-size", "8",
      "--num-attention-heads", "8"], "not divisible"),
    (["--prism-virtual-world-size", "8", "--prism-sandbox-ranks", "9"], "sandbox rank"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--prism-ghost-policy", "bogus", "--prism-virtual-world-size", "8"], "ghost_policy"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    proc = _run([sys.executable, EXAMPLE, "--device", "cpu", *args], timeout_s=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_cli_bad_override_is_one_line_and_exit_2():
    proc = _run([sys.executable, "-m", "prism_megatron.cli", "world", "parallel.tpp=2"], timeout_s=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "tpp" in proc.stderr


@pytest.mark.parametrize("args", [
    # interleaved 1F1B + distributed optimizer + overlap_grad_reduce, a middle stage of N=64
    ["--prism-virtual-world-size", "64", "--prism-sandbox-ranks", "21", "--tensor-model-parallel-size",
     "2", "--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2",
     "--num-layers", "8", "--use-distributed-optimizer", "--overlap-grad-reduce",
     "--global-batch-size", "32", "--micro-batch-size", "1"],
    # context parallel + tensor parallel with sequence parallel + pipeline, N=16
    ["--prism-virtual-world-size", "16", "--prism-sandbox-ranks", "3", "--context-parallel-size", "2",
     "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
     "--global-batch-size", "8"],
], ids=["interleaved-distopt-overlap", "cp-tp-sp-pp"])
def test_ghost_data_stays_finite_and_bounded_over_iterations(tmp_path, args):
    """Mirrored p2p data must not feed back into itself and grow over iterations."""
    out = tmp_path / "summary.json"
    proc = _run([sys.executable, EXAMPLE, "--device", "cpu", *args, "--train-iters", "6",
                 "--prism-summary-json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    norms = json.loads(out.read_text())["grad_norms"]
    assert len(norms) == 6 and all(math.isfinite(g) and g > 0 for g in norms)
    assert max(norms) < 3 * min(norms), norms


@pytest.mark.slow
def test_context_parallel_on_cpu_matches_the_unsplit_sequence(tmp_path):
    """CP2 (2 gloo processes) sees the same tokens as CP1: the mean of its ranks' losses and its
    gradient norm equal the CP1 run's (fp32 rounding aside)."""
    common = ["--device", "cpu", "--global-batch-size", "2", "--micro-batch-size", "2",
              "--train-iters", "2"]
    one = _run([sys.executable, EXAMPLE, *common, "--prism-summary-json", str(tmp_path / "cp1.json")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_free_port()), EXAMPLE, *common, "--context-parallel-size", "2",
                "--prism-summary-json", str(tmp_path / "cp2.json")])
    assert two.returncode == 0, two.stderr[-3000:]
    ref = json.loads((tmp_path / "cp1.json").read_text())
    ranks = [json.loads((tmp_path / f"cp2.rank{r}.json").read_text()) for r in range(2)]
    for it in range(2):
        mean = (ranks[0]["losses"][it] + ranks[1]["losses"][it]) / 2
        assert mean == pytest.approx(ref["losses"][it], rel=1e-6)
        assert ranks[0]["grad_norms"][it] == pytest.approx(ref["grad_norms"][it], rel=1e-5)


@pytest.mark.parametrize("sandbox,shared", [(["4", "5"], "tp"), (["1", "9"], "pp")])
def test_two_processes_play_two_ranks_among_ghosts(tmp_path, sandbox, shared):
    """Two sandbox ranks of N=16 (TP2 PP2 DP4) that share a group exchange real data over gloo and
    agree; the rest are ghosts. A pipeline pair gets the real loss of its (real) last stage."""
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                 str(_free_port()), EXAMPLE, "--device", "cpu", "--prism-virtual-world-size", "16",
                 "--prism-sandbox-ranks", *sandbox, "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", "2",
                 "--prism-summary-json", str(tmp_path / "s.json")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (json.loads((tmp_path / f"s.rank{r}.json").read_text()) for r in sandbox)
    assert a["grad_norms"] == b["grad_norms"] and all(math.isfinite(g) for g in a["grad_norms"])
    if shared == "pp":  # the last stage is real: both ranks log its loss
        assert a["losses"] == b["losses"] and all(math.isfinite(x) for x in a["losses"])
        assert ("send", "pp") in {(row["op"], row["dim"]) for row in a["comm"]}
