"""The user's own training script as the job of `capture`, `emulate`, `run` and `sweep`
(`-- SCRIPT ARGS`, config/job.py): a megatron-core script and a DeepSpeed script written here, in the
style of a third party (their own argument parsers, which reject unknown flags; their own loops, and a
`--train-iters` far beyond what the capture records), neither of them one of the repository's examples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1")
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_name, None)

MEGATRON_SCRIPT = textwrap.dedent('''
    """A user's megatron-core GPT trainer: Megatron-LM's flag names, its own loop, mock tokens."""
    import argparse, os
    from functools import partial

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parser = argparse.ArgumentParser()
    for flag, default in (("--tensor-model-parallel-size", 1), ("--pipeline-model-parallel-size", 1),
                          ("--num-layers", 2), ("--hidden-size", 32), ("--num-attention-heads", 4),
                          ("--seq-length", 16), ("--micro-batch-size", 1), ("--global-batch-size", 8),
                          ("--train-iters", 10), ("--vocab-size", 128), ("--report-every", 1)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()  # strict: a --prism-* flag here would be an error

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=128 * args.tensor_model_parallel_size, max_sequence_length=args.seq_length,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    micro = args.global_batch_size // (args.micro_batch_size * ps.get_data_parallel_world_size())


    def batches(step):
        gen = torch.Generator().manual_seed(step * 1000 + ps.get_data_parallel_rank())
        for _ in range(micro):
            tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=gen)
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                   "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1)}


    def forward_step(data, model):
        batch = next(data)
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})


    for step in range(1, args.train_iters + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches(step), model=model,
            num_microbatches=micro, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            forward_only=False)
        optimizer.step()
        if losses and step % args.report_every == 0:
            print(f"step {step} loss {float(losses[-1]['loss']):.4f}", flush=True)
    dist.destroy_process_group()
''')

DEEPSPEED_SCRIPT = textwrap.dedent('''
    """A user's DeepSpeed trainer: its own flags, a small MLP, ZeRO-2 from a config dict."""
    import argparse

    import deepspeed
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, 4 * args.width), torch.nn.GELU(),
                                torch.nn.Linear(4 * args.width, args.width))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2}, "steps_per_print": 10**9})
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width)
        loss = (engine(x) - x).pow(2).mean()
        engine.backward(loss)
        engine.step()
