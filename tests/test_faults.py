"""Faults in the replay (faults/): stragglers, throttling, links, stalls; impact; fitting a log.

The synthetic graph (graph/synthetic.py) runs per stage all forwards (attention 1 ms, TP all-reduce,
MLP 1 ms, send) and then all backwards (1 ms, send), then the DP all-reduce. On a network that costs
nothing, a pipeline of p stages and m microbatches is a flow shop: forwards end at
sum_i F_i + (m - 1) max_i F_i on the last stage and the backwards take sum_i B_i + (m - 1) max_i B_i
after that, so the iteration time is hand-computable, with and without a straggler.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prism_megatron.faults.fit import fit_straggler, load_log
from prism_megatron.faults.impact import impact
from prism_megatron.faults.spec import FaultError, FaultSet, parse_faults
from prism_megatron.graph import load_graph, save_graph
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


def test_steady_state_periods_make_a_dp_stragglers_whole_loop_every_ranks_iteration_time():
    # DP4, one microbatch: forward 2 ms, backward 1 ms, DP all-reduce (free), optimizer 1 ms
    world = VirtualWorld(world_size=4)
    graph = synthetic_graph(world, microbatches=1, optimizer_s=1e-3)
    sim = Simulator(graph, FreeNetwork(), slowdown={1: 1.5})
    first = sim.run()
    # one iteration from a common start: the straggler's slow optimizer ends last, the others' early
    np.testing.assert_allclose(first.rank_times(), [5.5e-3, 6e-3, 5.5e-3, 5.5e-3], rtol=1e-9)
    # back to back, everyone waits for the straggler's whole loop (4.5 + 1.5 ms) every iteration
    np.testing.assert_allclose(sim.rank_periods(first), [6e-3] * 4, rtol=1e-9)
    clean = Simulator(graph, FreeNetwork())
    np.testing.assert_allclose(clean.rank_periods(clean.run()), [4e-3] * 4, rtol=1e-9)
    # a stall before each iteration is part of the stalled rank's own period, and everyone's
    stalled = Simulator(graph, FreeNetwork(), start_s={2: 1e-3})
    np.testing.assert_allclose(stalled.rank_periods(stalled.run()), [5e-3] * 4, rtol=1e-9)


def test_steady_state_periods_agree_between_classes_and_per_rank_replays():
    world = VirtualWorld(world_size=64, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=4, optimizer_s=2e-3)
    cost = load_cluster("dgx_h100").cost_model()
    kw = dict(slowdown={5: 1.5, 40: 1.2}, start_s={9: 1e-3})
    classes, ranks = Simulator(graph, cost, **kw), Simulator(graph, cost, per_rank=True, **kw)
    periods = classes.rank_periods(classes.run())
    np.testing.assert_allclose(periods, ranks.rank_periods(ranks.run()), rtol=1e-12)
    assert periods.min() >= classes.run().rank_times().min()


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
    sim = Simulator(graph, cost, slowdown={6: 1.7})
    truth = sim.run()
    rng = np.random.default_rng(0)
    compute = np.asarray([c.compute_s for c in truth.classes])[truth.class_of_rank]
    times = sim.rank_periods(truth)  # what each rank's own log shows, iterations back to back
    log = {"ranks": {str(r): {"iteration_s": list(times[r] * (1 + 0.002 * rng.standard_normal(5))),
                              "compute_s": list(compute[r] * (1 + 0.002 * rng.standard_normal(5)))}
                     for r in range(16)}}
    found = fit_straggler(graph, cost, load_log(log, 16))
    assert found["rank"] == 6 and found["factor"] == pytest.approx(1.7, rel=0.01) and found["identifiable"]
    assert found["error"] < 0.01 * found["no_fault_error"]
    only_times = {"ranks": {r: {"iteration_s": v["iteration_s"]} for r, v in log["ranks"].items()}}
    unsure = fit_straggler(graph, cost, load_log(only_times, 16))
    assert not unsure["identifiable"] and 6 in unsure["ties"] and len(unsure["ties"]) > 1


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_real_straggler_is_matched_by_the_emulation_with_the_same_fault(tmp_path):
    """Real data-parallel processes (4 where the machine has 4 cores, else 2: more processes than
    cores measure contention, not the fault), rank 1 slowed x1.5 for real (faults/inject.py: a
    sleep of half of each forward, backward and optimizer step), against one sandbox (rank 0)
    emulating the same world with the fault injected into the ghost rank 1 of the replay. The ghosts'
    graph is the clean job recorded on the same processes just before (rank 0's recording), so the
    replay's compute is the job's own.

    Checked: the fault is real (every real rank's faulted over clean iteration time > 1.10) and
    emulated (every emulated rank's steady-state period is the straggler's, > 1.25 x the clean replay of
    the same graph); each rank's emulated time is within 35 % of the real one (per run the median
    steady iteration, of two runs the less disturbed). The acceptance's 5 % per rank is the
    benchmark's figure (benchmarks/straggler_fidelity.py --graph recorded, medians over 5 repetitions on
    the 16-core H200 host: within 1.5 %). On the 2-core CI VM it is not a test's to make: whole runs
    move by up to 28 % from one minute to the next, the two processes share the host, and a process
    computes slower after a sleep, so the sleeping straggler's real effect was 1.17x to 1.81x for the
    1.5x fault; the same comparison gave -21 %, -12 %, +3..+5 %, +12 % and +19 % there in one morning.
    A fault the emulation lost (1.0x) or applied twice (2.25x) is caught all the same."""
    import os

    from prism_megatron.comm.cost import Calibration
    from prism_megatron.config import load_config
    from prism_megatron.config.loader import to_yaml
    from prism_megatron.emulate.run import Emulation
    from prism_megatron.util import free_port

    n = 4 if (os.cpu_count() or 1) >= 4 else 2
    fault = "slow(1, 1.5)"
    shape = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=8",
             "model.seq_length=128", "train.micro_batch_size=2", f"train.global_batch_size={4 * n}",
             "train.iters=6", "train.device=cpu", "emulation.sandbox_ranks=[]"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    faulted, clean_job = tmp_path / "real.yaml", tmp_path / "clean.yaml"
    faulted.write_text(to_yaml(load_config([*shape, f"faults.inject={fault}"])))
    clean_job.write_text(to_yaml(load_config(shape)))
    calibration = Calibration.from_json(
        (REPO / "benchmarks" / "results" / "calibration-cpu4.json").read_text())

    def real_run(config, tag, *extra):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                               "--master-port", str(free_port()), str(REPO / "examples" / "pretrain_gpt.py"),
                               "--prism-config", str(config),
                               "--prism-summary-json", str(tmp_path / f"{tag}-{{rank}}.json"), *extra],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [statistics.median(json.loads((tmp_path / f"{tag}-{r}.json").read_text())
                                  ["iteration_times_ms"][2:]) * 1e-3 for r in range(n)]

    best = {key: [math.inf] * n for key in ("real", "real_clean", "emulated", "emulated_clean")}

    def keep(key, values):
        best[key] = [min(a, b) for a, b in zip(best[key], values)]

    for rep in range(2):  # interference on a shared VM only adds time: the less disturbed of two
        keep("real_clean", real_run(clean_job, f"clean{rep}", "--prism-trace-path",
                                    str(tmp_path / f"rec{rep}" / "rank{rank}.prism"),
                                    "--prism-trace-selection", "node-median"))
        graph = str(tmp_path / f"rec{rep}" / "rank0.prism")
        keep("real", real_run(faulted, f"real{rep}"))
        run = Emulation(graph, str(tmp_path / f"emu{rep}"), ["0"], load_cluster("cpu_host"), calibration,
                        device="cpu", faults=fault).run()
        assert run["faults"] == fault and len(run["rank_iteration_time_s"]) == n
        keep("emulated", run["rank_iteration_time_s"])
        # the clean job's replay from the same graph (no sandbox: its live compute is this VM's noise)
        clean = Simulator(load_graph(graph), load_cluster("cpu_host").cost_model(calibration)).run()
        keep("emulated_clean", clean.rank_times())
    for rank in range(n):
        assert best["real"][rank] / best["real_clean"][rank] > 1.10, (rank, best)
        assert best["emulated"][rank] / best["emulated_clean"][rank] > 1.25, (rank, best)
        assert best["emulated"][rank] == pytest.approx(best["real"][rank], rel=0.35), (rank, best)
    # synchronous training: every rank's period is the straggler's loop, in the job and emulated
    assert max(best["real"]) / min(best["real"]) < 1.10, best
    assert max(best["emulated"]) / min(best["emulated"]) == pytest.approx(1.0, abs=1e-9), best


def test_telemetry_parses_nvidia_smi_samples_and_separates_the_active_part():
    from prism_megatron.faults.telemetry import parse, summarize

    lines = ["345, 80.5, 40, 0x0000000000000001", "345, 81.0, 40, 0x1", "garbage",
             "1980, 600.0, 60, 0x0", "1700, 700.0, 70, 0x0000000000000020"]
    samples = parse(lines, 0.0, [0.0, 0.1, 0.2, 0.3, 0.4])
    assert [s["sm_mhz"] for s in samples] == [345, 345, 1980, 1700] and samples[-1]["reasons"] == 0x20
    summary = summarize(samples)
    assert summary["samples"] == 4 and summary["active"]["samples"] == 2
    assert summary["active"]["sm_mhz_mean"] == 1840 and summary["active"]["capped_fraction"] == 0.5
