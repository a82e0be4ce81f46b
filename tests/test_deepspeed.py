"""DeepSpeed under the virtual world (hooks/deepspeed.py, examples/deepspeed_train.py), on CPU.

- ZeRO-1, 2 and 3 at virtual data-parallel size 1024, one process as rank 5: the model-state bytes
  the sandbox holds are DeepSpeed's per-rank share, term by term as DeepSpeed's own estimators count
  them (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`), with
  DeepSpeed's partition padding.
- No ghosts: 4 gloo processes plain and the same 4 as the sandboxes of a virtual world of 4 give
  equal losses, grad norms and tracked peak memory.
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

pytest.importorskip("deepspeed")  # the `test` extra installs it (setup.cfg)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "deepspeed_train.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
MODEL = ["--device", "cpu", "--hidden-size", "64", "--num-layers", "2", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "2"]
N = 1024


def _config(stage: int) -> str:
    return str(REPO / "configs" / "deepspeed" / f"zero{stage}.json")


def _run(args, summary: Path, nproc: int = 1, timeout: int = 600):
    if nproc > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(port), str(SCRIPT)]
    else:
        cmd = [sys.executable, str(SCRIPT)]
    proc = subprocess.run([*cmd, *MODEL, *args, "--prism-summary-json", str(summary)], capture_output=True,
                          text=True, env=ENV, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_model_states_at_virtual_dp_1024_are_deepspeeds_per_rank_share(tmp_path, stage):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _run(["--deepspeed-config", _config(stage), "--global-batch-size", str(2 * N), "--train-iters", "2",
          "--prism-virtual-world-size", str(N), "--prism-sandbox-ranks", "5"], tmp_path / "s.json")
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["zero_stage"] == stage and summary["virtual_world_size"] == N
    held = summary["model_state_peak_bytes"]  # while the update runs: every term alive
    total = summary["num_parameters"]
    # the model's parameters (TinyGPT), by shape: what DeepSpeed partitions
    h, v, s, layers = 64, 512, 32, 2
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    shapes = [v * h, s * h, *block * layers, h, h, v * h]
    assert sum(shapes) == total
    if stage in (1, 2):
        align = 2 * N  # 16-bit groups are padded to a multiple of 2 elements per rank
        padded = math.ceil(total / align) * align
        part = padded // N
        assert held["params_16bit"] == 2 * padded       # full 16-bit parameters on every rank
        assert held["params_fp32"] == 4 * part          # fp32 master partition
        assert held["optimizer_moments"] == 8 * part    # Adam's two moments of the partition
        assert held["grads_fp32"] == 4 * part           # fp32 gradient partition
        # DeepSpeed's estimator: 2 x params (16-bit) + 18 x params / N (2: 16-bit gradients, 4: fp32
        # gradients, 4: fp32 master, 8: moments); the same terms at the padded size:
        _, estimate = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=8, num_nodes=N // 8,
                                                            cpu_offload=False)
        ours = held["params_16bit"] + held["params_fp32"] + held["optimizer_moments"] + held["grads_fp32"]
        assert ours + 2 * part == 2 * padded + 18 * part
        assert 0 <= (2 * padded + 18 * part) - estimate <= 2 * (padded - total) + 18
        # the 16-bit gradients alive at that moment are what DeepSpeed really holds: the full
        # gradients of the parameters this rank's partition lies in, freed once copied to fp32
        assert held["grads_16bit"] > 0
    else:
        part = sum(math.ceil(n / N) for n in shapes)  # ZeRO-3 partitions every parameter
        assert held["params_16bit"] == 2 * part
        assert held["grads_16bit"] == 2 * part
        assert held["grads_fp32"] == 4 * part
        assert held["params_fp32"] == 4 * part
        assert held["optimizer_moments"] == 8 * part
        # DeepSpeed's estimator: 4 x the largest layer (gathered) + 18 x params / N; its 18 leaves out
        # the 16-bit gradient partition buffer that ZeRO-3 keeps (2 bytes per partition element)
        _, estimate, largest_memory = estimate_zero3_model_states_mem_needs(
            total, max(shapes), num_gpus_per_node=8, num_nodes=N // 8, cpu_offload=False,
            cpu_offload_params=False)
        assert largest_memory == 4 * max(shapes)
        per_partition = estimate - largest_memory
        ours = sum(held.values()) - held["grads_16bit"]
        assert abs(ours - per_partition) <= 18 * len(shapes)  # each parameter padded to N pieces
    assert all(math.isfinite(x) for x in summary["losses"])


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.slow
def test_no_ghosts_virtualized_equals_plain(tmp_path, stage):
    common = ["--deepspeed-config", _config(stage), "--global-batch-size", "16", "--train-iters", "3"]
    _run(common, tmp_path / "plain{rank}.json", nproc=4)
    _run([*common, "--prism-virtual-world-size", "4", "--prism-sandbox-ranks", "0", "1", "2", "3"],
         tmp_path / "virtual{rank}.json", nproc=4)
    for rank in range(4):
        plain = json.loads((tmp_path / f"plain{rank}.json").read_text())
        virtual = json.loads((tmp_path / f"virtual{rank}.json").read_text())
        assert virtual["virtual_world_size"] == 4 and virtual["zero_stage"] == stage
        assert virtual["losses"] == plain["losses"]
        assert virtual["grad_norms"] == plain["grad_norms"]
        assert virtual["peak_tracked_bytes"] == plain["peak_tracked_bytes"]
        assert virtual["model_state_bytes"] == plain["model_state_bytes"]


def test_bad_deepspeed_config_is_one_line_and_exit_2(tmp_path):
    missing = str(tmp_path / "no.json")
    proc = subprocess.run([sys.executable, str(SCRIPT), *MODEL, "--deepspeed-config", missing],
                          capture_output=True, text=True, env=ENV, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "--deepspeed-config" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_deepspeed_job_runs_through_capture_simulation_and_emulation(tmp_path):
    """`prism-megatron run train.framework=deepspeed`: the slice and the sandbox run
    examples/deepspeed_train.py; the graph holds ZeRO's collectives over the data-parallel world and
    one forward and one backward span per microbatch; rank 5 (same role as the captured rank 0) holds
    exactly the captured memory."""
    from prism_megatron.graph import load_graph

    job = ["train.framework=deepspeed", "train.deepspeed_config=configs/deepspeed/zero2.json",
           "emulation.virtual_world_size=64", "emulation.sandbox_ranks=[5]", "parallel.tp=1", "parallel.pp=1",
           "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
           "model.vocab_size=512", "train.micro_batch_size=2", "train.global_batch_size=256", "train.iters=4",
           "train.device=cpu", "cluster=cpu_host"]
    proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "run", *job, "--out",
                           str(tmp_path / "r"), "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, env=ENV, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["ranks"] == 64 and out["iteration_time_s"] > 0 and out["materialized_ghosts"] == 2
    graph = load_graph(out["graph_path"])
    (role, g), = graph.roles.items()
    comm = g.columns["kind"] != 0
    ops = {graph.string(i) for i in g.columns["op"][comm]}
    assert {"all_gather", "all_reduce"} <= ops
    assert {graph.string(i) for i in g.columns["dim"][comm]} == {"world"}  # ZeRO's DP group: everyone
    names = [graph.string(i) for i in g.spans["name"]]
    assert names == ["forward", "backward"] * 2  # two microbatches (256 / (2 x 64))
    assert any(graph.string(i).startswith("layers.1.") for i in g.columns["name"])  # module labels
    sandbox, = out["sandbox"]
    assert sandbox["virtual_rank"] == 5 and sandbox["peak_allocated_bytes"] == g.peak_bytes


@pytest.mark.slow
def test_a_deepspeed_pipeline_captured_stage_by_stage_has_the_real_runs_memory(tmp_path):
    """PP4 (DeepSpeed's PipelineModule, 1F1B, ZeRO-1): the capture runs each stage as one process
    among ghost stages (a ghost previous stage's activation metadata computed on the meta device);
    the graph replays to an iteration time, and every stage's peak memory equals that rank's in the
    real 4-process run, byte for byte."""
    from prism_megatron.graph import load_graph

    model = {"model.num_layers": "4", "model.hidden_size": "64", "model.num_attention_heads": "4",
             "model.seq_length": "32", "model.vocab_size": "512", "train.micro_batch_size": "2",
             "train.global_batch_size": "8", "train.iters": "3"}
    job = ["train.framework=deepspeed", "train.deepspeed_config=configs/deepspeed/zero1.json",
           "emulation.virtual_world_size=4", "parallel.tp=1", "parallel.pp=4", "train.device=cpu",
           *(f"{k}={v}" for k, v in model.items())]
    proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "capture", *job, "--out",
                           str(tmp_path / "c")],
                          capture_output=True, text=True, env=ENV, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    graph = load_graph(str(tmp_path / "c" / "graph.prism"))
    assert sorted(role.pp for role in graph.roles) == [0, 1, 2, 3]
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.sim.des import Simulator

    result = Simulator(graph, load_cluster("cpu_host").cost_model(None)).run()
    assert result.iteration_s > 0  # the stages' p2p match up: no deadlock
    flags = {"model.num_layers": "--num-layers", "model.hidden_size": "--hidden-size",
             "model.num_attention_heads": "--num-attention-heads", "model.seq_length": "--seq-length",
             "model.vocab_size": "--vocab-size", "train.micro_batch_size": "--micro-batch-size",
             "train.global_batch_size": "--global-batch-size", "train.iters": "--train-iters"}
    real = [x for k, v in model.items() for x in (flags[k], v)]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-port", str(port), str(SCRIPT), "--device", "cpu", *real,
                          "--pipeline-model-parallel-size", "4", "--deepspeed-config", _config(1),
                          "--prism-summary-json", str(tmp_path / "real{rank}.json")],
                         capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    for role, g in graph.roles.items():
        rank = graph.world.group(0, "pp")[role.pp]
        measured = json.loads((tmp_path / f"real{rank}.json").read_text())["peak_tracked_bytes"]
        assert g.peak_bytes == measured, (role, g.peak_bytes, measured)
        assert [graph.string(i) for i in g.spans["name"]].count("forward") == 4  # 8 / (2 x 1) microbatches


@pytest.mark.slow
def test_launch_runs_the_deepspeed_script_as_the_direct_run(tmp_path):
    """`prism-megatron launch -- examples/deepspeed_train.py ... --prism-*`: the launcher installs the
    hooks and the script's own install returns that installation: the same losses and memory as the
    script run directly."""
    job = ["--deepspeed-config", _config(2), "--global-batch-size", str(2 * N), "--train-iters", "2",
           "--prism-virtual-world-size", str(N), "--prism-sandbox-ranks", "5"]
    _run(job, tmp_path / "direct.json")
    launched = subprocess.run([sys.executable, "-m", "prism_megatron.cli", "launch", "--", str(SCRIPT),
                               *MODEL, *job, "--prism-summary-json", str(tmp_path / "launched.json")],
                              capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert launched.returncode == 0, launched.stderr[-3000:]
    direct = json.loads((tmp_path / "direct.json").read_text())
    via = json.loads((tmp_path / "launched.json").read_text())
    assert via["virtual_rank"] == 5 and via["virtual_world_size"] == N
    assert via["losses"] == direct["losses"] and via["peak_tracked_bytes"] == direct["peak_tracked_bytes"]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.slow
def test_ghost_shards_keep_the_model_at_virtual_dp_1024(tmp_path, stage):
    """ZeRO-3 at DP 1024 cuts this model's small parameters into shards of a few elements; the ghosts'
    shards are their initial values (hooks/deepspeed.py `_patch_ghost_shards`), not copies of rank 0's
    one element, so the loss is the model's and it moves. Rank 0 reads the same batch as a plain
    one-process run, whose first loss it matches (before any update a ghost shard is the real one)."""
    job = ["--deepspeed-config", _config(stage), "--train-iters", "3", "--global-batch-size", str(2 * N)]
    _run([*job, "--prism-virtual-world-size", str(N), "--prism-sandbox-ranks", "0"], tmp_path / "v.json")
    _run(["--deepspeed-config", _config(stage), "--train-iters", "3", "--global-batch-size", "2"],
         tmp_path / "plain.json")
    virtual = json.loads((tmp_path / "v.json").read_text())["losses"]
    plain = json.loads((tmp_path / "plain.json").read_text())["losses"]
    uniform = math.log(512)
    assert all(abs(x - uniform) > 1e-3 for x in virtual), virtual  # not the uniform-logits loss
    assert len(set(round(x, 6) for x in virtual)) == 3, virtual  # it moves
    assert virtual[0] == pytest.approx(plain[0], rel=1e-5), (virtual, plain)
