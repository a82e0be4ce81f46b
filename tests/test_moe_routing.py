"""Routing by an imbalance model through megatron-core's router-replay hook (moe/routing.py).

A real 4-process EP4 job (8 experts, top-2) routes by zipf(1.2): every expert's received tokens, as
the recorder logs them per layer and microbatch, are exactly the model's counts summed over the four
source ranks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from prism_megatron.graph import load_graph
from prism_megatron.moe.imbalance import Imbalance

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_experts_receive_exactly_the_modelled_tokens(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
         str(_port()), str(REPO / "examples" / "pretrain_gpt.py"), "--device", "cpu", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--num-layers", "2", "--num-experts", "8",
         "--moe-router-topk", "2", "--expert-model-parallel-size", "4", "--global-batch-size", "16",
         "--micro-batch-size", "2", "--train-iters", "3", "--prism-moe-imbalance", "zipf(1.2)",
         "--prism-trace-path", str(tmp_path / "rank{rank}.prism")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = Imbalance.parse("zipf(1.2)")
    tokens = 2 * 32  # micro-batch x sequence per source rank
    skew = []
    for rank in range(4):
        g = load_graph(str(tmp_path / f"rank{rank}.prism"), check=False)
        rg = g.graph_of(rank)
        assert len(rg.moe["layer"]) == 4  # 2 layers x 2 microbatches of the recorded iteration
        for j in range(len(rg.moe["layer"])):
            layer, mb = int(rg.moe["layer"][j]), int(rg.moe["microbatch"][j])
            got = rg.moe_tokens[rg.moe_ptr[j]:rg.moe_ptr[j + 1]]
            # the recorded iteration is the second of three (index 1)
            want = sum(model.counts(experts=8, tokens=tokens, topk=2, layer=layer, microbatch=mb,
                                    iteration=1, source=s) for s in range(4))[2 * rank:2 * rank + 2]
            np.testing.assert_array_equal(got, want)
            skew.extend(got.tolist())
    assert max(skew) > 3 * min(skew)  # zipf: some experts get several times what others get
