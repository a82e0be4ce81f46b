"""DeepSpeed-MoE expert groups routed by the imbalance models (moe/deepspeed_routing.py), on CPU.

- 4 real gloo processes (EP4) against one of them as the lone sandbox of a virtual world of 4 (the
  other three ghosts): the same MoE load log line for line (tokens per local expert, assignments,
  drops, capacity, memory at each layer's end) and the same tracked peak, dropless and with a
  capacity factor.
- EP64 at N = 64, one sandbox: the assignments are the model's, the dropless capacity is the largest
  modelled load over all 64 sources (the ghosts' part of DeepSpeed's all-reduce MAX), each local
  expert receives what the model sends it, and imbalance costs memory against balanced routing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("deepspeed")

from prism_megatron.config import load_config  # noqa: E402
from prism_megatron.util import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "deepspeed_train.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
SEQ, MBS = 16, 2
MODEL = ["--device", "cpu", "--hidden-size", "32", "--num-layers", "2", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--vocab-size", "256", "--micro-batch-size", str(MBS),
         "--moe-router-topk", "2",
         "--deepspeed-config", str(REPO / "configs" / "deepspeed" / "zero2.json")]


def _run(args, out: Path, name: str, nproc: int = 1) -> list[dict]:
    """Run the example; returns rank 1's (or the sandbox's) summary and MoE log lines."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", str(free_port())] if nproc > 1 else [sys.executable])
    proc = subprocess.run([*launcher, str(SCRIPT), *MODEL, *args,
                           "--prism-moe-log-path", str(out / f"{name}{{rank}}.jsonl"),
                           "--prism-summary-json", str(out / f"{name}{{rank}}.json")],
                          capture_output=True, text=True, env=ENV, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _differences(real: list[dict], virt: list[dict]) -> str:
    """Every differing field (nested keys joined by '.') of the log lines, real against emulated."""
    def flat(d, prefix=""):
        return {k2: v2 for k, v in d.items()
                for k2, v2 in (flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}).items()}
    out = []
    for i, (a, b) in enumerate(zip(real, virt)):
        fa, fb = flat(a), flat(b)
        out += [f"line {i} (iteration {a.get('iteration')}, microbatch {a.get('microbatch')}, layer "
                f"{a.get('layer')}) {k}: real {fa.get(k)} emulated {fb.get(k)}"
                for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
    return "\n".join(out) or f"{len(real)} real lines, {len(virt)} emulated"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("capacity", [None, "1.0"])
@pytest.mark.slow
def test_a_sandbox_among_ghost_experts_logs_and_holds_what_the_real_rank_does(tmp_path, capacity):
    args = ["--num-experts", "8", "--expert-model-parallel-size", "4", "--global-batch-size", "16",
            "--train-iters", "2", "--prism-moe-imbalance", "dirichlet(0.5)"]
    if capacity:
        args += ["--moe-expert-capacity-factor", capacity]
    _run(args, tmp_path, "real", nproc=4)
    _run([*args, "--prism-virtual-world-size", "4", "--prism-sandbox-ranks", "1"], tmp_path, "virt")
    real, virt = _lines(tmp_path / "real1.jsonl"), _lines(tmp_path / "virt1.jsonl")
    assert len(real) == len(virt) == 2 * 2 * 16 // (MBS * 4)  # iterations x layers x microbatches
    # tokens, assignments, drops, capacity, memory at every layer's end (the failure names the field)
    assert real == virt, _differences(real, virt)
    summaries = [json.loads((tmp_path / f"{n}1.json").read_text()) for n in ("real", "virt")]
    assert summaries[0]["peak_tracked_bytes"] == summaries[1]["peak_tracked_bytes"]
    assert summaries[0]["model_state_peak_bytes"] == summaries[1]["model_state_peak_bytes"]
    if capacity:  # capacity factor 1.0 of top-2: ceil(32 tokens / 8 experts x 2) = 8 per expert
        assert {line["capacity"] for line in real} == {8} and sum(line["dropped"] for line in real) > 0
    else:
        assert all(line["dropped"] == 0 for line in real)
        # the capacity follows the most loaded expert of the group, not of this rank's own tokens
        assert any(line["capacity"] > max(line["routed_per_expert"]) for line in real)


def test_ep64_dropless_capacity_and_expert_tokens_come_from_every_sources_modelled_load(tmp_path):
    n, experts, rank, topk = 64, 64, 37, 2
    base = ["--num-experts", str(experts), "--expert-model-parallel-size", str(n), "--global-batch-size",
            str(MBS * n), "--train-iters", "2", "--prism-virtual-world-size", str(n),
            "--prism-sandbox-ranks", str(rank)]
    _run([*base, "--prism-moe-imbalance", "dirichlet(0.3)"], tmp_path, "skew")
    _run([*base, "--prism-moe-imbalance", "force-balanced"], tmp_path, "flat")
    model = load_config(["model=tiny_moe", "moe.imbalance=dirichlet(0.3)"]).moe.model()  # default seed
    tokens = MBS * SEQ
    lines = _lines(tmp_path / f"skew{rank}.jsonl")
    assert len(lines) == 2 * 2  # iterations x layers, one microbatch each
    for line in lines:
        key = dict(experts=experts, tokens=tokens, topk=topk, layer=line["layer"],
                   microbatch=line["microbatch"], iteration=line["iteration"] - 1)
        loads = np.stack([model.counts(**key, source=s) for s in range(n)])
        assert line["routed_per_expert"] == loads[rank].tolist()
        assert line["capacity"] == int(loads.max())  # DeepSpeed's all-reduce MAX over the 64 sources
        assert line["capacity"] > loads[rank].max()  # ... which the sandbox alone would not know
        assert line["experts"] == [rank] and line["tokens"] == [int(loads[:, rank].sum())]
        assert line["dropped"] == 0
    flat = _lines(tmp_path / f"flat{rank}.jsonl")
    assert {line["capacity"] for line in flat} == {tokens * topk // experts}
    peak = {name: json.loads((tmp_path / f"{name}{rank}.json").read_text())["peak_tracked_bytes"]
            for name in ("skew", "flat")}
    assert peak["skew"] > peak["flat"]  # dropless buffers sized by the hottest expert of the group
