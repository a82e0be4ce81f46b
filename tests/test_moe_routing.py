"""Routing by an imbalance model through megatron-core's router-replay hook (moe/routing.py).

A real 4-process EP4 job (8 experts, top-2) routes by zipf(1.2): every expert's received tokens, as
the recorder logs them per layer and microbatch, are exactly the model's counts summed over the four
source ranks; the hottest rank run alone as a sandbox receives the same tokens and reaches the same
peak memory, byte for byte.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prism_megatron.graph import load_graph
from prism_megatron.moe.imbalance import Imbalance

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


JOB = ["--device", "cpu", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--num-layers", "2", "--num-experts", "8", "--moe-router-topk", "2",
       "--expert-model-parallel-size", "4", "--global-batch-size", "16", "--micro-batch-size", "2",
       "--train-iters", "3", "--prism-moe-imbalance", "zipf(1.2)"]
EXAMPLE = str(REPO / "examples" / "pretrain_gpt.py")


def _tokens_match_the_model(path: str, rank: int) -> list[int]:
    model = Imbalance.parse("zipf(1.2)")
    rg = load_graph(path, check=False).graph_of(rank)
    assert len(rg.moe["layer"]) == 4  # 2 layers x 2 microbatches of the recorded iteration
    seen = []
    for j in range(len(rg.moe["layer"])):
        layer, mb = int(rg.moe["layer"][j]), int(rg.moe["microbatch"][j])
        got = rg.moe_tokens[rg.moe_ptr[j]:rg.moe_ptr[j + 1]]
        # tokens = micro-batch x sequence per source rank; the recorded iteration is the 2nd (index 1)
        want = sum(model.counts(experts=8, tokens=2 * 32, topk=2, layer=layer, microbatch=mb, iteration=1,
                                source=s) for s in range(4))[2 * rank:2 * rank + 2]
        np.testing.assert_array_equal(got, want)
        seen.extend(got.tolist())
    return seen


@pytest.mark.slow
def test_experts_receive_exactly_the_modelled_tokens_real_and_as_sandbox(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
         str(_port()), EXAMPLE, *JOB, "--prism-trace-path", str(tmp_path / "rank{rank}.prism"),
         "--prism-summary-json", str(tmp_path / "real{rank}.json")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skew = []
    for rank in range(4):
        skew += _tokens_match_the_model(str(tmp_path / f"rank{rank}.prism"), rank)
    assert max(skew) > 3 * min(skew)  # zipf: some experts get several times what others get
    peaks = {r: json.loads((tmp_path / f"real{r}.json").read_text())["peak_tracked_bytes"] for r in range(4)}
    hottest = max(peaks, key=peaks.get)
    # The hottest rank alone, its 3 EP peers ghosts: the ghosts' token counts come from the model
    # (not from mirroring the sandbox), so it receives and allocates what the real rank did.
    alone = subprocess.run(
        [sys.executable, EXAMPLE, *JOB, "--prism-virtual-world-size", "4", "--prism-sandbox-ranks",
         str(hottest), "--prism-trace-path", str(tmp_path / "sandbox{rank}.prism"),
         "--prism-summary-json", str(tmp_path / "sandbox.json"),
         "--prism-moe-log-path", str(tmp_path / "load{rank}.jsonl")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert alone.returncode == 0, alone.stderr[-3000:]
    _tokens_match_the_model(str(tmp_path / f"sandbox{hottest}.prism"), hottest)
    assert json.loads((tmp_path / "sandbox.json").read_text())["peak_tracked_bytes"] == peaks[hottest]
    # the load log: one line per layer and microbatch of every iteration, the model's tokens in each
    lines = [json.loads(x) for x in (tmp_path / f"load{hottest}.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 2 * 2
    model = Imbalance.parse("zipf(1.2)")
    for row in lines:
        want = sum(model.counts(experts=8, tokens=64, topk=2, layer=row["layer"],
                                microbatch=row["microbatch"], iteration=row["iteration"] - 1, source=s)
                   for s in range(4))
        assert row["tokens"] == want[row["experts"]].tolist() and row["dropped"] == 0
        assert row["memory"]["allocated_bytes"] > 0 and row["memory"]["by_category"]["params"] > 0
    summary = json.loads((tmp_path / f"load{hottest}.jsonl.summary.json").read_text())
    assert [x["layer"] for x in summary["layers"]] == [1, 2] and "MoE load, rank" in alone.stderr


def test_replay_of_a_logged_run_gives_a_sandbox_the_real_tokens(tmp_path):
    """A real EP4 run with the model's own (learned) router logs its routing; a sandbox replaying that
    log receives, layer by layer and microbatch by microbatch, what the real rank received."""
    own = [a for a in JOB if a not in ("--prism-moe-imbalance", "zipf(1.2)")]
    real = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
         str(_port()), EXAMPLE, *own, "--prism-moe-log-path", str(tmp_path / "real{rank}.jsonl")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert real.returncode == 0, real.stderr[-3000:]
    replayed = subprocess.run(
        [sys.executable, EXAMPLE, *own, "--prism-moe-imbalance", f"replay({tmp_path / 'real{rank}.jsonl'})",
         "--prism-virtual-world-size", "4", "--prism-sandbox-ranks", "2", "--prism-moe-log-path",
         str(tmp_path / "replay{rank}.jsonl")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert replayed.returncode == 0, replayed.stderr[-3000:]

    def tokens(path):
        return {(r["iteration"], r["microbatch"], r["layer"]): r["tokens"]
                for r in map(json.loads, path.read_text().splitlines())}

    want, got = tokens(tmp_path / "real2.jsonl"), tokens(tmp_path / "replay2.jsonl")
    assert len(got) == 12 and got == want


@pytest.mark.slow
def test_with_a_capacity_factor_a_sandbox_receives_the_kept_tokens_the_real_rank_receives(tmp_path):
    """megatron drops what exceeds the capacity (probs policy); the ghosts' counts in the dispatcher's
    exchange are then the kept ones, min(load, capacity), so the sandbox's experts get what the real
    rank's got."""
    job = [*JOB, "--moe-expert-capacity-factor", "1.0",
           "--prism-moe-log-path", str(tmp_path / "{rank}.jsonl")]
    real = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
         str(_port()), EXAMPLE, *job, "--prism-summary-json", str(tmp_path / "real{rank}.json")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert real.returncode == 0, real.stderr[-3000:]
    rank = 3
    real_lines = [json.loads(x) for x in (tmp_path / f"{rank}.jsonl").read_text().splitlines()]
    (tmp_path / f"{rank}.jsonl").rename(tmp_path / "real.jsonl")
    alone = subprocess.run(
        [sys.executable, EXAMPLE, *job, "--prism-virtual-world-size", "4", "--prism-sandbox-ranks", str(rank),
         "--prism-summary-json", str(tmp_path / "sandbox.json")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert alone.returncode == 0, alone.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / f"{rank}.jsonl").read_text().splitlines()]
    assert sum(x["dropped"] for x in real_lines) > 0  # the capacity bites
    capacity = 2 * 32 * 2 // 8  # ceil(tokens x top-k / experts x 1.0) per source
    for got, want in zip(lines, real_lines, strict=True):
        assert got["tokens"] == want["tokens"] and max(want["tokens"]) <= 4 * capacity
        assert (got["routed"], got["dropped"]) == (want["routed"], want["dropped"])
    assert (json.loads((tmp_path / "sandbox.json").read_text())["peak_tracked_bytes"]
            == json.loads((tmp_path / f"real{rank}.json").read_text())["peak_tracked_bytes"])
