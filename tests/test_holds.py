"""Closed-loop holds (emulate/holds.py): replayed with the replay's own figures they give back every
end it computed, and a sandbox that computes faster or slower than in the replay ends its iteration
where a replay of that sandbox does, which fixed waits do not."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prism_megatron.emulate.holds import START, holds, overlapped, read_plan, write_plan
from prism_megatron.graph.model import NO_PEER, RoleGraphBuilder, StringTable
from prism_megatron.graph.synthetic import synthetic_graph
from prism_megatron.sim.cluster import load_cluster
from prism_megatron.sim.des import Simulator
from prism_megatron.world import Role, VirtualWorld

COST = load_cluster("dgx_h100").cost_model()


def _scaled(g, factor: float):
    """`g` with its compute `factor` times as long (a sandbox measured again, faster or slower)."""
    cols = dict(g.columns)
    cols["duration_s"] = np.where(cols["kind"] == 0, cols["duration_s"] * factor, cols["duration_s"])
    # (a copy of dep_ptr: the replay tells graphs apart by it)
    return type(g)(**{**g.__dict__, "columns": cols, "dep_ptr": g.dep_ptr.copy()})


def _run_with_holds(g, plan) -> float:
    """The sandbox's iteration run for real with these holds, as the recorder and a clock do it, on
    one timeline: compute lasts what `g` says and holds the stream; a communication runs its local
    part (its recorded length), plans its end by the hold's rule (trace/clock.py's HoldBook) and, if
    synchronous, holds the stream until then; an overlapped one is waited for by the compute that
    depends on it. As in the replay, consecutive p2p of one stream wait only for being posted."""
    cols = g.columns
    kind, stream, dur = cols["kind"].tolist(), cols["stream"].tolist(), cols["duration_s"].tolist()
    p2p = (cols["peer_delta"] != NO_PEER).tolist()
    post, fin, ends = [0.0] * len(kind), [0.0] * len(kind), {}
    free = 0.0  # when the sandbox's stream is free
    ordinal = 0
    for i in range(len(kind)):
        ready = free if kind[i] == 0 else 0.0
        for d in g.dep_idx[g.dep_ptr[i]:g.dep_ptr[i + 1]].tolist():
            same_p2p = kind[i] != 0 and p2p[i] and p2p[d] and stream[d] == stream[i]
            ready = max(ready, post[d] if same_p2p else fin[d])
        post[i] = ready
        if kind[i] == 0:
            fin[i] = free = ready + dur[i]
            continue
        h = plan[ordinal]
        end = ready + dur[i] + h.self_s
        for anchor, ghost_s in h.terms:
            end = max(end, (0.0 if anchor == START else ends[anchor]) + ghost_s)
        ends[ordinal] = fin[i] = end
        if not h.at_wait:
            free = max(free, end)
        ordinal += 1
    return max(fin)


@pytest.mark.parametrize("pp_bytes", [8192, 64 << 20])
@pytest.mark.parametrize("rank", [0, 3, 5, 13])
def test_holds_give_back_the_replay_and_follow_a_sandbox_that_runs_faster_or_slower(rank, pp_bytes):
    world = VirtualWorld(world_size=16, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=4, optimizer_s=2e-3, pp_bytes=pp_bytes)
    mine = graph.graph_of(rank)
    replay = Simulator(graph, COST, rank_graphs={rank: mine}).run(causes=True)
    plan = holds(replay, rank, mine)
    assert len(plan) == int((mine.columns["kind"] != 0).sum()) and all(h is not None for h in plan)
    assert any(a != START for h in plan for a, _ in h.terms)  # paths through the sandbox
    assert _run_with_holds(mine, plan) == pytest.approx(replay.rank_times()[rank], rel=1e-12)
    for factor in (0.9, 0.97, 1.05, 1.3):
        again = _scaled(mine, factor)
        truth = Simulator(graph, COST, rank_graphs={rank: again}).run().rank_times()[rank]
        closed = _run_with_holds(again, plan)
        # fixed waits: the replay's end less the sandbox's arrival, whatever the sandbox does now
        fixed = [h._replace(terms=(), self_s=h.self_s + w)
                 for h, w in zip(plan, _fixed_waits(replay, rank, mine))]
        opened = _run_with_holds(again, fixed)
        assert abs(closed / truth - 1) < 1e-9, (factor, closed, truth)
        if abs(opened / truth - 1) > 1e-9:  # where the ghosts set the pace, fixed waits miss
            assert abs(closed - truth) < abs(opened - truth)


def _fixed_waits(replay, rank, g) -> list[float]:
    """Per communication node, what a fixed wait adds to its own part: the replay's end less the
    sandbox's arrival and its own part."""
    causes = replay.causes
    c = int(replay.class_of_rank[rank])
    out = []
    for i in np.nonzero(g.columns["kind"] != 0)[0].tolist():
        start, end, arrivals = causes.ops[causes.keys[(c, i)]]
        mine = next(a for a in arrivals if a[0] == c and a[2] == i)
        out.append((end - mine[1]) - (end - start))
    return out


