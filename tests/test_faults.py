"""Faults in the replay (faults/): stragglers, throttling, links, stalls; impact; fitting a log.

The synthetic graph (graph/synthetic.py) runs per stage all forwards (attention 1 ms, TP all-reduce,
MLP 1 ms, send) and then all backwards (1 ms, send), then the DP all-reduce. On a network that costs
nothing, a pipeline of p stages and m microbatches is a flow shop: forwards end at
sum_i F_i + (m - 1) max_i F_i on the last stage and the backwards take sum_i B_i + (m - 1) max_i B_i
after that, so the iteration time is hand-computable, with and without a straggler.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prism_megatron.faults.fit import fit_straggler, load_log
from prism_megatron.faults.impact import impact
from prism_megatron.faults.spec import FaultError, FaultSet, parse_faults
from prism_megatron.graph import save_graph
from prism_megatron.graph.synthetic import synthetic_graph
from prism_megatron.sim.cluster import load_cluster
from prism_megatron.sim.des import Simulator
from prism_megatron.world import VirtualWorld

REPO = Path(__file__).resolve().parents[1]


class FreeNetwork:
    """A network whose transfers take no time: only compute sets the pace."""

    def parts(self, op, nbytes, placement):
        return 0.0, 0.0, "intra"


def _flow_shop_s(forward: list[float], backward: list[float], m: int) -> float:
    return (sum(forward) + (m - 1) * max(forward)) + (sum(backward) + (m - 1) * max(backward))


@pytest.mark.parametrize("dp", [32, 64])
def test_a_straggler_at_8192_costs_what_the_hand_computed_critical_path_says(dp):
    pp, tp, m = 16, 8, 8
    world = VirtualWorld(world_size=tp * pp * dp, tp=tp, pp=pp)
    graph = synthetic_graph(world, microbatches=m)
    rank = 4711 % world.world_size
    stage = world.coords(rank)["pp"]
    report = impact(graph, FreeNetwork(), FaultSet.parse(f"slow({rank}, 1.5)", world.world_size, 8))
    base = _flow_shop_s([2e-3] * pp, [1e-3] * pp, m)  # (p + m - 1)(F + B) = 69 ms
    # the straggler's TP group waits for it at every forward all-reduce: the stage's forward takes
    # 1.5 + 1.5 ms; its backward (no TP sync) is slower on its own lane only, which the DP
    # all-reduce then makes everyone's
    slow_f = [3e-3 if s == stage else 2e-3 for s in range(pp)]
    slow_b = [1.5e-3 if s == stage else 1e-3 for s in range(pp)]
    assert report["iteration_s_without"] == pytest.approx(base, rel=1e-9)
    assert report["iteration_s_with_worst"] == pytest.approx(_flow_shop_s(slow_f, slow_b, m), rel=0.01)
    # classes split only around the straggler, by the same count at any data-parallel size
    assert report["classes_without"] == tp * pp
    assert report["classes_with"] == 2 * tp * pp
    assert report["critical_path_with"][0]["representative"] == rank
    assert report["critical_path_through_faulted_s"] > 0.5 * report["iteration_s_with_worst"]
    waits = report["per_rank"]["added_wait_s"]
    assert waits[rank] == pytest.approx(0.0, abs=1e-12)  # the straggler itself waits as before ...
    assert report["ranks_waiting_longer"] == world.world_size - 1  # ... everyone else longer


@pytest.mark.parametrize("faults", ["slow(5, 1.5)", "link(5, 3)", "link(node1, 2); slow(37, 1.2)",
                                    "stall(9, 0.002, 1)"])
def test_classes_give_exactly_the_per_rank_times_under_faults(faults):
    world = VirtualWorld(world_size=64, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=4)
    cost = load_cluster("dgx_h100").cost_model()
    p = FaultSet.parse(faults, 64, 8).at(0, 0.0)
    kw = dict(slowdown=p.compute, link_slowdown=p.link, start_s=p.start_s)
    classes = Simulator(graph, cost, **kw).run()
    ranks = Simulator(graph, cost, per_rank=True, **kw).run()
    np.testing.assert_array_equal(classes.rank_times(), ranks.rank_times())
    base = Simulator(graph, cost).run()
    assert classes.iteration_s > base.iteration_s and len(classes.classes) < 64


def test_time_varying_faults_act_from_their_onset_and_in_their_windows():
    world = VirtualWorld(world_size=64, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=4)
    free = FreeNetwork()
    base = impact(graph, free, FaultSet.parse("slow(5, 1.0)", 64, 8))["iteration_s_without"]
    # a throttle after 3 iterations' worth of time: iterations 0-2 clean, 3 on throttled
    throttled = impact(graph, free, FaultSet.parse(f"throttle(5, 2, {3 * base - 1e-9})", 64, 8), iterations=6)
    times = throttled["iteration_s_with"]
    assert times[:3] == pytest.approx([base] * 3) and min(times[3:]) > 1.2 * base
    assert len(set(np.round(times[3:], 12))) == 1
    # a stall of 2 ms every 2nd iteration on a first-stage rank delays those iterations by exactly 2 ms
    stalled = impact(graph, free, FaultSet.parse("stall(0, 0.002, 2)", 64, 8), iterations=4)
    assert stalled["iteration_s_with"] == pytest.approx([base + 2e-3, base, base + 2e-3, base])
    # periodic: slowed in the first half of every 2-iteration period
    periodic = impact(graph, free, FaultSet.parse(f"periodic(5, 2, {2 * base}, {base / 2})", 64, 8),
                      iterations=2)
    assert periodic["iteration_s_with"][0] > base


@pytest.mark.parametrize("text,message", [
    ("slow(4711)", "slow takes (RANKS, FACTOR)"),
    ("fast(1, 2)", "KIND one of"),
    ("slow(1, 0)", "must be > 0"),
    ("slow(x, 2)", "expected a rank"),
    ("periodic(1, 2, 1, 5)", "DURATION_S <= PERIOD_S"),
])
def test_bad_fault_specs_say_what_and_how_to_fix(text, message):
    with pytest.raises(FaultError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_faults(text)
    with pytest.raises(FaultError, match="outside the virtual world"):
        FaultSet.parse("slow(node9, 2)", 64, 8)


def test_fit_finds_the_straggler_from_compute_times_and_admits_ties_from_iteration_times():
    world = VirtualWorld(world_size=16, tp=2, pp=2)
    graph = synthetic_graph(world, microbatches=4)
    cost = load_cluster("dgx_h100").cost_model()
    truth = Simulator(graph, cost, slowdown={6: 1.7}).run()
    rng = np.random.default_rng(0)
    compute = np.asarray([c.compute_s for c in truth.classes])[truth.class_of_rank]
    times = truth.rank_times()
    log = {"ranks": {str(r): {"iteration_s": list(times[r] * (1 + 0.002 * rng.standard_normal(5))),
                              "compute_s": list(compute[r] * (1 + 0.002 * rng.standard_normal(5)))}
                     for r in range(16)}}
    found = fit_straggler(graph, cost, load_log(log, 16))
    assert found["rank"] == 6 and found["factor"] == pytest.approx(1.7, rel=0.01) and found["identifiable"]
    assert found["error"] < 0.01 * found["no_fault_error"]
    only_times = {"ranks": {r: {"iteration_s": v["iteration_s"]} for r, v in log["ranks"].items()}}
    unsure = fit_straggler(graph, cost, load_log(only_times, 16))
    assert not unsure["identifiable"] and 6 in unsure["ties"] and len(unsure["ties"]) > 1


def test_the_faults_command_reports_impact_heatmap_and_fit(tmp_path):
    world = VirtualWorld(world_size=64, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=4)
    save_graph(graph, str(tmp_path / "g.prism"))
    cmd = [sys.executable, "-m", "prism_megatron.cli", "faults", str(tmp_path / "g.prism")]
    proc = subprocess.run([*cmd, "--inject", "slow(5, 1.5); link(node2, 2)", "--heatmap",
                           str(tmp_path / "h.png"), "--json", str(tmp_path / "i.json")],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "i.json").read_text())
    assert report["slowdown"] > 1 and len(report["per_rank"]["added_wait_s"]) == 64
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "critical path with" in proc.stdout
    truth = Simulator(graph, load_cluster("dgx_h100").cost_model(), slowdown={21: 1.4}).run()
    compute = np.asarray([c.compute_s for c in truth.classes])[truth.class_of_rank]
    (tmp_path / "log.json").write_text(json.dumps({"ranks": {str(r): {"compute_s": [compute[r]]}
                                                             for r in range(64)}}))
    fit = subprocess.run([*cmd, "--fit", str(tmp_path / "log.json"), "--json", str(tmp_path / "f.json")],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert fit.returncode == 0, fit.stderr
    assert json.loads((tmp_path / "f.json").read_text())["rank"] == 21 and "slow(21, 1.4" in fit.stdout
    for bad, message in ((["--inject", "slow(4711, 2)"], "outside the virtual world"),
                         (["--inject", "slow(1)"], "slow takes"), ([], "give --inject"),
                         (["--fit", str(tmp_path / "missing.json")], "not a readable JSON log")):
        proc = subprocess.run([*cmd, *bad], capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
