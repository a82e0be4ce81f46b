"""The replay engine: cost model formulas, exact equivalence classes, the DES, `simulate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bad_inputs import run_in_process  # cli.main in this process, a hang alarm armed

from prism_megatron.comm.cost import Calibration, CostModel, Placement, bus_bandwidth, bus_factor
from prism_megatron.graph import save_graph
from prism_megatron.graph.model import ExecutionGraph, RoleGraphBuilder, StringTable
from prism_megatron.graph.synthetic import synthetic_graph
from prism_megatron.sim.cluster import load_cluster
from prism_megatron.sim.des import SimulationError, Simulator
from prism_megatron.sim.sharing import shared_finish
from prism_megatron.world import VirtualWorld

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
H100 = load_cluster("dgx_h100")


@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 8, 2 * 7 / 8), ("all_gather", 8, 7 / 8), ("reduce_scatter", 16, 15 / 16),
    ("broadcast", 8, 1.0), ("reduce", 4, 1.0), ("all_to_all", 8, 7 / 8), ("send", 2, 1.0),
])
def test_bus_factors_are_nccl_tests_definitions(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)
    # nccl-tests: busbw = algbw * factor, algbw = size / time
    assert bus_bandwidth(op, n, 1 << 30, 0.01) == pytest.approx((1 << 30) / 0.01 * factor)


def test_large_ring_all_reduce_runs_at_link_bandwidth_and_small_ones_pick_low_latency():
    cost = load_cluster("dgx_a100").cost_model()  # no NVLS: a ring
    node = Placement(n=8, nodes=1, per_node=8)
    size = 1 << 30
    t = cost.time("all_reduce", size, node)
    busbw = bus_bandwidth("all_reduce", 8, size, t)
    assert 0.95 * 300e9 < busbw <= 300e9  # a ring's bus bandwidth is the link's
    nvls = H100.cost_model()
    assert nvls.choice("all_reduce", size, node)[0] == "nvls"
    assert 1.2 < bus_bandwidth("all_reduce", 8, size, nvls.time("all_reduce", size, node)) / 450e9 < 1.35
    cost = H100.cost_model()
    t = cost.time("all_reduce", size, node)
    assert cost.choice("all_reduce", 1024, Placement(n=64, nodes=8, per_node=8))[1] == "LL"
    assert cost.choice("all_gather", 1 << 30, node)[1] == "Simple"
    inter = Placement(n=64, nodes=64, per_node=1)
    assert cost.time("all_reduce", size, inter) > t  # NICs are slower than NVLink
    far = Placement(n=64, nodes=64, per_node=1, leaves=2)
    spine = CostModel(nvlink_Bps=450e9, net_Bps=50e9, nodes_per_leaf=32, oversubscription=2.0)
    assert spine.time("all_gather", size, far) > CostModel(nvlink_Bps=450e9, net_Bps=50e9).time(
        "all_gather", size, far)
    assert cost.time("all_reduce", size, Placement(n=1, nodes=1, per_node=1)) == 0.0


def test_calibration_fit_recovers_latency_and_bandwidth():
    sizes = (1 << 20, 1 << 24, 1 << 30)
    points = [{"op": "all_reduce", "n": 2, "link": "intra", "bytes": s,
               "time_s": 20e-6 + bus_factor("all_reduce", 2) * s / 300e9} for s in sizes]
    cal = Calibration(points=points)
    cal.fit()
    fit = cal.lookup("all_reduce", "intra", 1 << 26, 2)
    assert fit["latency_s"] == pytest.approx(20e-6, rel=1e-6) and fit["busbw_Bps"] == pytest.approx(300e9)
    flat = Calibration(points=[{"op": "send", "n": 2, "link": "intra", "bytes": b, "time_s": t}
                               for b, t in ((1024, 3e-4), (2048, 2.9e-4), (4096, 2.8e-4))])
    flat.fit(min_bytes=1024)  # no growth with size (noise, latency-bound): a flat segment, not none
    assert flat.lookup("send", "intra", 2048, 2)["latency_s"] == pytest.approx(2.9e-4)
    cost = CostModel(nvlink_Bps=1e9, net_Bps=1e9, calibration=Calibration.from_json(cal.to_json()))
    assert cost.time("all_reduce", 1 << 26, Placement(n=2, nodes=1, per_node=2)) == pytest.approx(
        20e-6 + (1 << 26) / 300e9)


@pytest.mark.parametrize("n,tp,pp", [(64, 2, 4), (128, 4, 4), (256, 8, 4), (256, 2, 8)])
@pytest.mark.parametrize("slowdown", [{}, {5: 1.5}, {0: 2.0, 37: 1.2}])
def test_classes_give_exactly_the_per_rank_times(n, tp, pp, slowdown):
    world = VirtualWorld(world_size=n, tp=tp, pp=pp)
    graph = synthetic_graph(world, microbatches=4)
    cost = H100.cost_model()
    classes = Simulator(graph, cost, slowdown=slowdown).run()
    ranks = Simulator(graph, cost, slowdown=slowdown, per_rank=True).run()
    assert len(ranks.classes) == n and len(classes.classes) < n
    np.testing.assert_array_equal(classes.rank_times(), ranks.rank_times())
    assert classes.iteration_s == ranks.iteration_s
    if not slowdown:
        assert len(classes.classes) == len(world.roles())  # one per role, whatever the DP size


def test_a_straggler_slows_its_pipeline_and_the_job():
    world = VirtualWorld(world_size=64, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=4)
    cost = H100.cost_model()
    base = Simulator(graph, cost).run()
    slow = Simulator(graph, cost, slowdown={5: 2.0}).run()
    assert slow.iteration_s > base.iteration_s
    times = slow.rank_times()
    assert times[5] >= base.iteration_s and times.max() == slow.iteration_s
    assert slow.critical_path and slow.critical_path[-1][3] == pytest.approx(slow.iteration_s)


def test_processor_sharing_of_one_link():
    assert shared_finish([(0.0, 1.0), (0.0, 1.0)]) == [2.0, 2.0]
    assert shared_finish([(0.0, 2.0), (1.0, 1.0)]) == pytest.approx([3.0, 3.0])
    assert shared_finish([(0.0, 1.0), (5.0, 1.0)]) == [1.0, 6.0]
    assert shared_finish([(0.0, 1.0), (0.5, 0.0)]) == [1.0, 0.5]
    assert shared_finish([(0.0, 3.0), (0.0, 1.0), (0.0, 1.0)]) == pytest.approx([5.0, 3.0, 3.0])


def _two_transfers(serial: bool) -> ExecutionGraph:
    """One role of 16 data-parallel ranks on 2 nodes: a 1 GiB all-reduce and a 1 GiB all-gather on
    two streams, independent (`serial`: the second waits for the first)."""
    world = VirtualWorld(world_size=16)
    strings = StringTable()
    (role,) = world.roles()
    b = RoleGraphBuilder(role, 0, strings)
    first = b.comm("all_reduce", dim="dp", nbytes=1 << 30, dtype="fp32", seq=0, stream="grads",
                   start_s=0.0, duration_s=0.0)
    b.comm("all_gather", dim="dp", nbytes=1 << 30, dtype="fp32", seq=1, stream="params", start_s=0.0,
           duration_s=0.0, deps=[first] if serial else [])
    return ExecutionGraph(world=world, roles={role: b.build()}, strings=strings.strings)


def test_concurrent_transfers_on_one_link_share_its_bandwidth():
    cost = H100.cost_model()
    inter = Placement(n=16, nodes=2, per_node=8)
    (la, xa, link_a), (lb, xb, link_b) = (cost.parts(op, 1 << 30, inter)
                                          for op in ("all_reduce", "all_gather"))
    assert link_a == link_b == "inter" and xa > 10 * la
    graph = _two_transfers(serial=False)
    alone = Simulator(graph, cost, share_bandwidth=False).run()
    shared = Simulator(graph, cost).run()
    assert alone.iteration_s == pytest.approx(max(la + xa, lb + xb))
    assert shared.iteration_s == pytest.approx(max(shared_finish([(la, xa), (lb, xb)])))
    assert shared.iteration_s > 1.4 * alone.iteration_s and shared.shared_ops == 2
    assert shared.sharing_passes >= 2
    serial = _two_transfers(serial=True)  # one after the other: nothing to share
    assert Simulator(serial, cost).run().iteration_s == pytest.approx(la + xa + lb + xb)


def test_unmatched_communication_is_a_deadlock_with_a_clear_error():
    world = VirtualWorld(world_size=16, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=2)
    other = synthetic_graph(world, microbatches=3)  # stage 1 expects one more microbatch
    for role in [r for r in graph.roles if r.pp == 1]:
        graph.roles[role] = other.roles[role]
    graph.strings = other.strings  # same table layout: synthetic graphs intern identically
    with pytest.raises(SimulationError, match="deadlocks"):
        Simulator(graph, H100.cost_model()).run()


def test_simulate_command_output_contract(tmp_path, capsys):
    """`prism-megatron simulate` as its entry point runs it (cli.main, in this process: the command's
    code whole; tests/test_bad_inputs.py runs the entry point in real processes)."""
    world = VirtualWorld(world_size=256, tp=4, pp=4)
    path = tmp_path / "g.prism"
    save_graph(synthetic_graph(world, microbatches=4), str(path))
    code, err = run_in_process(
        ["simulate", str(path), "cluster=dgx_a100", "slowdown.17=1.3", "--json", str(tmp_path / "s.json"),
         "--csv", str(tmp_path / "r.csv"), "--perfetto", str(tmp_path / "t.json"), "--ranks", "0,17"], capsys)
    assert code == 0, err[-2000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    for key in ("iteration_time_s", "tokens_per_s_per_gpu", "mfu", "ranks", "classes", "sim_wall_s",
                "per_class"):
        assert key in summary
    assert summary["ranks"] == 256 and summary["cluster"] == "dgx_a100"
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert len(rows) == 257 and rows[0].startswith("rank,class,iteration_s")
    per_rank = {int(r.split(",")[0]): float(r.split(",")[2]) for r in rows[1:]}
    assert max(per_rank.values()) == pytest.approx(summary["iteration_time_s"])
    trace = json.loads((tmp_path / "t.json").read_text())
    assert trace["otherData"]["source"] == "simulated"
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 17}


@pytest.mark.parametrize("args,message", [
    (["cluster=nope"], "not found"),
    (["cluster.nic_gbps=100"], "did you mean cluster.nic_Gbps"),
    (["slowdown.x=2"], "slowdown.<rank>=<factor>"),
    (["slowdown.3=0"], "must be > 0"),
    (["slowdown.9999=2"], "outside the virtual world"),
    (["clustr=dgx_a100"], "did you mean cluster"),
    (["microbatches=0"], "positive number of microbatches"),
    (["microbatches=8"], "no pipeline spans"),
])
def test_simulate_bad_input_is_one_line_and_exit_2(tmp_path, args, message, capsys):
    path = tmp_path / "g.prism"
    save_graph(synthetic_graph(VirtualWorld(world_size=16, tp=2, pp=4)), str(path))
    code, err = run_in_process(["simulate", str(path), *args], capsys)  # real processes: test_bad_inputs
    assert code == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.slow
def test_calibrate_on_cpu_measures_every_op_and_group_size(tmp_path):
    out = tmp_path / "cal.json"
    proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "calibrate", "--device", "cpu",
                           "--nproc", "2", "--min-bytes", "1KiB", "--max-bytes", "8KiB", "--out", str(out)],
                          capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    ops = {(p["op"], p["n"]) for p in data["points"]}
    assert ops == {(op, 2) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                      "all_to_all", "send")}
    assert {p["bytes"] for p in data["points"]} == {1024, 2048, 4096, 8192}
    assert all(p["time_s"] > 0 for p in data["points"]) and len(data["table"]) == len(data["points"])
    cal = Calibration.from_json(out.read_text())
    cal.fit(min_bytes=1024)
    assert cal.lookup("all_reduce", "intra", 4096, 2)["busbw_Bps"] > 0


@pytest.mark.parametrize("args,message", [
    (["--max-bytes", "lots"], "smallest first"),
    (["--min-bytes", "8KiB", "--max-bytes", "1KiB"], "smallest first"),
    (["--nproc", "1"], "2 or more processes"),
])
def test_calibrate_bad_input_is_one_line_and_exit_2(tmp_path, args, message, capsys):
    code, err = run_in_process(["calibrate", "--device", "cpu", "--out", str(tmp_path / "c.json"), *args],
                               capsys)
    assert code == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "c.json").exists()
