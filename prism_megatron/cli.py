"""`prism-megatron`: the command line. Subcommands take omegaconf overrides (`parallel.tp=8`).

    prism-megatron train [--config FILE] [key=value ...] [--json PATH]   run examples/pretrain_gpt.py
    prism-megatron world [--config FILE] [key=value ...] [--rank R]      a virtual rank's coordinates/groups
    prism-megatron config [--config FILE] [key=value ...]                the resolved config, or its keys

Without `--config`, `train` and `world` use the built-in default `configs/default.yaml` (one rank of a
TP8 PP16 DP64 job of 8192 ranks). Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

from prism_megatron.config import ConfigError, load_config, to_yaml
from prism_megatron.config.flags import _SECTIONS, OneLineParser, field_docs
from prism_megatron.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="prism-megatron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "train a GPT as one rank of the virtual world"),
                       ("world", "show a virtual rank's coordinates, role and groups"),
                       ("config", "print the resolved config (--keys: every key with its doc)")):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.error = parser.error  # subcommand usage errors: one line too
        cmd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                         help="config overrides, e.g. model=tiny_moe parallel.tp=2")
        cmd.add_argument("--config", default=None, help="YAML config file (default: configs/default.yaml)")
        if name == "train":
            cmd.add_argument("--json", default=None, help="write the run summary JSON here")
        if name == "world":
            cmd.add_argument("--rank", type=int, default=None, help="virtual rank (default: sandbox)")
            cmd.add_argument("--json", default=None, help="write the description as JSON here")
        if name == "config":
            cmd.add_argument("--keys", action="store_true", help="list every key with its doc")
    return parser


def _config_file(arg: Optional[str]) -> Optional[str]:
    if arg is not None:
        return arg
    return str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None


def _cmd_train(args) -> int:
    example = REPO / "examples" / "pretrain_gpt.py"
    if not example.is_file():
        raise ConfigError(f"{example} not found; `train` runs the repository's example, so use a "
                          "checkout installed with `pip install -e .`")
    load_config(args.overrides, _config_file(args.config))  # fail fast, before importing megatron
    spec = importlib.util.spec_from_file_location("pretrain_gpt", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--prism-override", *args.overrides]
    config_file = _config_file(args.config)
    if config_file:
        argv += ["--prism-config", config_file]
    if args.json:
        argv += ["--prism-summary-json", args.json]
    return module.main(argv)


def _cmd_world(args) -> int:
    from prism_megatron.world import VirtualWorld

    cfg = load_config(args.overrides, _config_file(args.config))
    p, e = cfg.parallel, cfg.emulation
    if e.virtual_world_size is None:
        raise ConfigError("no virtual world: set emulation.virtual_world_size=N")
    world = VirtualWorld(world_size=e.virtual_world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                         etp=p.etp, vpp=p.vpp, order=p.order, gpus_per_node=e.gpus_per_node)
    rank = args.rank if args.rank is not None else (e.sandbox_ranks or [0])[0]
    if not 0 <= rank < world.world_size:
        raise ConfigError(f"--rank {rank} is outside the virtual world of {world.world_size} ranks")
    groups = {}
    for dim in ("tp", "cp", "dp", "pp", "ep", "etp", "expert_dp", "dp_cp", "tp_pp", "embedding"):
        members = world.group(rank, dim)
        if rank in members:
            groups[dim] = list(members)
    info = {"virtual_rank": rank, "virtual_world_size": world.world_size, "node": world.node(rank),
            "coords": world.coords(rank), "role": str(world.role(rank)), "roles": len(world.roles()),
            "dp": world.dp, "groups": groups}
    for key, value in info.items():
        if key != "groups":
            print(f"{key:>20}: {value}")
    for dim, members in groups.items():
        shown = members if len(members) <= 16 else members[:8] + ["..."] + members[-4:]
        print(f"{'group ' + dim:>20}: {len(members)} ranks {shown}")
    if args.json:
        atomic_write_text(args.json, json.dumps(info, indent=1))
    return 0


def _cmd_config(args) -> int:
    if args.keys:
        for section, cls in _SECTIONS.items():
            docs = field_docs(cls)
            for f in fields(cls):
                print(f"{section}.{f.name} = {getattr(cls(), f.name)!r}\n    {docs.get(f.name, '')}")
        return 0
    print(to_yaml(load_config(args.overrides, args.config)), end="")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `prism-megatron config --keys | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = _parser().parse_args(argv)
    try:
        return {"train": _cmd_train, "world": _cmd_world, "config": _cmd_config}[args.command](args)
    except ConfigError as err:
        print(f"prism-megatron: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
