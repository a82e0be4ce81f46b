"""How fast and how big VirtualWorld is at 8192 and 65,536 ranks.

Per configuration, on a fresh VirtualWorld each time:
  construct_s          building (and validating) the VirtualWorld, mean of many
  one_rank_groups_s    first answer of group(rank, dim) for every dim of one rank (cold caches)
  all_groups_s         groups(dim) for every dim (cold caches): every group megatron would build
  roles_s              roles() (cold group caches)
  megatron_get_ranks_s the same groups through megatron's RankGenerator.get_ranks, for comparison
  rss_bytes            process resident set size after the row

Usage: python benchmarks/world_init.py [--json PATH] [--no-megatron-baseline]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
import warnings

CONFIGS = [
    ("TP8 PP16", dict(tp=8, pp=16)),
    ("MoE TP4 PP8 EP8 ETP1", dict(tp=4, pp=8, ep=8, etp=1)),
]
WORLD_SIZES = (8192, 65536)


def rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, Linux units


def timed(fn) -> tuple[float, object]:
    gc.collect()  # so one row does not pay for collecting the garbage of the previous one
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def megatron_get_ranks_s(world) -> float:
    from prism_megatron.world.virtual_world import _SOURCE

    generators = world._generators()
    start = time.perf_counter()
    for which, token in _SOURCE.values():
        generators[which].get_ranks(token)
    return time.perf_counter() - start


def bench(name: str, world_size: int, sizes: dict, baseline: bool) -> dict:
    from prism_megatron.world import Dim, VirtualWorld

    repeats = 2000
    start = time.perf_counter()
    for _ in range(repeats):
        VirtualWorld(world_size=world_size, **sizes)
    construct_s = (time.perf_counter() - start) / repeats

    rank = world_size // 2 + 3
    world = VirtualWorld(world_size=world_size, **sizes)
    one_rank_s, _ = timed(lambda: [world.group(rank, d) for d in Dim])

    world = VirtualWorld(world_size=world_size, **sizes)
    all_groups_s, groups = timed(lambda: {d: world.groups(d) for d in Dim})

    world = VirtualWorld(world_size=world_size, **sizes)
    roles_s, roles = timed(world.roles)

    return {
        "config": name,
        "world_size": world_size,
        "construct_s": construct_s,
        "one_rank_groups_s": one_rank_s,
        "all_groups_s": all_groups_s,
        "num_groups": sum(len(g) for g in groups.values()),
        "roles_s": roles_s,
        "num_roles": len(roles),
        "megatron_get_ranks_s": megatron_get_ranks_s(world) if baseline else None,
        "rss_bytes": rss_bytes(),
    }


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'config':<22}{'N':>7}{'construct':>11}{'one rank':>10}{'all groups':>12}"
        f"{'#groups':>9}{'roles':>8}{'#roles':>7}{'megatron':>10}{'ratio':>7}{'RSS MiB':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        mega = r["megatron_get_ranks_s"]
        mega_s = f"{mega:9.3f}s" if mega is not None else f"{'-':>10}"
        ratio = f"{mega / r['all_groups_s']:6.0f}x" if mega is not None else f"{'-':>7}"
        print(
            f"{r['config']:<22}{r['world_size']:>7}{r['construct_s'] * 1e6:>9.1f}us"
            f"{r['one_rank_groups_s'] * 1e3:>8.1f}ms{r['all_groups_s']:>11.3f}s"
            f"{r['num_groups']:>9}{r['roles_s'] * 1e3:>6.0f}ms{r['num_roles']:>7}"
            f"{mega_s}{ratio}{r['rss_bytes'] / 2**20:>9.0f}"
        )
    print("construct: mean of 2000; one rank / all groups / roles: cold caches; megatron: the same "
          "groups via RankGenerator.get_ranks; ratio = megatron / all groups")


def write_json(path: str, payload: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".world_init.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    parser.add_argument("--no-megatron-baseline", action="store_true",
                        help="skip timing megatron's own RankGenerator.get_ranks (slow at 65,536)")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")  # megatron's "no Transformer Engine / Apex" notices
    rss_before_import = rss_bytes()
    # Paid once per process by the first group query; timed apart so the rows show our own cost.
    import_s, _ = timed(lambda: __import__("megatron.core.parallel_state"))
    print(f"import megatron.core.parallel_state: {import_s:.2f}s, "
          f"RSS {rss_before_import / 2**20:.0f} -> {rss_bytes() / 2**20:.0f} MiB\n")

    rows = [
        bench(name, n, sizes, baseline=not args.no_megatron_baseline)
        for n in WORLD_SIZES
        for name, sizes in CONFIGS
    ]
    print_table(rows)
    if args.json:
        payload = {"benchmark": "world_init", "megatron_import_s": import_s, "rows": rows}
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
