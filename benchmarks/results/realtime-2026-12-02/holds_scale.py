"""What the realtime plan costs at scale, and what pausing the garbage collector changes: a replay of
a synthetic TP8 x PP16 world of 8192 ranks with sandbox 4711 in its own class, plain and with causes,
then its holds; each with the collector paused (as the code does) and on (as before).

    python benchmarks/results/realtime-2026-12-02/holds_scale.py [--keep] [MICROBATCHES ...]

--keep: every result stays alive (a larger heap for the collector) and the collector-on run goes
first.
"""

import gc
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import prism_megatron.emulate.holds as holds_module  # noqa: E402
import prism_megatron.sim.des as des  # noqa: E402
from prism_megatron.graph.synthetic import synthetic_graph  # noqa: E402
from prism_megatron.sim.cluster import load_cluster  # noqa: E402
from prism_megatron.world import VirtualWorld  # noqa: E402
import contextlib  # noqa: E402

cost = load_cluster("dgx_h100").cost_model()
world = VirtualWorld(world_size=8192, tp=8, pp=16)
paused = des.gc_paused
keep = "--keep" in sys.argv
kept = []
for m in [int(x) for x in sys.argv[1:] if x != "--keep"] or [24, 64]:
    graph = synthetic_graph(world, microbatches=m, optimizer_s=2e-3)
    mine = graph.graph_of(4711)
    for mode in ("on", "paused") if keep else ("paused", "on"):
        ctx = paused if mode == "paused" else contextlib.nullcontext
        des.gc_paused = holds_module.gc_paused = ctx
        if not keep:
            gc.collect()
        t = time.perf_counter()
        des.Simulator(graph, cost, rank_graphs={4711: mine}).run()
        plain = time.perf_counter() - t
        t = time.perf_counter()
        result = des.Simulator(graph, cost, rank_graphs={4711: mine}).run(causes=True)
        with_causes = time.perf_counter() - t
        t = time.perf_counter()
        plan = holds_module.holds(result, 4711, mine)
        planning = time.perf_counter() - t
        print(f"microbatches {m:>3}, collector {mode:<6}: replay {plain:6.2f} s, with causes "
              f"{with_causes:6.2f} s, holds {planning:6.2f} s ({len(plan)} operations, "
              f"{len(result.classes)} classes, at most {max(len(h.terms) for h in plan)} paths)")
        if keep:
            kept.append((result, plan))
        del result, plan
