"""`prism-megatron moe-check`: per-rank peak memory under an imbalance model, verdict and exit code.

A Mixtral-shaped tiny MoE (8 experts, top-2) at N = 256 with EP8 on CPU. Under zipf(1.2) the hottest
rank is predicted from sandbox runs and confirmed by its own sandbox measurement; with a capacity below
its peak the check names it and exits 3; force-balanced routing under the same capacity passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism_megatron.moe.imbalance import Imbalance

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
JOB = ["model=tiny_moe", "emulation.virtual_world_size=256", "parallel.tp=1", "parallel.pp=1",
       "parallel.ep=8", "model.num_layers=2", "train.global_batch_size=512", "train.micro_batch_size=1",
       "train.iters=2", "train.device=cpu"]


def _check(tmp_path, *args):
    out = tmp_path / "verdict.json"
    proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "moe-check", *JOB, *args, "--out",
                           str(tmp_path / "runs"), "--json", str(out)],
                          capture_output=True, text=True, env=ENV, timeout=900, cwd=REPO)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
def test_skew_predicts_every_rank_and_a_small_capacity_is_an_oom_with_exit_3(tmp_path):
    ok, roomy = _check(tmp_path, "moe.imbalance=zipf(1.2)", "--capacity", "1GiB")
    assert ok.returncode == 0, ok.stderr[-3000:]
    peaks = roomy["per_rank_peak_bytes"]
    assert len(peaks) == 256 and roomy["oom_ranks"] == [] and roomy["imbalance"] == "zipf(1.2)"
    hottest = roomy["hottest_rank"]
    confirmed = roomy["confirmed"]
    assert confirmed["rank"] == hottest and confirmed["measured_peak_bytes"] == peaks[hottest]
    assert max(peaks) > min(peaks) * 1.1  # the skew shows in memory
    from prism_megatron.moe.pictures import read_png_size

    assert read_png_size(roomy["pictures"]["tokens"]) == (8 * 12, 2 * 12)  # experts x layers, 12 px cells
    assert read_png_size(roomy["pictures"]["peak_memory"]) == (8 * 6, 32 * 6)  # 256 ranks in rows of EP8
    assert len(roomy["tokens_per_expert"]) == 2 and sum(roomy["tokens_per_expert"][0]) == 8 * 32 * 2
    # two EP ranks the check did not run, loaded unlike every rank it ran: their own sandbox runs
    stage = roomy["model"]["stages"][0]
    ran = {int(r) for r in stage["measured"]}
    config = next((tmp_path / "runs").glob("rank*/config.yaml"))
    tokens = roomy["per_rank_tokens"]
    others = [r for r in range(8) if r not in ran and tokens[r] not in {tokens[m] for m in ran}][:2]
    assert len(others) == 2
    for rank in others:
        run = subprocess.run([sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), "--prism-config",
                              str(config), "--prism-sandbox-ranks", str(rank), "--prism-summary-json",
                              str(tmp_path / f"other{rank}.json"), "--prism-moe-log-path",
                              str(tmp_path / "load{rank}.jsonl")],
                             capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
        assert run.returncode == 0, run.stderr[-2000:]
        measured = json.loads((tmp_path / f"other{rank}.json").read_text())["peak_tracked_bytes"]
        assert abs(peaks[rank] / measured - 1) <= 0.02, (rank, peaks[rank], measured)
        # the sandbox's experts received exactly the model's tokens (from all 8 EP sources)
        lines = [json.loads(x) for x in (tmp_path / f"load{rank}.jsonl").read_text().splitlines()]
        model = Imbalance.parse("zipf(1.2)")
        for row in lines:
            want = sum(model.counts(experts=8, tokens=32, topk=2, layer=row["layer"],
                                    microbatch=row["microbatch"], iteration=row["iteration"] - 1, source=s)
                       for s in range(8))  # EP group of ranks 0..7 (order tp-cp-ep-dp-pp)
            assert row["tokens"] == want[row["experts"]].tolist()
        assert len(lines) == 2 * 2 * 2  # iterations x microbatches x MoE layers
    # a capacity between the coldest and the hottest rank: the hot ones run out
    capacity = (max(peaks) + min(peaks)) // 2
    bad, verdict = _check(tmp_path, "moe.imbalance=zipf(1.2)", "--capacity", str(capacity))
    assert bad.returncode == 3, bad.stderr[-3000:]
    assert hottest in verdict["oom_ranks"] and "OUT OF MEMORY" in bad.stdout
    assert all(peaks[r] > capacity for r in verdict["oom_ranks"])
    balanced, even = _check(tmp_path, "moe.imbalance=force-balanced", "--capacity", str(capacity))
    assert balanced.returncode == 0, balanced.stdout + balanced.stderr[-2000:]
    assert even["oom_ranks"] == [] and len(set(even["per_rank_peak_bytes"])) == 1


@pytest.mark.parametrize("args,message", [
    (["moe.imbalance=none", "--capacity", "1GiB"], "needs an MoE model and an imbalance model"),
    (["moe.imbalance=zipf(1.2)", "--capacity", "lots"], "expected a size"),
    (["moe.imbalance=pareto(2)"], "expected one of none, uniform"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message, capsys, monkeypatch):
    from test_bad_inputs import run_in_process  # cli.main in this process; real processes: test_bad_inputs

    monkeypatch.chdir(REPO)
    code, err = run_in_process(["moe-check", *JOB, *args, "--out", str(tmp_path / "runs"), "--json",
                                str(tmp_path / "verdict.json")], capsys)  # _check's command
    assert code == 2 and message in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1


def test_replayed_routing_reads_each_source_ranks_own_log(tmp_path):
    """moe.imbalance=replay(...): the tokens a rank's experts receive add up each source rank's own
    logged routing (a cache keyed without the source gave every source the first one's log)."""
    from prism_megatron.config import load_config
    from prism_megatron.commands.moe_check import rank_tokens
    from prism_megatron.world import VirtualWorld

    experts, tokens, topk, layers, microbatches = 8, 32, 2, 2, 2
    for rank in range(8):  # rank r routes its tokens to experts r and r + 1 (mod 8), every layer
        rows = [{"layer": layer, "microbatch": mb, "iteration": 1,
                 "routed_per_expert": [tokens if e in (rank % experts, (rank + 1) % experts) else 0
                                       for e in range(experts)]}
                for layer in range(1, layers + 1) for mb in range(microbatches)]
        (tmp_path / f"load{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(["model=tiny_moe", "emulation.virtual_world_size=8", "parallel.tp=1", "parallel.pp=1",
                       "parallel.ep=2", f"model.num_layers={layers}", "train.global_batch_size=16",
                       "train.micro_batch_size=1", "train.iters=2", "train.device=cpu",
                       f"moe.imbalance=replay({tmp_path}/load{{rank}}.jsonl)"])
    world = VirtualWorld(world_size=8, tp=1, pp=1, ep=2)
    table = rank_tokens(cfg, world)
    assert cfg.model.num_experts == experts and cfg.model.moe_router_topk == topk
    for rank in range(8):
        lo = world.coords(rank)["ep"] * (experts // 2)
        sources = world.group(rank, "ep")
        want = sum(sum(tokens for e in (s % experts, (s + 1) % experts) if lo <= e < lo + experts // 2)
                   for s in sources)
        assert (table[rank] == want).all(), (rank, sources, table[rank].tolist(), want)
