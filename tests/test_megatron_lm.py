"""Megatron-LM's own `pretrain_gpt.py` (core_v0.16.1, from ../shared/vendor/), unmodified, as a rank of
an 8192-rank virtual world on CPU, through `prism-megatron launch`.

The archive holds `megatron/training` and the script; `megatron.core` is the installed wheel (the
same release). Tiny model, mock data, local transformer implementation, TP8 x PP16 x DP64."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHIVE = Path(os.environ.get(
    "PRISM_MEGATRON_LM_ARCHIVE",
    REPO.parent / "shared" / "vendor" / "megatron-lm-core_v0.16.1-training.tar.gz"))

# The vendor README's plain command, shrunk: 16 layers (one per stage), hidden 64, sequence 32.
ARGS = ["--num-layers", "16", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "64",
        "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--transformer-impl", "local", "--eval-iters", "0",
        "--eval-interval", "1000", "--log-interval", "1", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-persist-layer-norm", "--no-rope-fusion",
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*2 \|.*lm loss: ([0-9.E+-]+|nan|inf)")


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory) -> Path:
    """The archive extracted once: a folder with pretrain_gpt.py and megatron/training."""
    assert ARCHIVE.is_file(), (f"{ARCHIVE} is missing: Megatron-LM's training code comes from "
                               "../shared/vendor/ (or set PRISM_MEGATRON_LM_ARCHIVE)")
    folder = tmp_path_factory.mktemp("megatron-lm")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(folder, filter="data")
    assert (folder / "pretrain_gpt.py").is_file()
    return folder


def _launch(folder: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join([str(folder), str(REPO)]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "prism_megatron.cli", "launch", *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=folder)


def _losses(output: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(output)}


def test_a_middle_stage_rank_trains_two_iterations_of_the_8192_rank_job(megatron_lm, tmp_path):
    """Rank 4711: TP rank 7, DP rank 12, stage 9 of 16. Megatron sees WORLD_SIZE 8192 and RANK 4711
    (its validate_args passes), its CUDA assert and device queries are the CPU runtime's, and the
    hooks count its two forward-backward passes."""
    summary = tmp_path / "summary.json"
    proc = _launch(megatron_lm, "--", "pretrain_gpt.py", *ARGS, "--prism-virtual-world-size", "8192",
                   "--prism-sandbox-ranks", "4711", "--prism-summary-json", str(summary))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(summary.read_text())
    assert (got["virtual_world_size"], got["virtual_rank"], got["iterations"]) == (8192, 4711, 2)
    assert got["peak_tracked_bytes"] > 0
    dims = {row["dim"] for row in got["comm"] if row["calls"]}
    assert {"tp", "pp"} <= dims, got["comm"]  # its layer's TP all-reduces, its stage's sends/receives


def test_the_last_rank_prints_finite_losses(megatron_lm):
    """Rank 8191 owns the last stage: Megatron-LM's own log line carries its loss. Its TP source
    (rank 8184) is a ghost, so the rank loads the batch itself (hooks/megatron_lm.py); without that
    the do-train flag from ghost rank 0 stays 0 and no iteration runs."""
    proc = _launch(megatron_lm, "--", "pretrain_gpt.py", *ARGS, "--prism-virtual-world-size", "8192",
                   "--prism-sandbox-ranks", "8191")
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = _losses(proc.stdout + proc.stderr)
    assert sorted(losses) == [1, 2], (proc.stdout + proc.stderr)[-3000:]
    assert all(0 < loss < 20 for loss in losses.values()), losses


@pytest.mark.parametrize("sandboxes", [("8190", "8191"), ("8184", "8191")],
                         ids=["ghost-tp-source", "sandbox-tp-source"])
@pytest.mark.slow
def test_two_sandboxes_of_one_tp_group(megatron_lm, tmp_path, sandboxes):
    """`--nproc-per-node 2`: two processes, two last-stage ranks of one TP group, their TP collectives
    between them for real. With rank 8184 a sandbox, it is the TP source and its partner receives the
    batch from it; otherwise both load it. Each process sees its own RANK and WORLD_SIZE 8192."""
    summary = tmp_path / "summary.json"
    proc = _launch(megatron_lm, "--nproc-per-node", "2", "--", "pretrain_gpt.py", *ARGS,
                   "--prism-virtual-world-size", "8192", "--prism-sandbox-ranks", *sandboxes,
                   "--prism-summary-json", str(summary))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in sandboxes:
        got = json.loads((tmp_path / f"summary.rank{rank}.json").read_text())
        assert (got["virtual_rank"], got["iterations"]) == (int(rank), 2)
    losses = _losses(proc.stdout + proc.stderr)
    assert sorted(losses) == [1, 2] and all(0 < x < 20 for x in losses.values()), losses


def test_a_virtual_world_size_in_a_plain_process_is_one_line_not_a_hang(tmp_path):
    """WORLD_SIZE=8192 set by hand on one process (not under launch): the hook refuses at once,
    naming the mismatch, instead of waiting for 8191 processes."""
    script = tmp_path / "train.py"
    script.write_text(
        "import prism_megatron, torch.distributed as dist\n"
        "cfg = prism_megatron.load_config(['emulation.virtual_world_size=8192', "
        "'emulation.sandbox_ranks=[0]', "
        "'train.global_batch_size=8192', 'train.micro_batch_size=1'])\n"
        "prism_megatron.install(cfg)\n"
        "try:\n"
        "    dist.init_process_group('gloo')\n"
        "except prism_megatron.ConfigError as err:\n"
        "    print('refused:', err); raise SystemExit(2)\n")
    env = dict(os.environ, WORLD_SIZE="8192", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29597", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "8192 physical process(es) announced" in proc.stdout and "prism-megatron launch" in proc.stdout


@pytest.mark.slow
def test_capture_then_emulate_megatron_lms_own_script(megatron_lm, tmp_path):
    """`prism-megatron capture --out DIR -- pretrain_gpt.py ...` (the job as the user runs it, with a
    --train-iters the hooks cut to the recorded three), then `emulate` of rank 4711: six slices, the
    probes of the three classes of TP8 PP16 (first stage, middle stages, last stage), the other 122
    roles inferred; the sandbox reruns the script from the graph's meta."""
    job = [a if a != "2" or ARGS[i - 1] != "--train-iters" else "1000" for i, a in enumerate(ARGS)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=str(REPO))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "prism_megatron.cli", *args], capture_output=True,
                              text=True, env=env, timeout=900, cwd=megatron_lm)

    cap = cli("capture", "--out", str(tmp_path / "cap"), "--json", str(tmp_path / "cap.json"), "--",
              "pretrain_gpt.py", *job, "--prism-virtual-world-size", "8192")
    assert cap.returncode == 0, cap.stderr[-4000:]
    got = json.loads((tmp_path / "cap.json").read_text())
    assert (got["roles_total"], got["roles_captured"], got["roles_inferred"]) == (128, 6, 122)
    assert all(c["symmetric"] for c in got["classes"]) and len(got["classes"]) == 3
    from prism_megatron.graph import load_graph

    last = load_graph(str(tmp_path / "cap" / "slices" / "rank7687.prism"), check=False)
    assert last.meta["iterations_run"] == 3
    emu = cli("emulate", str(tmp_path / "cap" / "graph.prism"), "--out", str(tmp_path / "emu"),
              "--sandbox", "4711", "--json", str(tmp_path / "emu.json"))
    assert emu.returncode == 0, emu.stderr[-4000:]
    out = json.loads((tmp_path / "emu.json").read_text())
    row, = out["sandbox"]
    assert out["ranks"] == 8192 and row["virtual_rank"] == 4711
    assert row["iteration_time_s"] >= row["recorded_iteration_s"] > 0 and row["peak_allocated_bytes"] > 0


