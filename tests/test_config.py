"""Config: one set of names through overrides, YAML and Megatron-style flags; errors that teach."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prism_megatron.config import ConfigError, load_config
from prism_megatron.config.flags import (
    MEGATRON_FLAGS,
    OneLineParser,
    add_megatron_args,
    add_prism_args,
    config_from_args,
    field_docs,
)
from prism_megatron.config.schema import (
    EmulationConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)

REPO = Path(__file__).resolve().parents[1]


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_megatron_args(add_prism_args(parser))
    return parser.parse_args(argv)


def test_flags_and_overrides_are_two_spellings_of_one_config():
    by_flags = config_from_args(_parse(
        "--prism-virtual-world-size 8192 --prism-sandbox-ranks 4711 --tensor-model-parallel-size 8 "
        "--pipeline-model-parallel-size 16 --num-layers 16 --num-attention-heads 8 "
        "--global-batch-size 128 --micro-batch-size 1 --sequence-parallel --bf16".split()))
    by_overrides = load_config([
        "emulation.virtual_world_size=8192", "emulation.sandbox_ranks=[4711]", "parallel.tp=8",
        "parallel.pp=16", "model.num_layers=16", "model.num_attention_heads=8",
        "train.global_batch_size=128", "train.micro_batch_size=1", "parallel.sequence_parallel=true",
        "model.params_dtype=bf16"])
    assert by_flags == by_overrides
    assert by_flags.parallel.tp == 8 and by_flags.emulation.sandbox_ranks == [4711]


def test_sandbox_ranks_flag_takes_stage_role_names():
    base = ["--prism-virtual-world-size", "8192", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "16", "--num-layers", "16", "--num-attention-heads", "8",
            "--global-batch-size", "128", "--micro-batch-size", "1"]
    cfg = config_from_args(_parse([*base, "--prism-sandbox-ranks", "4711", "last-stage", "first-stage"]))
    assert cfg.emulation.sandbox_ranks == [4711, 7680, 0]  # stage 15 starts at rank 15 * 512
    with pytest.raises(ConfigError, match="expected a virtual rank or one of first-stage, last-stage"):
        config_from_args(_parse([*base, "--prism-sandbox-ranks", "hottest-expert"]))


def test_presets_yaml_and_overrides_merge_in_order(tmp_path):
    cfg = load_config(["model=tiny_moe", "model.num_layers=8"])
    assert cfg.model.num_experts == 8 and cfg.model.num_layers == 8
    yaml = tmp_path / "job.yaml"
    yaml.write_text("parallel:\n  tp: 2\nmodel:\n  num_layers: 6\n")
    cfg = load_config(["model.num_layers=12"], str(yaml))
    assert cfg.parallel.tp == 2 and cfg.model.num_layers == 12  # the override wins over the file


def test_a_command_line_preset_replaces_the_files_model_as_a_config_group_does(tmp_path):
    """`--config FILE model=tiny` is the tiny model, not the file's 96 layers of hidden 12288 (what
    `train`, `run`, `capture` and `sweep -m model=...` use); the file's other sections stay, and a
    file's own `model: NAME` is refined by its fields."""
    cfg = load_config(["model=tiny_moe", "parallel.pp=2", "model.num_attention_heads=8", "model.num_layers=4",
                       "train.global_batch_size=8192"],
                      str(REPO / "configs" / "default.yaml"))
    assert (cfg.model.hidden_size, cfg.model.num_experts, cfg.model.params_dtype) == (64, 8, "fp32")
    assert cfg.emulation.virtual_world_size == 8192 and cfg.parallel.tp == 8  # the file's world stays
    own = tmp_path / "own.yaml"
    own.write_text("model: tiny_moe\nparallel: {tp: 2}\n")
    assert load_config([], str(own)).model.num_experts == 8 and load_config([], str(own)).parallel.tp == 2
    refined = tmp_path / "refined.yaml"
    refined.write_text("model:\n  num_layers: 6\n")
    assert load_config(["model=tiny_moe"], str(refined)).model.num_layers == 4  # the choice replaced it


def test_shipped_configs_load():
    default = load_config([], str(REPO / "configs" / "default.yaml"))
    assert default.emulation.virtual_world_size == 8192 and default.emulation.sandbox_ranks == [4711]
    assert default.model.hidden_size == 12288 and default.emulation.execution == "auto"
    tiny = load_config([], str(REPO / "configs" / "tiny_8192.yaml"))
    assert tiny.emulation.virtual_world_size == 8192 and tiny.model.hidden_size == 64
    moe = load_config([], str(REPO / "configs" / "moe_8192.yaml"))
    assert moe.model.num_experts == 8 and moe.parallel.ep == 8


