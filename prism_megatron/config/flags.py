"""Megatron-style command-line flags, generated from the config dataclasses.

`add_prism_args(parser)` adds the `--prism-*` group (usable as Megatron-LM's `extra_args_provider`);
`add_megatron_args(parser)` adds the common Megatron-LM flags our examples take
(`--tensor-model-parallel-size`, `--num-layers`, ...). `config_from_args(args)` turns a parsed namespace
into a validated `PrismConfig`: the flags are only another spelling of the config keys, so both paths
end in the same dataclasses and the same validation.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
from dataclasses import fields
from functools import lru_cache
from typing import Optional

from prism_megatron.config.loader import load_config
from prism_megatron.config.schema import (
    SECTIONS,
    ConfigError,
    PrismConfig,
    TrainConfig,
)

# --prism-<name> -> emulation.<field>; help comes from the field docstring.
PRISM_FLAGS = ("virtual_world_size", "sandbox_ranks", "ghost_policy", "ghost_seed", "gpus_per_node", "clock",
               "delay_plan", "execution", "target_gpu", "stop_after")
_STR_FLAGS = ("ghost_policy", "clock", "delay_plan", "execution", "target_gpu", "stop_after")
# --prism-trace-<name> -> trace.<field>
TRACE_FLAGS = {"path": str, "granularity": str, "timing": str, "selection": str, "iteration": int}
# --prism-moe-<name> -> moe.<field>
MOE_FLAGS = {"imbalance": str, "drift_per_iteration": float, "seed": int, "log_path": str}

# Megatron-LM flag -> config key. Booleans are store_true flags.
MEGATRON_FLAGS: dict[str, str] = {
    "--tensor-model-parallel-size": "parallel.tp",
    "--pipeline-model-parallel-size": "parallel.pp",
    "--context-parallel-size": "parallel.cp",
    "--expert-model-parallel-size": "parallel.ep",
    "--expert-tensor-parallel-size": "parallel.etp",
    "--num-virtual-stages-per-pipeline-rank": "parallel.vpp",
    "--sequence-parallel": "parallel.sequence_parallel",
    "--num-layers": "model.num_layers",
    "--hidden-size": "model.hidden_size",
    "--num-attention-heads": "model.num_attention_heads",
    "--ffn-hidden-size": "model.ffn_hidden_size",
    "--num-experts": "model.num_experts",
    "--moe-router-topk": "model.moe_router_topk",
    "--moe-ffn-hidden-size": "model.moe_ffn_hidden_size",
    "--moe-expert-capacity-factor": "model.moe_expert_capacity_factor",
    "--vocab-size": "model.vocab_size",
    "--seq-length": "model.seq_length",
    "--num-query-groups": "model.num_query_groups",
    "--swiglu": "model.swiglu",
    "--kv-channels": "model.kv_channels",
    "--position-embedding-type": "model.position_embedding_type",
    "--rotary-base": "model.rotary_base",
    "--rotary-percent": "model.rotary_percent",
    "--normalization": "model.normalization",
    "--norm-epsilon": "model.norm_epsilon",
    "--attention-backend": "model.attention_backend",
    "--attention-dropout": "model.attention_dropout",
    "--hidden-dropout": "model.hidden_dropout",
    "--moe-shared-expert-intermediate-size": "model.moe_shared_expert_intermediate_size",
    "--moe-router-score-function": "model.moe_router_score_function",
    "--fp8-format": "model.fp8",
    "--fp8-recipe": "model.fp8_recipe",
    "--fp8-amax-history-len": "model.fp8_amax_history_len",
    "--fp8-amax-compute-algo": "model.fp8_amax_compute_algo",
    "--fp8-margin": "model.fp8_margin",
    "--recompute-granularity": "train.recompute_granularity",
    "--recompute-method": "train.recompute_method",
    "--recompute-num-layers": "train.recompute_num_layers",
    "--recompute-modules": "train.recompute_modules",
    "--micro-batch-size": "train.micro_batch_size",
    "--global-batch-size": "train.global_batch_size",
    "--train-iters": "train.iters",
    "--lr": "train.lr",
    "--seed": "train.seed",
    "--use-distributed-optimizer": "train.use_distributed_optimizer",
    "--overlap-grad-reduce": "train.overlap_grad_reduce",
}
_SECTIONS = SECTIONS


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (what, and where the help is), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the one source of help text)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _field(key: str):
    section, name = key.split(".")
    doc = field_docs(_SECTIONS[section])[name].replace("%", "%%")  # argparse formats help with %
    return next(f for f in fields(_SECTIONS[section]) if f.name == name), doc


def add_prism_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--prism-*` flags (Megatron-LM `extra_args_provider` signature).

    Under `prism-megatron launch` their defaults are the launch's `--prism-*` arguments (in the
    environment), so a script that reads them itself sees what the launch was given."""
    _add_prism_group(parser)
    launched = os.environ.get(LAUNCH_ENV)
    if launched:
        given = _add_prism_group(OneLineParser(prog="prism-megatron launch", allow_abbrev=False,
                                               add_help=False))
        values, _ = given.parse_known_args(json.loads(launched))
        parser.set_defaults(**{k: v for k, v in vars(values).items() if v not in (None, [])})
    return parser


