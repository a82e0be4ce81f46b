"""`prism-megatron export`: a graph's Perfetto/Chrome trace of ranks, Chakra ET files."""

from __future__ import annotations

from prism_megatron.config import ConfigError


def add_arguments(cmd) -> None:
    cmd.add_argument("graph", help="graph file written by `capture`")
    cmd.add_argument("--ranks", default="0", help="virtual ranks to export, e.g. 0,4711")
    cmd.add_argument("--perfetto", default=None, help="write a Chrome-trace JSON here")
    cmd.add_argument("--chakra", default=None, help="write Chakra ET files (one per rank) here")


def run(args) -> int:
    from prism_megatron.sim.cli import parse_ranks
    from prism_megatron.graph import load_graph
    from prism_megatron.graph.chakra import write_chakra
    from prism_megatron.graph.perfetto import write_chrome_trace

    if not (args.perfetto or args.chakra):
        raise ConfigError("nothing to export: give --perfetto PATH and/or --chakra DIR")
    ranks = parse_ranks(args.ranks)
    graph = load_graph(args.graph)
    bad = [r for r in ranks if not 0 <= r < graph.world.world_size]
    if bad:
        raise ConfigError(f"--ranks {bad} outside the virtual world of {graph.world.world_size}; "
                          f"choose ranks in 0..{graph.world.world_size - 1}")
    if args.perfetto:
        write_chrome_trace(graph, ranks, args.perfetto)
        print(f"perfetto: {args.perfetto}")
    if args.chakra:
        for path in write_chakra(graph, ranks, args.chakra):
            print(f"chakra: {path}")
    return 0