@pytest.mark.parametrize("overrides,words", [
    (["emulation.virtual_world_size=8192", "parallel.tp=8", "parallel.pp=3", "model.num_layers=3",
      "model.num_attention_heads=8"], ["tp(8)", "pp(3)", "8192"]),
    (["emulation.virtual_world_size=8", "emulation.sandbox_ranks=[9]"], ["9", "0..7"]),
    (["parallel.tpp=2"], ["tpp"]),
    (["parallel.tp=two"], ["two"]),
    (["model=huge"], ["huge", "tiny_moe"]),
    (["emulation.ghost_policy=echo"], ["echo", "mirror"]),
    (["emulation.virtual_world_size=64", "train.global_batch_size=4"], ["global_batch_size(4)", "dp(64)"]),
    (["parallel.ep=2"], ["num_experts"]),
    (["parallel.tpp=2"], ["did you mean parallel.tp?"]),
    (["modle.num_layers=2"], ["did you mean model?"]),
    (["moe.imbalanse=zipf(1)"], ["did you mean moe.imbalance?"]),
    (["train.micro_batch_sise=2"], ["did you mean train.micro_batch_size?"]),
    (["emulation.virtual_world=8"], ["did you mean emulation.virtual_world_size?"]),
    (["parallel.tp=3"], ["num_attention_heads", "tp(3)"]),
    (["parallel.tp=0"], ["parallel.tp"]),
    (["parallel.pp=-1"], ["parallel.pp"]),
    (["model.num_layers=0"], ["num_layers"]),
    (["model.hidden_size=100", "model.num_attention_heads=8"], ["hidden_size"]),
    (["emulation.virtual_world_size=0"], ["virtual_world_size"]),
    (["emulation.virtual_world_size=12", "parallel.tp=8", "model.num_attention_heads=8"], ["12", "tp(8)"]),
    (["emulation.sandbox_ranks=[1,1]"], ["distinct"]),
    (["emulation.sandbox_ranks=[-2]"], ["distinct"]),
    (["emulation.gpus_per_node=0"], ["gpus_per_node"]),
    (["emulation.clock=fast"], ["fast", "virtual, realtime"]),
    (["emulation.clock=realtime"], ["delay_plan", "trace.path"]),
    (["train.global_batch_size=3", "train.micro_batch_size=2"],
     ["global_batch_size(3)", "micro_batch_size(2)"]),
    (["emulation.virtual_world_size=64", "parallel.pp=4", "parallel.vpp=2", "model.num_layers=8",
      "train.global_batch_size=32"], ["1 micro-batches per pipeline", "parallel.pp(4)", "train.global_batch_size=128"]),
    (["train.device=tpu"], ["tpu", "cpu, cuda"]),
    (["train.iters=0"], ["train.iters"]),
    (["trace.granularity=op"], ["op", "module, aten"]),
    (["trace.iteration=0"], ["trace.iteration"]),
    (["trace.keep_iterations=sometimes"], ["trace.keep_iterations", "not a valid bool"]),
    (["moe.imbalance=zipf(1.2)"], ["num_experts"]),
    (["model=tiny_moe", "moe.imbalance=pareto(2)"], ["pareto", "zipf(s)"]),
    (["model=tiny_moe", "moe.imbalance=zipf(0)"], ["must be > 0"]),
    (["model=tiny_moe", "moe.imbalance=hot-experts(2)"], ["takes 2 number"]),
    (["model=tiny_moe", "moe.imbalance=replay(/tmp/x.jsonl)"], ["{rank}"]),
    (["model=tiny_moe", "moe.drift_per_iteration=-1"], ["drift_per_iteration", ">= 0"]),
    (["parallel.tp"], ["not key=value"]),
])
def test_bad_config_is_one_line_naming_the_factors(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_every_field_has_a_docstring_and_every_flag_a_key():
    for cls in (EmulationConfig, ParallelConfig, ModelConfig, TrainConfig):
        docs = field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if f not in docs]
        assert not missing, f"{cls.__name__}: {missing}"
    for key in MEGATRON_FLAGS.values():
        section, name = key.split(".")
        assert name in field_docs({"parallel": ParallelConfig, "model": ModelConfig,
                                   "train": TrainConfig}[section])


def test_usage_errors_are_one_line_with_exit_2(capsys):
    parser = OneLineParser(prog="x")
    add_prism_args(parser)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--nope"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