def test_megatron_lms_moe_layers_write_the_load_log_under_an_imbalance_model(megatron_lm, tmp_path):
    """The MoE load log (moe.log_path) and a routing model for Megatron-LM's own script: rank 4711 of
    8192 (TP8 PP16, EP8 with 8 experts, one per rank), 2 microbatches of 256 tokens, zipf(1.5)
    routing. One line per MoE layer and microbatch; its own assignments skewed as the model says; the
    tokens its expert receives are those of the 64 ranks the all-gather dispatcher gathers over
    (TP8 x EP8, ghosts routing as the model routes it)."""
    job = [a for a in ARGS]
    for flag, value in (("--seq-length", "256"), ("--max-position-embeddings", "256"),
                        ("--global-batch-size", "128")):
        job[job.index(flag) + 1] = value
    log = tmp_path / "moe.rank{rank}.jsonl"
    proc = _launch(megatron_lm, "--", "pretrain_gpt.py", *job, "--num-experts", "8", "--moe-router-topk", "2",
                   "--expert-model-parallel-size", "8", "--disable-bias-linear", "--sequence-parallel",
                   "--prism-virtual-world-size", "8192", "--prism-sandbox-ranks", "4711",
                   "--prism-moe-log-path", str(log), "--prism-moe-imbalance", "zipf(1.5)")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "moe.rank4711.jsonl").read_text().splitlines()]
    assert [(x["iteration"], x["microbatch"]) for x in lines] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for x in lines:
        (expert,) = x["experts"]
        per_expert = x["routed_per_expert"]
        assert x["routed"] == sum(per_expert) == 256 // 8 * 2  # its sequence-parallel share, top-2
        assert max(per_expert) >= 3 * x["routed"] / 8, per_expert  # zipf(1.5): one hot expert
        assert x["tokens"] == [64 * per_expert[expert]] and x["dropped"] == 0
        assert x["memory"]["peak_allocated_bytes"] > 0
    summary = json.loads((tmp_path / "moe.rank4711.jsonl.summary.json").read_text())
    assert summary["lines"] == 4 and "MoE load, rank 4711" in proc.stderr