def test_a_ghost_chain_that_never_meets_the_sandbox_is_anchored_at_the_iteration_start():
    """TP2 x PP2 with the sandbox at stage 1: its first receive waits for stage 0, whose forward
    never waited for the sandbox, so that ghost's arrival counts from the iteration's start."""
    world = VirtualWorld(world_size=4, tp=2, pp=2)
    graph = synthetic_graph(world, microbatches=2)
    rank = world.representative(Role(pp=1, tp=0, cp=0, ep=0, etp=0))
    mine = graph.graph_of(rank)
    replay = Simulator(graph, COST, rank_graphs={rank: mine}).run(causes=True)
    plan = holds(replay, rank, mine)
    assert plan[0].terms == ((START, pytest.approx(plan[0].terms[0][1])),) and plan[0].terms[0][1] > 0
    assert _run_with_holds(mine, plan) == pytest.approx(replay.rank_times()[rank], rel=1e-12)


def test_which_operations_overlap_and_a_plan_round_trips(tmp_path):
    """Held at the wait: tests/test_trace.py (the recorder); here, which operations overlap (none
    waits for the last one: it is held nowhere) and the plan file."""
    b = RoleGraphBuilder(Role(pp=0, tp=0, cp=0, ep=0, etp=0), 0, StringTable())
    kw = dict(dtype="bfloat16", seq=0, start_s=0.0)
    a = b.compute("a", stream="compute", start_s=0.0, duration_s=1.0)
    sync = b.comm("all_reduce", dim="tp", nbytes=8, stream="comm.tp", duration_s=0.1, deps=[a], **kw)
    c = b.compute("c", stream="compute", start_s=0.0, duration_s=1.0, deps=[a, sync])
    late = b.comm("reduce_scatter", dim="dp", nbytes=8, stream="comm.dp", duration_s=0.1, deps=[c], **kw)
    d = b.compute("d", stream="compute", start_s=0.0, duration_s=1.0, deps=[c])
    e = b.compute("e", stream="compute", start_s=0.0, duration_s=1.0, deps=[d, late])
    b.comm("all_reduce", dim="dp", nbytes=8, stream="comm.dp", duration_s=0.1, deps=[e], **kw)
    assert overlapped(b.build()).tolist() == [False, True, True]
    world = VirtualWorld(world_size=16, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=2)
    replay = Simulator(graph, COST).run(causes=True)  # ghost-only: the sandbox shares its role's class
    plan = holds(replay, 5, graph.graph_of(5))
    write_plan(tmp_path / "plan.json", {5: plan})
    assert read_plan(str(tmp_path / "plan.json"), 5) == plan
    with pytest.raises(KeyError):
        read_plan(str(tmp_path / "plan.json"), 6)
    assert all(math.isfinite(h.self_s) and all(math.isfinite(g) for _, g in h.terms) for h in plan)


