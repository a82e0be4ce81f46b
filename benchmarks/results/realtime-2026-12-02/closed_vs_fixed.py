"""Closed-loop holds against fixed waits on synthetic worlds: the sandbox's graph run with compute
0.9-1.3x the replay's (tests/test_holds.py's executor), each against a DES replay of that sandbox.
Prints the error of each, per world, rank and factor.

    python benchmarks/results/realtime-2026-12-02/closed_vs_fixed.py
"""
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_holds import *
from test_holds import _scaled,_run_with_holds,_fixed_waits
for n,tp,pp in [(16,2,4),(64,2,4),(8,8,1)]:
  world = VirtualWorld(world_size=n, tp=tp, pp=pp)
  graph = synthetic_graph(world, microbatches=4, optimizer_s=2e-3)
  for rank in [0, n//2+1, n-1]:
    mine = graph.graph_of(rank)
    replay = Simulator(graph, COST, rank_graphs={rank: mine}).run(causes=True)
    plan = holds(replay, rank, mine)
    row=[]
    for factor in (0.9, 0.97, 1.05, 1.3):
        again = _scaled(mine, factor)
        truth = Simulator(graph, COST, rank_graphs={rank: again}).run().rank_times()[rank]
        closed = _run_with_holds(again, plan)
        fixed = [h._replace(terms=(), self_s=h.self_s + w) for h, w in zip(plan, _fixed_waits(replay, rank, mine))]
        opened = _run_with_holds(again, fixed)
        row.append(f"{factor}: closed {100*(closed/truth-1):+.2f} open {100*(opened/truth-1):+.2f}")
    print(n,tp,pp,rank, " | ".join(row))
