"""`prism-megatron world`: a virtual rank's coordinates, role and groups."""

from __future__ import annotations

import json

from prism_megatron.commands import add_config_arguments
from prism_megatron.config import ConfigError, load_config
from prism_megatron.config.job import config_file as _config_file
from prism_megatron.util import atomic_write_text


def add_arguments(cmd) -> None:
    add_config_arguments(cmd)
    cmd.add_argument("--rank", type=int, default=None, help="virtual rank (default: sandbox)")
    cmd.add_argument("--json", default=None, help="write the description as JSON here")


def run(args) -> int:
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