def _run_with_book(g, plan, extra_s: float, compensate: bool = True) -> tuple[float, object]:
    """`_run_with_holds` through the clocks' own book (trace/clock.py's HoldBook) with each
    operation stamped where it begins and its local part `extra_s` longer than recorded (the
    backend's host work, past what the replay gives it). Unlike `_run_with_holds`, an operation ends
    no earlier than its issue. `compensate=False`: the debt is forgiven at once, as holds were before
    it was kept (every overrun stays in the wall). Returns the iteration's end and the book."""
    from prism_megatron.trace.clock import HoldBook

    book = HoldBook([(h.self_s, h.terms, h.transfer_s) for h in plan])
    book.begin(0.0)
    cols = g.columns
    kind, stream, dur = cols["kind"].tolist(), cols["stream"].tolist(), cols["duration_s"].tolist()
    p2p = (cols["peer_delta"] != NO_PEER).tolist()
    post, fin = [0.0] * len(kind), [0.0] * len(kind)
    ordinal_of, waited = {}, set()
    free = 0.0
    for i in range(len(kind)):
        ready = free if kind[i] == 0 else 0.0
        deps = g.dep_idx[g.dep_ptr[i]:g.dep_ptr[i + 1]].tolist()
        for d in deps:
            same_p2p = kind[i] != 0 and p2p[i] and p2p[d] and stream[d] == stream[i]
            if not (kind[i] == 0 and kind[d] != 0 and plan[ordinal_of[d]].at_wait):
                ready = max(ready, post[d] if same_p2p else fin[d])
        if kind[i] == 0:  # waits for overlapped operations: held to their planned ends from here
            for d in deps:
                if kind[d] != 0 and plan[ordinal_of[d]].at_wait and d not in waited:
                    waited.add(d)
                    fin[d] = max(ready, book.goal([ordinal_of[d]], ready))
                ready = max(ready, fin[d])
            fin[i] = free = ready + dur[i]
            continue
        k = ordinal_of[i] = len(ordinal_of)
        post[i] = ready
        book.stamp(k, ready)
        entry = ready + dur[i] + extra_s
        book.plan([k], entry)
        if not compensate:
            book.debt = 0.0
        if plan[k].at_wait:  # until it is waited for, what follows on its stream sees its planned end
            fin[i] = max(entry, book.ends[k] + book.debt)
        else:
            fin[i] = max(entry, book.goal([k], entry))
            free = max(free, fin[i])
    return max(fin), book


@pytest.mark.parametrize("rank", [0, 5, 13])
def test_the_backends_own_time_is_paid_back_out_of_later_holds(rank):
    """An operation whose local part runs past its planned end runs up a debt that later holds pay
    back: the iteration ends at the replay's end plus what is left of the debt, exactly, and no later
    than when every overrun stays in the wall. Here even the recorded local parts of some operations
    outlast their modelled transfers."""
    world = VirtualWorld(world_size=16, tp=2, pp=4)
    graph = synthetic_graph(world, microbatches=4, optimizer_s=2e-3, pp_bytes=64 << 20)
    mine = graph.graph_of(rank)
    replay = Simulator(graph, COST, rank_graphs={rank: mine}).run(causes=True)
    plan = holds(replay, rank, mine)
    truth = replay.rank_times()[rank]
    assert all(h.transfer_s is not None for h in plan)
    for extra in (0.0, 2 * max(h.transfer_s for h in plan)):  # then every operation overruns
        end, book = _run_with_book(mine, plan, extra)
        assert end == pytest.approx(truth + book.accrued_s - book.absorbed_s, rel=1e-9)
        kept, _ = _run_with_book(mine, plan, extra, compensate=False)
        assert truth <= end <= kept
        if extra:  # (a last stage waits on ghost chains from the iteration's start anyway: equal)
            assert book.absorbed_s > 0 and (end < kept or rank == 13)
        unstamped, again = _run_with_book(mine, [h._replace(transfer_s=None) for h in plan], extra)
        if not extra:  # with the recorded local parts, the stamp changes nothing
            assert unstamped == pytest.approx(end, rel=1e-12) and again.accrued_s == pytest.approx(book.accrued_s)