LAUNCH_ENV = "PRISM_MEGATRON_LAUNCH_ARGS"


def _add_prism_group(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("prism", "virtual world emulation (prism_megatron)")
    for name in PRISM_FLAGS:
        f, doc = _field(f"emulation.{name}")
        flag = "--prism-" + name.replace("_", "-")
        if name == "sandbox_ranks":
            group.add_argument(flag, nargs="+", default=None, metavar="RANK",
                               help=doc + " Ranks or role names: first-stage, last-stage.")
        else:
            group.add_argument(flag, type=str if name in _STR_FLAGS else int, default=None, help=doc)
    for name, kind in TRACE_FLAGS.items():
        group.add_argument("--prism-trace-" + name, type=kind, default=None,
                           help=_field(f"trace.{name}")[1])
    for name, kind in MOE_FLAGS.items():
        group.add_argument("--prism-moe-" + name.replace("_", "-"), type=kind, default=None,
                           help=_field(f"moe.{name}")[1])
    group.add_argument("--prism-config", default=None,
                       help="YAML config file (same keys as `prism-megatron config`); flags win over it")
    group.add_argument("--prism-override", nargs="*", default=[], metavar="KEY=VALUE",
                       help="config overrides, e.g. model=tiny_moe parallel.tp=2")
    group.add_argument("--prism-summary-json", default=None,
                       help="write a JSON summary of the run to this path (atomically)")
    return parser


def split_prism_tokens(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(parsed prism and known Megatron flags, the `--prism-*` tokens, the script's own tokens) of a
    training script's command line.

    The `--prism-*` options and their values are taken out by the parser's own table of options
    (how many values each takes), in order; every other token stays, in order."""
    prism = OneLineParser(prog="prism-megatron launch", allow_abbrev=False, add_help=False)
    _add_prism_group(prism)
    actions = {opt: a for a in prism._actions for opt in a.option_strings}
    removed, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        action = actions.get(token.split("=", 1)[0])
        if action is None:
            rest.append(token)
            i += 1
            continue
        taken = 1
        if "=" not in token and action.nargs != 0:
            if action.nargs in ("+", "*"):
                while i + taken < len(argv) and not argv[i + taken].startswith("-"):
                    taken += 1
            else:
                taken += 1 if action.nargs is None else int(action.nargs)
        removed += argv[i:i + taken]
        i += taken
    both = OneLineParser(prog="prism-megatron launch", allow_abbrev=False, add_help=False)
    add_megatron_args(_add_prism_group(both))
    known, _ = both.parse_known_args(argv)
    return known, removed, rest


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the common Megatron-LM flags, each mapped onto its config key."""
    group = parser.add_argument_group("megatron", "Megatron-LM flags (mapped onto the config)")
    for flag, key in MEGATRON_FLAGS.items():
        f, doc = _field(key)
        kind_name = str(f.type)
        if f.type in ("bool", bool):
            group.add_argument(flag, action="store_true", default=None, help=doc)
        elif "List" in kind_name:
            group.add_argument(flag, nargs="+", default=None, help=doc)
        elif "str" in kind_name:
            group.add_argument(flag, type=str, default=None, help=doc)
        else:
            kind = float if "float" in str(f.type) else int
            group.add_argument(flag, type=kind, default=None, help=doc)
    group.add_argument("--bf16", action="store_true", help="bf16 parameters and compute")
    group.add_argument("--fp16", action="store_true", help="fp16 parameters and compute")
    group.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                       help=field_docs(TrainConfig)["device"])
    return parser


def config_from_args(args: argparse.Namespace, config_file: Optional[str] = None) -> PrismConfig:
    """A validated `PrismConfig` from parsed flags (file < --prism-override < explicit flags)."""
    overrides = list(getattr(args, "prism_override", []) or [])
    names = []
    for name in PRISM_FLAGS:
        value = getattr(args, f"prism_{name}", None)
        if name == "sandbox_ranks" and value is not None:
            value, names = _split_sandbox(value)
        if value is not None:
            rendered = "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else value
            overrides.append(f"emulation.{name}={rendered}")
    for name in TRACE_FLAGS:
        value = getattr(args, f"prism_trace_{name}", None)
        if value is not None:
            overrides.append(f"trace.{name}={value}")
    for name in MOE_FLAGS:
        value = getattr(args, f"prism_moe_{name}", None)
        if value is not None:
            overrides.append(f"moe.{name}={value}")
    for flag, key in MEGATRON_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if isinstance(value, list):
            value = "[" + ",".join(map(str, value)) + "]"
        if value is not None:
            overrides.append(f"{key}={value}")
    if getattr(args, "bf16", False):
        overrides.append("model.params_dtype=bf16")
    if getattr(args, "fp16", False):
        overrides.append("model.params_dtype=fp16")
    if getattr(args, "device", None):
        overrides.append(f"train.device={args.device}")
    cfg = load_config(overrides, config_file or getattr(args, "prism_config", None))
    if names:
        cfg.emulation.sandbox_ranks = [*cfg.emulation.sandbox_ranks, *_resolve_roles(cfg, names)]
        ranks = ",".join(map(str, cfg.emulation.sandbox_ranks))
        cfg = load_config([*overrides, f"emulation.sandbox_ranks=[{ranks}]"],
                          config_file or getattr(args, "prism_config", None))
    return cfg


ROLE_NAMES = ("first-stage", "last-stage")


def _split_sandbox(values: list[str]) -> tuple[list[int], list[str]]:
    """`--prism-sandbox-ranks 0 last-stage` -> ([0], ["last-stage"]); anything else: a ConfigError."""
    ranks, names = [], []
    for v in values:
        if str(v).lstrip("-").isdigit():
            ranks.append(int(v))
        elif v in ROLE_NAMES:
            names.append(v)
        else:
            raise ConfigError(f"--prism-sandbox-ranks {v!r}: expected a virtual rank or one of "
                              f"{', '.join(ROLE_NAMES)} (other roles need a graph: `prism-megatron emulate "
                              "--sandbox`)")
    return ranks, names


def _resolve_roles(cfg: PrismConfig, names: list[str]) -> list[int]:
    from prism_megatron.world import VirtualWorld

    p, e = cfg.parallel, cfg.emulation
    if e.virtual_world_size is None:
        raise ConfigError("--prism-sandbox-ranks with role names needs --prism-virtual-world-size")
    world = VirtualWorld(world_size=e.virtual_world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp,
                         vpp=p.vpp, order=p.order, gpus_per_node=e.gpus_per_node)
    return [world.stage_rank(0 if n == "first-stage" else world.pp - 1) for n in names]
