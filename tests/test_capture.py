"""Slicing capture against a real run recorded on every rank: same program, same memory, byte for byte.

The real run is 8 gloo processes (torchrun) each recording itself; the capture runs one process per
slice with every other rank a ghost. For each of the 8 ranks, the captured graph of its role must have
the same communication (op, group dim, bytes, dtype, sequence, p2p peer), the same module-level compute
sequence and dependencies, the same pipeline spans, and the same peak and per-category memory as that
rank's own recording and summary.
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

from prism_megatron.emulate.holds import read_plan

from prism_megatron.graph import load_graph
from prism_megatron.graph.model import COLUMNS, structure_hash

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "pretrain_gpt.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

CONFIGS = {
    # the acceptance config: TP2 PP2 DP2, two microbatches per iteration
    "tp2pp2dp2": dict(tp=2, pp=2, layers=2, gbs=8, mbs=2),
    # PP4 with one microbatch: stages 1 and 2 share a schedule, so half the roles are inferred
    "tp2pp4": dict(tp=2, pp=4, layers=4, gbs=2, mbs=2),
    # interleaved 1F1B: two virtual stages per rank, spans per (microbatch, chunk)
    "pp2vpp2dp4": dict(tp=1, pp=2, vpp=2, layers=4, gbs=16, mbs=2),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config_file(tmp_path: Path, c: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(
        f"emulation: {{virtual_world_size: 8}}\n"
        f"parallel: {{tp: {c['tp']}, pp: {c['pp']}, vpp: {c.get('vpp') or 'null'}}}\n"
        f"model: {{num_layers: {c['layers']}, hidden_size: 32, num_attention_heads: 4, seq_length: 16}}\n"
        f"train: {{global_batch_size: {c['gbs']}, micro_batch_size: {c['mbs']}, iters: 2, device: cpu}}\n")
    return path


def _program(graph, g) -> dict:
    """What a rank does, strings resolved, timings left out."""
    cols = g.columns
    text = {name: [graph.string(int(i)) for i in cols[name]] for name in ("name", "stream", "op", "dim",
                                                                         "dtype")}
    nodes = list(zip(cols["kind"].tolist(), *text.values(), cols["nbytes"].tolist(), cols["seq"].tolist(),
                     cols["peer_delta"].tolist()))
    spans = list(zip([graph.string(int(i)) for i in g.spans["name"]], g.spans["microbatch"].tolist(),
                     g.spans["chunk"].tolist(), g.spans["first"].tolist(), g.spans["last"].tolist()))
    return {"comm": [n for n in nodes if n[0] == 1], "compute": [n[1] for n in nodes if n[0] == 0],
            "nodes": nodes, "deps": (g.dep_ptr.tolist(), g.dep_idx.tolist()), "spans": spans}


# One layout in the default run; the others (each a real 8-process run and a capture of a minute or
# more) in .ci/run's slow pass.
@pytest.fixture(scope="module", params=[pytest.param(n, marks=() if n == "tp2pp2dp2" else pytest.mark.slow)
                                        for n in sorted(CONFIGS)])
def real_and_captured(request, tmp_path_factory):
    name, c = request.param, CONFIGS[request.param]
    tmp = tmp_path_factory.mktemp(name)
    config = _config_file(tmp, c)
    real = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--master-port",
         str(_free_port()), EXAMPLE, "--prism-config", str(config),
         "--prism-trace-path", str(tmp / "real" / "rank{rank}.prism"),
         "--prism-summary-json", str(tmp / "real" / "summary.json")],
        capture_output=True, text=True, env=ENV, timeout=900, cwd=REPO)
    assert real.returncode == 0, real.stderr[-3000:]
    cap = subprocess.run(
        [sys.executable, "-m", "prism_megatron.cli", "capture", "--config", str(config), "--out",
         str(tmp / "capture"), "--json", str(tmp / "capture.json"), "--workers", "2"],
        capture_output=True, text=True, env=ENV, timeout=900, cwd=REPO)
    assert cap.returncode == 0, cap.stderr[-3000:]
    summary = json.loads((tmp / "capture.json").read_text())
    return name, tmp, summary, load_graph(summary["graph_path"])


def test_summary_reports_the_capture(real_and_captured):
    name, _, summary, graph = real_and_captured
    c = CONFIGS[name]
    assert summary["roles_total"] == c["tp"] * c["pp"] == len(graph.roles)
    assert graph.world.vpp == c.get("vpp")
    assert summary["slices_run"] + summary["slices_reused"] == summary["roles_captured"]
    assert summary["roles_captured"] + summary["roles_inferred"] == summary["roles_total"]
    assert summary["wall_s"] > 0 and os.path.getsize(summary["graph_path"]) == summary["graph_bytes"]
    if name == "tp2pp4":  # stages 1 and 2: probes (1, tp0) and (2, tp1) agree, the other two inferred
        assert summary["roles_inferred"] == 2 and summary["slices_run"] == 6
        middle = next(k for k in summary["classes"] if k["roles"] == 4)
        assert middle["symmetric"] is True
        assert all(s.startswith("inferred:") for s in
                   (g.source for g in graph.roles.values() if g.source != "captured"))


@pytest.mark.parametrize("rank", range(8))
def test_captured_program_equals_the_real_rank(real_and_captured, rank):
    _, tmp, _, graph = real_and_captured
    real = load_graph(str(tmp / "real" / f"rank{rank}.prism"), check=False)
    mine = real.graph_of(rank)
    theirs = graph.graph_of(rank)
    a, b = _program(real, mine), _program(graph, theirs)
    assert a["comm"] == b["comm"], f"rank {rank}: collectives/p2p differ"
    assert a["compute"] == b["compute"], f"rank {rank}: module-level compute sequence differs"
    assert a["nodes"] == b["nodes"] and a["deps"] == b["deps"] and a["spans"] == b["spans"]
    assert structure_hash(mine, real.strings) == structure_hash(theirs, graph.strings)
    assert len(a["comm"]) > 0 and any(n[3] == "send" or n[3] == "recv" for n in a["comm"])
    assert {s[0] for s in a["spans"]} == {"forward", "backward"}
    assert {s[2] for s in a["spans"]} == set(range(graph.world.vpp or 1))  # every virtual stage


@pytest.mark.parametrize("rank", range(8))
def test_captured_memory_equals_the_real_rank_byte_for_byte(real_and_captured, rank):
    _, tmp, _, graph = real_and_captured
    summary = json.loads((tmp / "real" / f"summary.rank{rank}.json").read_text())
    g = graph.graph_of(rank)
    assert g.peak_bytes == summary["peak_tracked_bytes"] == summary["memory"]["peak_allocated_bytes"]
    assert g.peak_by_category == summary["memory"]["peak_by_category"]
    assert g.peak_by_category["params"] > 0 and g.peak_by_category["optimizer_state"] > 0
    assert g.memory_source == "tracker" and len(g.mem_bytes) == len(g.mem_t_s) > 0


def test_emulating_two_sandboxes_gives_their_real_memory_and_the_job_figures(real_and_captured, tmp_path):
    """Hybrid emulation of the captured job: the first and last stage's lowest ranks run for real (two
    processes, real gloo p2p between them), the other 6 ranks are replayed from the graph."""
    name, tmp, summary, graph = real_and_captured
    if name != "tp2pp2dp2":
        pytest.skip("one config is enough")
    proc = subprocess.run(
        [sys.executable, "-m", "prism_megatron.cli", "emulate", summary["graph_path"], "--out",
         str(tmp_path / "emu"), "--sandbox", "first-stage,last-stage", "cluster=cpu_host", "--json",
         str(tmp_path / "emu.json")], capture_output=True, text=True, env=ENV, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "emu.json").read_text())
    for key in ("iteration_time_s", "tokens_per_s_per_gpu", "mfu", "physical_fraction", "materialized_ghosts",
                "classes", "sandbox"):
        assert key in out
    assert out["ranks"] == 8 and out["physical_fraction"] == 2 / 8
    ranks = [row["virtual_rank"] for row in out["sandbox"]]
    assert ranks == [0, 4]  # order tp-cp-ep-dp-pp: stage 1 starts at rank 4
    for row in out["sandbox"]:
        real = json.loads((tmp / "real" / f"summary.rank{row['virtual_rank']}.json").read_text())
        assert row["peak_allocated_bytes"] == real["peak_tracked_bytes"]
        assert 0 < row["iteration_time_s"] <= out["iteration_time_s"]
    # ghosts that exchange data with a sandbox: its TP partner and DP ring neighbour; the PP
    # neighbour of each is the other sandbox
    assert out["materialized_ghosts"] == 4 and 2 < out["classes"] <= 8
    assert (tmp_path / "emu" / "emulation.trace.json").is_file()


def test_realtime_clock_holds_the_sandbox_as_the_replay_says(real_and_captured, tmp_path):
    """clock=realtime: the sandbox runs again with each communication held as the replay says (a
    sleep on CPU, until the later of its own and its ghosts' arrival plus the transfer) and its
    measured wall-clock iteration lands near the virtual figure (CPU timing noise allowed). Paced (as
    on GPU): the first sandbox run already holds each collective as the ghost-only replay says, and
    the holds belong to no node of its graph."""
    name, _, summary, graph = real_and_captured
    if name != "tp2pp2dp2":
        pytest.skip("one config is enough")
    proc = subprocess.run(
        [sys.executable, "-m", "prism_megatron.cli", "emulate", summary["graph_path"], "--out",
         str(tmp_path / "emu"), "--sandbox", "last-stage", "--clock", "realtime", "--pace", "on",
         "cluster=cpu_host", "--json", str(tmp_path / "emu.json")],
        capture_output=True, text=True, env=ENV, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "emu.json").read_text())
    (row,) = out["sandbox"]
    rank = row["virtual_rank"]
    plan = read_plan(str(tmp_path / "emu" / "delay_plan.json"), rank)
    sandbox = load_graph(str(tmp_path / "emu" / "sandbox" / f"rank{rank}.prism"), check=False)
    assert len(plan) == int((sandbox.graph_of(rank).columns["kind"] != 0).sum())
    assert any(h is not None and h.terms for h in plan)  # ghosts take part
    # the holds as the clock measured them, in every iteration after the setup
    waits = row["realtime_injected_waits"]
    assert waits["count"] > 0 and waits["planned_s"] > 0
    assert waits["measured_s"] > 0 and waits["error_pct"] is not None
    # the wall clock with the waits injected against the replay of the compute it recorded meanwhile
    # (a CPU computes slower after sleeping; that is in both), and against the virtual figure; CPU
    # timing on the shared 2-core VM: 24 % apart once in CI (41 against 54 ms); the GPU check (target
    # 1 %) is the benchmark's (benchmarks/fidelity.py --realtime)
    wall, replayed = row["realtime_iteration_s"], row["realtime_replay_iteration_s"]
    assert out["clock"] == "realtime" and abs(wall / replayed - 1) < 0.35, (wall, replayed)
    assert row["realtime_vs_replay_pct"] == pytest.approx((wall / replayed - 1) * 100)
    # iteration by iteration, in both runs: each pooled iteration's wall against the replay of its
    # own durations (a stall stays in its own iteration on both sides)
    for run_name in ("realtime", "paced"):
        own = row[f"{run_name}_own_iterations"]
        assert len(own) >= 1 and all(abs(x["wall_s"] / x["replay_s"] - 1) < 0.35 for x in own), own
        assert [x["iteration"] for x in own] == sorted(x["iteration"] for x in own)
        assert row[f"{run_name}_vs_own_iterations_pct"] == pytest.approx(np.median([x["err_pct"] for x in own]))
    # against the virtual figure of the first run: this VM's CPU runs at one of two speeds (1.75x
    # apart, in phases of seconds), and the second run's compute over the first's (the factor) says
    # which one each saw; -51 % once in CI with a faster second run
    factor = row["realtime_compute_factor"]
    assert factor > 0
    ratio = 1 + row["realtime_vs_virtual_pct"] / 100
    assert 0.65 * min(1.0, factor) < ratio < 1.4 * max(1.0, factor), row
    # the compute measured at the duty cycle, as a fault profile the replay takes back
    if abs(factor - 1) > 0.01:
        from prism_megatron.faults.spec import parse_faults

        (fault,) = parse_faults(out["measured_faults"])
        assert (fault.kind, fault.ranks, fault.factor) == ("slow", str(rank), pytest.approx(factor, rel=1e-3))
    else:
        assert out["measured_faults"] is None
    assert out["paced"]
    assert len(read_plan(str(tmp_path / "emu" / "pace_plan.json"), rank)) == len(plan)
    run = json.loads((tmp_path / "emu" / "sandbox" / f"summary{rank}.json").read_text())
    held_s = run["injected_waits"]["measured_s"] / len(run["iteration_times_ms"])  # per iteration
    assert held_s > 0
    # the paced run's compute excludes its holds: its nodes' durations sum to well under its wall time
    cols = sandbox.graph_of(rank).columns
    assert float(cols["duration_s"].sum()) < _span(cols) - 0.5 * held_s


def _span(cols) -> float:
    return float((cols["start_s"] + cols["duration_s"]).max() - cols["start_s"].min())


@pytest.mark.parametrize("args,message", [
    (["--sandbox", "middle-stage"], "expected a virtual rank or one of"),
    (["--sandbox", "99"], "outside the virtual world of 8"),
])
def test_emulate_bad_sandbox_is_one_line_and_exit_2(real_and_captured, tmp_path, args, message, capsys,
                                                    monkeypatch):
    from test_bad_inputs import run_in_process  # cli.main in this process; real processes: test_bad_inputs

    name, _, summary, _ = real_and_captured
    if name != "tp2pp2dp2":
        pytest.skip("one config is enough")
    monkeypatch.chdir(REPO)
    code, err = run_in_process(["emulate", summary["graph_path"], "--out", str(tmp_path / "emu"), *args], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_graph_columns_are_well_formed(real_and_captured):
    _, _, _, graph = real_and_captured
    for g in graph.roles.values():
        assert set(g.columns) == set(COLUMNS)
        assert np.all(g.columns["duration_s"] >= 0) and np.all(np.diff(g.columns["start_s"]) >= -1e-9)


def test_exports_of_the_captured_graph(real_and_captured, tmp_path, capsys):
    from test_bad_inputs import run_in_process  # the command's entry point, in this process

    name, _, summary, graph = real_and_captured
    code, err = run_in_process(["export", summary["graph_path"], "--ranks", "0,7", "--perfetto",
                                str(tmp_path / "t.json"), "--chakra", str(tmp_path / "et")], capsys)
    assert code == 0, err[-2000:]
    doc = json.loads((tmp_path / "t.json").read_text())
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "comm.tp", "comm.pp", "comm.dp", "pipeline"} <= tracks
    from prism_megatron.graph.chakra import decode

    meta, nodes = decode((tmp_path / "et" / "et.7.et").read_bytes())
    assert len(nodes) == graph.graph_of(7).num_nodes


WRAPPER = """
import os, pathlib, runpy, sys
rank = os.environ["RANK"]  # launch presents the slice's virtual rank
marker = pathlib.Path(os.environ["PRISM_TEST_MARKER"] + rank)
fail = os.environ.get("PRISM_TEST_ALWAYS") or not marker.exists()
if rank == os.environ["PRISM_TEST_FAIL_RANK"] and fail:
    marker.write_text("failed")
    sys.exit(3)
sys.argv = [{example!r}] + sys.argv[1:]
runpy.run_path({example!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_failed_slice_is_retried_once_and_a_rerun_resumes(tmp_path, monkeypatch):
    from prism_megatron.capture.run import Capture, CaptureFailed
    from prism_megatron.config import ConfigError, load_config

    script = tmp_path / "flaky.py"
    script.write_text(WRAPPER.format(example=EXAMPLE))
    monkeypatch.setenv("PRISM_TEST_MARKER", str(tmp_path / "failed"))
    monkeypatch.setenv("PRISM_TEST_FAIL_RANK", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    overrides = ["emulation.virtual_world_size=4", "parallel.pp=2", "model.num_layers=2",
                 "train.global_batch_size=4", "train.micro_batch_size=2", "train.device=cpu"]
    out = tmp_path / "cap"
    logs = []
    def config(*more):
        cfg = load_config([*overrides, *more])
        cfg.train.script = str(script)  # the job: a script that fails once on rank 2
        return cfg

    first = Capture(config(), str(out), workers=2, log=logs.append).run()
    assert (first.slices_run, first.retries, first.roles_total) == (2, 1, 2)
    assert any("rank 2 failed" in line for line in logs)
    (out / "slices" / "rank2.prism").unlink()
    again = Capture(config(), str(out), workers=2).run()
    assert (again.slices_run, again.slices_reused, again.retries) == (1, 1, 0)
    assert load_graph(again.graph_path).roles.keys() == load_graph(first.graph_path).roles.keys()
    marker = out / "config.yaml"  # a capture by a version without these job-neutral keys resumes
    marker.write_text("".join(line for line in marker.read_text().splitlines(True)
                              if "keep_iterations" not in line and "peer_timeout_s" not in line))
    resumed = Capture(config(), str(out), workers=2).run()
    assert (resumed.slices_run, resumed.slices_reused) == (0, 2)
    with pytest.raises(ConfigError, match="another config"):
        Capture(config("model.hidden_size=32"), str(out)).run()
    monkeypatch.setenv("PRISM_TEST_ALWAYS", "1")
    (out / "slices" / "rank2.prism").unlink()
    with pytest.raises(CaptureFailed, match=r"rank 2 .* failed twice .*rank2\.log"):
        Capture(config(), str(out), workers=2, log=logs.append).run()
    assert not (out / "slices" / "rank2.prism").exists()


@pytest.mark.parametrize("args,message", [
    (["capture", "emulation.virtual_world_size=null", "--out", "{tmp}/o"], "needs a virtual world"),
    (["capture", "parallel.tp=3", "--out", "{tmp}/o"], "not divisible"),
    (["capture", "--out", "{tmp}/o", "--workers", "0"], "--workers 0"),
    (["export", "{tmp}/junk.prism", "--perfetto", "{tmp}/t.json"], "truncated or corrupted"),
    (["export", "{tmp}/junk.prism"], "nothing to export"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message, capsys, monkeypatch):
    from test_bad_inputs import run_in_process  # cli.main in this process; real processes: test_bad_inputs

    (tmp_path / "junk.prism").write_bytes(b"garbage")
    monkeypatch.chdir(REPO)
    code, err = run_in_process([a.format(tmp=tmp_path) for a in args], capsys)
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "o" / "graph.prism").exists() and not (tmp_path / "t.json").exists()


def test_a_moe_slice_records_tokens_per_local_expert_and_aten_ops_on_request(tmp_path):
    """One process as rank 1 of a 4-rank MoE job (DP4 with EP2, 2 layers, 2 microbatches), recording
    aten ops."""
    path = tmp_path / "moe.prism"
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--device", "cpu", "--prism-virtual-world-size", "4",
         "--prism-sandbox-ranks", "1", "--prism-override", "model=tiny_moe", "--num-layers", "2",
         "--expert-model-parallel-size", "2", "--global-batch-size", "16", "--micro-batch-size", "2",
         "--prism-trace-path", str(path), "--prism-trace-granularity", "aten"],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    graph = load_graph(str(path), check=False)
    g = graph.graph_of(1)
    experts = graph.world.ep  # tiny_moe's experts over EP2: each rank holds num_experts / 2
    local = (g.moe_ptr[1:] - g.moe_ptr[:-1]).tolist()
    assert sorted(set(g.moe["layer"].tolist())) == [1, 2]          # megatron's 1-based layer numbers
    assert sorted(g.moe["microbatch"].tolist()) == [0, 0, 1, 1]     # 16 / (2 x DP4): 2 microbatches
    assert len(set(local)) == 1 and local[0] >= 1 and experts == 2
    assert g.moe_tokens.sum() > 0 and (g.moe_tokens >= 0).all()
    names = [graph.string(int(i)) for i in g.columns["name"]]
    assert any("/aten.mm" in n or "/aten.addmm" in n for n in names)
    assert any(n.startswith("decoder.layers.0.mlp/aten.") for n in names)


def test_the_merged_graph_says_where_its_slices_ran_not_where_the_parent_guessed():
    """Under train.device=auto each slice picks its own device; the merge takes the slices' word
    (a GPU capture merged as fake would take the shorter of two probes' real durations)."""
    from pathlib import Path

    from prism_megatron.capture.run import CaptureFailed, Slice, _ran_on
    from prism_megatron.world import Role

    def ran(rank, device, execution):
        return Slice(role=Role(pp=rank, tp=0, cp=0, ep=0, etp=0), rank=rank, path=Path(f"rank{rank}.prism"), device=device,
                     execution=execution)

    assert _ran_on([ran(0, "cuda", "real"), ran(1, "cuda", "real")]) == ("cuda", "real")
    with pytest.raises(CaptureFailed, match="rank 1: fake on cpu"):
        _ran_on([ran(0, "cuda", "real"), ran(1, "cpu", "fake")])


@pytest.mark.slow
def test_relative_config_and_out_paths_mean_what_they_say_where_the_command_runs(tmp_path):
    """`capture --config runs/x/config.yaml --out runs/x/cap` from the job's own folder."""
    (tmp_path / "runs" / "x").mkdir(parents=True)
    config = (REPO / "prism_megatron" / "configs" / "tiny_8192.yaml").read_text()
    (tmp_path / "runs" / "x" / "config.yaml").write_text(config)
    proc = subprocess.run(
        [sys.executable, "-m", "prism_megatron.cli", "capture", "--config", "runs/x/config.yaml", "--out",
         "runs/x/cap", "emulation.virtual_world_size=4", "parallel.tp=2", "parallel.pp=2",
         "train.global_batch_size=4"],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "runs" / "x" / "cap" / "graph.prism").is_file()
    assert not (REPO / "runs" / "x").exists()