''')


def _cli(*args, cwd, timeout=900):
    return subprocess.run([sys.executable, "-m", "prism_megatron.cli", *args], capture_output=True,
                          text=True, env=dict(ENV, PYTHONPATH=str(REPO)), timeout=timeout, cwd=cwd)


@pytest.fixture
def user_script(tmp_path) -> Path:
    script = tmp_path / "my_trainer.py"
    script.write_text(MEGATRON_SCRIPT)
    return script


@pytest.mark.slow
def test_a_users_megatron_core_script_is_captured_and_emulated(user_script, tmp_path):
    """TP2 PP2 over 64 virtual ranks, its flags read for the world and the microbatches; its
    --train-iters 1000 stops after the recorded iterations (emulation.stop_after)."""
    args = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters",
            "1000", "--global-batch-size", "32", "--micro-batch-size", "1", "--prism-virtual-world-size", "64"]
    cap = _cli("capture", "--out", "cap", "--json", "cap.json", "--", user_script.name, *args, cwd=tmp_path)
    assert cap.returncode == 0, cap.stderr[-3000:]
    summary = json.loads((tmp_path / "cap.json").read_text())
    assert summary["roles_total"] == 4 and summary["roles_captured"] == 4  # two stages x two TP ranks
    from prism_megatron.graph import load_graph

    graph = load_graph(str(tmp_path / "cap" / "graph.prism"))
    assert (graph.world.world_size, graph.world.tp, graph.world.pp) == (64, 2, 2)
    assert graph.meta["microbatches"] == 2  # 32 / (1 x dp 16)
    first = load_graph(str(tmp_path / "cap" / "slices" / "rank0.prism"), check=False)
    assert first.meta["iterations_run"] == 3  # not 1000
    assert "--train-iters" in first.meta["config"] and user_script.name in first.meta["config"]
    emu = _cli("emulate", str(tmp_path / "cap" / "graph.prism"), "--out", "emu", "--sandbox", "37",
               "--json", "emu.json", cwd=tmp_path)
    assert emu.returncode == 0, emu.stderr[-3000:]
    out = json.loads((tmp_path / "emu.json").read_text())
    row, = out["sandbox"]
    assert row["virtual_rank"] == 37 and row["iteration_time_s"] > 0 and row["peak_allocated_bytes"] > 0
    run = json.loads((tmp_path / "emu" / "sandbox" / "summary37.json").read_text())
    assert run["iterations"] == 3 and len(run["iteration_times_ms"]) == 3  # the hooks' own summary


@pytest.mark.slow
def test_an_override_rewrites_the_scripts_flag_and_a_sweep_sweeps_it(user_script, tmp_path):
    """`parallel.tp=1,2` over the script: each point runs the script with its own
    --tensor-model-parallel-size; a job key without a flag the script can take fails the point
    with the script's own error, not silently."""
    args = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--micro-batch-size", "1",
            "--train-iters", "50", "--prism-virtual-world-size", "16"]
    proc = _cli("sweep", "parallel.tp=1,2", "--out", "sw", "--cluster", "cpu_host", "--json", "sw.json",
                "--", user_script.name, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sw.json").read_text())["points"]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    from prism_megatron.graph import load_graph

    worlds = sorted(load_graph(str(p)).world.tp for p in (tmp_path / "sw" / "captures").glob("*/graph.prism"))
    assert worlds == [1, 2]


def test_a_script_whose_batch_differs_from_the_config_is_named_not_captured_wrongly(user_script, tmp_path):
    """Without --micro-batch-size the script runs its own default (1) where the config's is 2: the
    capture names the disagreement instead of planning roles for the wrong microbatch count."""
    proc = _cli("capture", "--out", "cap", "--", user_script.name, "--pipeline-model-parallel-size", "2",
                "--global-batch-size", "8", "--prism-virtual-world-size", "4", cwd=tmp_path)
    assert proc.returncode == 1 and "ran 4 microbatches per iteration" in proc.stderr, proc.stderr[-2000:]
    assert "--micro-batch-size" in proc.stderr and not (tmp_path / "cap" / "graph.prism").exists()


@pytest.mark.slow
def test_a_users_deepspeed_script_runs_through_capture_and_emulation(tmp_path):
    """Its flags are its own, so the job's shape is the config's (train.framework=deepspeed, the batch
    sizes); the capture checks the world the script builds."""
    script = tmp_path / "ds_trainer.py"
    script.write_text(DEEPSPEED_SCRIPT)
    proc = _cli("run", "train.framework=deepspeed", "emulation.virtual_world_size=32", "train.micro_batch_size=2",
                "train.global_batch_size=64", "train.device=cpu", "cluster=cpu_host", "--sandbox", "9",
                "--out", "r", "--json", "r.json", "--", script.name, "--steps", "500", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["ranks"] == 32 and out["iteration_time_s"] > 0
    from prism_megatron.graph import load_graph

    graph = load_graph(str(tmp_path / out["graph_path"]))  # relative to where the command ran
    (_, g), = graph.roles.items()
    assert {graph.string(i) for i in g.columns["dim"][g.columns["kind"] != 0]} == {"world"}  # ZeRO's DP
    sandbox, = out["sandbox"]
    assert sandbox["virtual_rank"] == 9 and sandbox["peak_allocated_bytes"] == g.peak_bytes


@pytest.mark.parametrize("args,message", [
    (["capture", "--out", "o", "--", "missing.py"], "missing.py after -- is not a file"),
    (["capture", "--out", "o", "--", "--num-layers", "2"], "expected the training script first"),
    (["world", "--", "x.py"], "world takes no training script"),
    (["capture", "--out", "o", "--"], "nothing after --"),
])
def test_a_bad_script_argument_is_one_line_and_exit_2(tmp_path, args, message, capsys, monkeypatch):
    from test_bad_inputs import run_in_process  # cli.main in this process; real processes: test_bad_inputs

    monkeypatch.chdir(tmp_path)
    code, err = run_in_process(list(args), capsys)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_validate_measures_a_users_script_against_its_emulation(user_script, tmp_path):
    """`prism-megatron validate --world 2 -- SCRIPT ARGS`: the script's plain TP2 run (two gloo
    processes, the hooks' own per-rank summary) against the capture and emulation of the same command;
    the sandbox's peak memory is the real rank's to the byte."""
    calibration = REPO / "benchmarks" / "results" / "calibration-cpu4.json"
    proc = _cli("validate", "--reps", "1", "--iters", "4", "--warmup", "1", "--world", "2",
                "--calibration", str(calibration), "--json", "v.json", "--", user_script.name,
                "--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--micro-batch-size", "2",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row, = json.loads((tmp_path / "v.json").read_text())["rows"]
    assert row["config"] == "script" and row["world"] == 2 and row["real_iter_s_median"] > 0
    assert row["emu_iter_s"] > 0 and row["mem_err_pct"] == 0.0


def test_config_shows_what_a_command_would_run(user_script, tmp_path):
    """`config -- SCRIPT ARGS`: the job config the capture would use, read from the script's flags
    (and Megatron-LM's global batch of micro batch x dp where the flag is absent); `config` alone:
    the built-in default job that `train` runs."""
    proc = _cli("config", "parallel.pp=2", "--", user_script.name, "--tensor-model-parallel-size", "2",
                "--micro-batch-size", "1", "--prism-virtual-world-size", "16", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "tp: 2" in text and "pp: 2" in text and "global_batch_size: 4" in text  # 1 x 16 / (2 x 2)
    assert "--pipeline-model-parallel-size" in text  # the override rewrote the script's flag
    default = _cli("config", cwd=tmp_path, timeout=120)
    assert default.returncode == 0 and "virtual_world_size: 8192" in default.stdout


@pytest.mark.slow
def test_a_faulted_sandbox_of_a_users_script_is_slower_and_reported(user_script, tmp_path):
    """`run` of the script with a straggler on its sandbox (`faults.inject=slow(5, 2)`): the sandbox
    slows its own compute for real (the schedule hooks stretch its steps, whoever wrote the loop), the
    job's iteration follows it, and `report` writes the page of that run."""
    job = ["--", user_script.name, "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
           "--micro-batch-size", "1", "--hidden-size", "64", "--prism-virtual-world-size", "8"]
    times = {}
    for name, faults in (("clean", []), ("slow", ["faults.inject=slow(5, 2)"])):
        proc = _cli("run", *faults, "cluster=cpu_host", "--sandbox", "5", "--out", name, "--json", f"{name}.json",
                    *job, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        row, = json.loads((tmp_path / f"{name}.json").read_text())["sandbox"]
        times[name] = row["recorded_iteration_s"]
    # twice as slow in its forward, backward and optimizer steps; the loop's own host work between them
    # (zero_grad, its batches, the loss print) is not stretched, so the whole iteration is less than 2x
    assert times["slow"] > 1.25 * times["clean"], times
    report = _cli("report", "slow", cwd=tmp_path, timeout=120)
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "slow" / "report.html").is_file() or "report:" in report.stdout
