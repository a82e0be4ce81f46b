"""Discrete-event replay of an ExecutionGraph over all N ranks, simulated as equivalence classes.

Each class (sim/classes.py) runs its role's graph: every node starts when its dependencies are done
(program order per stream, issue, waits), so compute and communication streams run concurrently; a
node's compute time is the captured one, times the class's slowdown. A collective starts when the
last member class arrives (all members of a group that are in one class arrive together) and lasts
what the cost model says for its op, bytes and the group's placement. Point-to-point: a send and its
matching receive (same dim, opposite offset, same ordinal) transfer once both are posted; like
NCCL's grouped p2p, consecutive p2p operations of a stream do not wait for each other's completion,
only for being posted, while anything that waits on the transfer waits for its end.

Classes advance in turns: each runs until it needs something another class has not produced yet.
If no class can advance before all are done the graph deadlocks, which is reported with the stuck
nodes (it means the captured roles do not match up).

Outputs per class: iteration time (the last node's end), compute busy time, exposed communication
(time a collective runs while no compute does), pipeline bubble (time with neither), and the
critical path of the job (the chain of nodes that determined the end, across classes). Per rank,
`rank_periods` gives the steady-state iteration time of a job running iterations back to back.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from prism_megatron.comm.cost import CostModel, Placement
from prism_megatron.graph.model import NO_PEER, ExecutionGraph, NodeKind, RoleGraph
from prism_megatron.sim.classes import initial_labels, rank_classes
from prism_megatron.sim.sharing import TOLERANCE_S, extra_times
from prism_megatron.util import gc_paused

_UNMATCHED = frozenset({"other"})
MAX_SHARING_PASSES = 8
STEADY_PASSES = 4  # replays after the first for steady-state periods (a DP straggler needs 2)


class SimulationError(RuntimeError):
    """The graph cannot be replayed (a deadlock: roles whose communication does not match)."""


@dataclass
class _Prepared:
    """Per distinct RoleGraph: Python lists for the hot loop."""

    names: list[str]
    kinds: list[int]
    streams: list[int]
    durations: list[float]
    deps: list[tuple[int, ...]]
    comm: list[Optional[tuple]]  # (op, dim, nbytes, key) for comm nodes; key = ordinal key
    p2p: list[bool]


def _prepare(graph: ExecutionGraph, g: RoleGraph) -> _Prepared:
    cols = g.columns
    kinds = cols["kind"].tolist()
    names = [graph.string(i) for i in cols["name"].tolist()]
    ops = [graph.string(i) for i in cols["op"].tolist()]
    dims = [graph.string(i) for i in cols["dim"].tolist()]
    deltas = cols["peer_delta"].tolist()
    nbytes = cols["nbytes"].tolist()
    ptr, idx = g.dep_ptr.tolist(), g.dep_idx.tolist()
    deps = [tuple(idx[ptr[i]:ptr[i + 1]]) for i in range(len(kinds))]
    counters: dict[tuple, int] = {}
    comm: list[Optional[tuple]] = []
    p2p = []
    for i, kind in enumerate(kinds):
        if kind != NodeKind.COMM:
            comm.append(None)
            p2p.append(False)
            continue
        is_p2p = deltas[i] != NO_PEER
        key = (dims[i], ops[i], deltas[i]) if is_p2p else (dims[i],)
        k = counters.get(key, 0)
        counters[key] = k + 1
        comm.append((ops[i], dims[i], nbytes[i], k, deltas[i] if is_p2p else None))
        p2p.append(is_p2p)
    return _Prepared(names, kinds, cols["stream"].tolist(), cols["duration_s"].tolist(), deps, comm, p2p)


@dataclass
class ClassResult:
    """One class of ranks after the replay."""

    members: int
    representative: int
    iteration_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float


@dataclass
class ReplayCauses:
    """Per class (lists by node): `fin[c][i]` when node i ended and `why[c][i]` the (class, node)
    whose end made it ready (None: nothing did); `keys[(c, i)]` the operation a communication node
    took part in, and `ops[key] = (start, end, arrivals)`, with an arrival (class, ready, node, cause)
    per member class (a collective) or side (p2p); `offset[c]` when the class began; `deps[c][i]`
    node i's dependencies, `p2p[c][i]` and `streams[c][i]` whether it is p2p and its stream (p2p of
    one stream wait only for each other's posting), `compute_s[c][i]` its compute time as replayed
    (0 for communication)."""

    fin: list
    why: list
    keys: dict
    ops: dict
    offset: list
    deps: list
    p2p: list
    streams: list
    compute_s: list


@dataclass
class SimResult:
    iteration_s: float
    classes: list[ClassResult]
    class_of_rank: np.ndarray
    critical_path: list[tuple[int, str, float, float]] = field(default_factory=list)
    timelines: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    sim_wall_s: float = 0.0
    sharing_passes: int = 1
    """Replays until bandwidth sharing reached its fixed point (sim/sharing.py)."""
    shared_ops: int = 0
    """Operations slowed by a concurrent transfer on one of their ranks' links."""
    causes: Optional[ReplayCauses] = None
    """Who waited for whom (`run(causes=True)`): realtime emulation's holds are made of it."""

    def rank_times(self) -> np.ndarray:
        """Per rank, one iteration from the common start (or its own `start_s`) to its last node."""
        times = np.asarray([c.iteration_s for c in self.classes])
        return times[self.class_of_rank]


class Simulator:
    """Replays `graph` on a cluster described by `cost` (see the module docstring)."""

    def __init__(self, graph: ExecutionGraph, cost: CostModel, *,
                 slowdown: Optional[dict[int, float]] = None, per_rank: bool = False,
                 rank_graphs: Optional[dict[int, RoleGraph]] = None,
                 start_s: Optional[dict[int, float]] = None, share_bandwidth: bool = True,
                 link_slowdown: Optional[dict[int, float]] = None) -> None:
        """`rank_graphs`: graphs of individual ranks (recorded on every rank of a real run) that
        replace their role's graph; they use `graph.strings`. `start_s`: when those ranks began the
        iteration (default 0: all together); a rank's iteration time is counted from its start.
        `share_bandwidth`: concurrent transfers of a rank on one link share it (sim/sharing.py).
        `slowdown`: rank -> factor on its compute; `link_slowdown`: rank -> factor on the transfer
        time of every operation it takes part in (a degraded link or NIC: a ring or a pair moves at
        its slowest member's pace). Both split classes only where they reach (faults/)."""
        self.graph, self.cost, self.world = graph, cost, graph.world
        self.rank_graphs = dict(rank_graphs or {})
        self.start_s = {int(k): float(v) for k, v in (start_s or {}).items()}
        self.slowdown = {int(k): float(v) for k, v in (slowdown or {}).items()}
        self.link_slowdown = {int(k): float(v) for k, v in (link_slowdown or {}).items()}
        bad = [r for r in [*self.slowdown, *self.link_slowdown] if not 0 <= r < self.world.world_size]
        if bad:
            raise ValueError(f"slowdown for ranks {bad} outside the virtual world of "
                             f"{self.world.world_size}")
        self.per_rank = per_rank
        self.share_bandwidth = share_bandwidth

    def rank_periods(self, first: SimResult, max_passes: int = STEADY_PASSES) -> np.ndarray:
        """Per rank, the steady-state iteration time: from one of its iteration ends to the next,
        the figure a per-rank log of a job running iterations back to back shows.

        `first` is this simulator's replay of one iteration from a common start. `rank_times` counts
        each rank from that start, so in a job with a straggler the ranks that finish early look
        faster and the straggler slower than they are: each next iteration starts where the rank's
        last one ended, and everyone then waits for the straggler again (a DP straggler's whole loop
        is every rank's period). Each further replay starts every rank at its previous end (plus its
        injected stall, which a rank's own log includes), until the periods stop changing."""
        n = self.world.world_size
        stall = np.zeros(n)
        for rank, seconds in self.start_s.items():
            stall[rank] = seconds
        finish = stall + first.rank_times()
        periods = None
        for _ in range(max_passes):
            start = finish + stall
            again = copy.copy(self)
            again.start_s = {r: float(start[r]) for r in range(n)}
            new_finish = start + again.run().rank_times()
            new = new_finish - finish
            if periods is not None and float(np.max(np.abs(new - periods))) <= TOLERANCE_S:
                return new
            periods, finish = new, new_finish
        return periods

    # -- classes -------------------------------------------------------------------------------

    def _classes(self) -> np.ndarray:
        world = self.world
        if self.per_rank:
            return np.arange(world.world_size)
        roles = world.roles()
        keys = {r: id(self.graph.roles[r].dep_ptr) for r in roles}
        dims = set()
        graphs = [*self.graph.roles.values(), *self.rank_graphs.values()]
        for g in {id(g.dep_ptr): g for g in graphs}.values():
            for i in set(g.columns["dim"][g.columns["kind"] == NodeKind.COMM].tolist()):
                dim = self.graph.string(int(i))
                if dim not in _UNMATCHED and dim != "world":
                    dims.add(dim)
        perturbed = {*self.slowdown, *self.link_slowdown, *self.start_s}
        labels = initial_labels(world, keys, {r: (self.slowdown.get(r, 1.0), self.link_slowdown.get(r, 1.0),
                                                  self.start_s.get(r, 0.0)) for r in perturbed})
        if self.rank_graphs:  # ranks with their own graph start in classes of their own
            ids: dict[int, int] = {}
            base = int(labels.max()) + 1
            for rank, g in self.rank_graphs.items():
                labels[rank] = base + ids.setdefault(id(g.dep_ptr), len(ids))
        return rank_classes(world, labels, dims)

    def _graph_of(self, rank: int) -> RoleGraph:
        return self.rank_graphs.get(rank) or self.graph.graph_of(rank)

    # -- the replay ----------------------------------------------------------------------------

    def run(self, keep_timelines: tuple[int, ...] = (), causes: bool = False) -> SimResult:
        """Replay one iteration; `keep_timelines`: ranks whose (post, fin) per node are kept;
        `causes`: keep who waited for whom (`SimResult.causes`)."""
        with gc_paused():
            return self._run(keep_timelines, causes)

    def _run(self, keep_timelines: tuple[int, ...], causes: bool) -> SimResult:
        start_wall = time.perf_counter()
        class_of_rank = self._classes()
        n_classes = int(class_of_rank.max()) + 1
        order = np.argsort(class_of_rank, kind="stable")
        reps = order[np.searchsorted(class_of_rank[order], np.arange(n_classes))].tolist()
        counts = np.bincount(class_of_rank, minlength=n_classes)
        prepared: dict[int, _Prepared] = {}
        plan = []
        for rep in reps:
            g = self._graph_of(rep)
            if id(g.dep_ptr) not in prepared:
                prepared[id(g.dep_ptr)] = _prepare(self.graph, g)
            plan.append(prepared[id(g.dep_ptr)])
        extra: dict = {}
        for passes in range(1, MAX_SHARING_PASSES + 1):
            record = ({}, {}) if causes else None
            post, fin, why, flows = self._replay(class_of_rank, reps, plan, extra, record)
            if not self.share_bandwidth:
                break
            new = extra_times(flows)
            if all(abs(new.get(k, 0.0) - extra.get(k, 0.0)) <= TOLERANCE_S for k in {*new, *extra}):
                break
            extra = new
        results = []
        for c in range(n_classes):
            results.append(_class_result(plan[c], post[c], fin[c], self.start_s.get(reps[c], 0.0),
                                         int(counts[c]), reps[c]))
        iteration = max(r.iteration_s for r in results)
        result = SimResult(iteration_s=iteration, classes=results, class_of_rank=class_of_rank,
                           sharing_passes=passes, shared_ops=len(extra))
        result.critical_path = _critical_path(plan, post, fin, why, results)
        for rank in keep_timelines:
            c = int(class_of_rank[rank])
            result.timelines[rank] = (np.asarray(post[c]), np.asarray(fin[c]))
        if record is not None:
            slow = [self.slowdown.get(rep, 1.0) for rep in reps]
            result.causes = ReplayCauses(
                fin=fin, why=why, keys=record[0], ops=record[1],
                offset=[self.start_s.get(rep, 0.0) for rep in reps],
                deps=[q.deps for q in plan], p2p=[q.p2p for q in plan], streams=[q.streams for q in plan],
                compute_s=[[d * f if q.comm[k] is None else 0.0 for k, d in enumerate(q.durations)]
                           for q, f in zip(plan, slow)])
        result.sim_wall_s = time.perf_counter() - start_wall
        return result

    def _replay(self, class_of_rank: np.ndarray, reps: list[int], plan: list[_Prepared], extra: dict,
                record: Optional[tuple[dict, dict]] = None):
        """One replay; `extra`: seconds added to each shared transfer (by operation key). Returns
        per class the post and finish time and cause of every node, and the transfers it ran.
        `record`: (keys, ops) to fill as `ReplayCauses` describes."""
        world = self.world
        n_classes = len(reps)
        slow = [self.slowdown.get(rep, 1.0) for rep in reps]
        link = [self.link_slowdown.get(rep, 1.0) for rep in reps]
        offset = [self.start_s.get(rep, 0.0) for rep in reps]
        n = [len(p.kinds) for p in plan]
        post = [[math.nan] * k for k in n]
        fin = [[math.nan] * k for k in n]
        why: list[list] = [[None] * k for k in n]
        ptr = [0] * n_classes
        partners: dict[tuple[int, str], tuple[int, ...]] = {}
        placements: dict[tuple[int, str], Placement] = {}
        pending: dict[tuple, dict[int, tuple[float, int]]] = {}
        done: dict[tuple, tuple] = {}  # key -> (start, end, cause of the last arrival)
        flows: list[tuple] = []

        def group_info(c: int, dim: str):
            key = (c, dim)
            if key not in partners:
                members = world.group(reps[c], dim) if dim != "world" else tuple(range(world.world_size))
                partners[key] = tuple(sorted({int(class_of_rank[m]) for m in members}))
                placements[key] = _placement(world, members)
            return partners[key], placements[key]

        def peer_class(c: int, dim: str, delta: int) -> tuple[int, int, int]:
            members = world.group(reps[c], dim) if dim != "world" else tuple(range(world.world_size))
            peer = members[(members.index(reps[c]) + delta) % len(members)]
            return int(class_of_rank[peer]), peer, len(members)

        remaining = n_classes
        finished = [n[c] == 0 for c in range(n_classes)]
        remaining -= sum(finished)
        while remaining:
            progressed = False
            for c in range(n_classes):
                if finished[c]:
                    continue
                p, i = plan[c], ptr[c]
                P_post, P_fin, P_why = post[c], fin[c], why[c]
                while i < n[c]:
                    ready, cause = offset[c], None
                    blocked = False
                    for d in p.deps[i]:
                        t = P_post[d] if (p.p2p[i] and p.p2p[d] and p.streams[d] == p.streams[i]) \
                            else P_fin[d]
                        if t != t:  # nan: not known yet
                            blocked = True
                            break
                        if t > ready:
                            ready, cause = t, (c, d)
                    if blocked:
                        break
                    meta = p.comm[i]
                    if meta is None:
                        P_post[i] = ready
                        P_fin[i] = ready + p.durations[i] * slow[c]
                        P_why[i] = cause
                        i += 1
                        continue
                    op, dim, nbytes, k, delta = meta
                    if dim in _UNMATCHED:  # not a megatron group: local, costless
                        P_post[i] = P_fin[i] = ready
                        P_why[i] = cause
                        i += 1
                        continue
                    if delta is None:
                        members, placement = group_info(c, dim)
                        key = (dim, members, k)
                        if record is not None:
                            record[0][(c, i)] = key
                        if key not in done:
                            arrived = pending.setdefault(key, {})
                            arrived[c] = (ready, i, cause, nbytes)
                            if len(arrived) < len(members):
                                P_post[i] = ready
                                break
                            t0, lcause = max(((v[0], v[2]) for v in arrived.values()), key=lambda x: x[0])
                            # members' sizes differ only where the data decides (an MoE all-to-all):
                            # the operation lasts as long as its largest member's share
                            nbytes = max(v[3] for v in arrived.values())
                            latency, transfer, kind = self.cost.parts(op, nbytes, placement)
                            transfer *= max(link[m] for m in members)
                            end = t0 + latency + transfer + extra.get(key, 0.0)
                            flows.append((key, members, kind, t0 + latency, transfer))
                            done[key] = (t0, end, lcause)
                            if record is not None:
                                record[1][key] = (t0, end, [(m, v[0], v[1], v[2])
                                                            for m, v in arrived.items()])
                            del pending[key]
                        t0, end, lcause = done[key]
                        P_post[i] = t0  # when the operation runs (all members there)
                        P_fin[i] = end
                        P_why[i] = lcause
                        i += 1
                        continue
                    # point to point: key by (sender class, receiver class, dim, offset, ordinal)
                    other, peer, size = peer_class(c, dim, delta)
                    send = op == "send"
                    key = (c, other, dim, delta % size, k) if send else (other, c, dim, (-delta) % size, k)
                    if record is not None:
                        record[0][(c, i)] = key
                    P_post[i] = ready
                    slot = pending.setdefault(key, {})
                    slot["send" if send else "recv"] = (ready, c, i, cause)
                    if len(slot) == 2:
                        (ts, sc, si, scause), (tr, rc, ri, rcause) = slot["send"], slot["recv"]
                        latency, transfer, kind = self.cost.parts("send", nbytes,
                                                                  _placement(world, (reps[c], peer)))
                        transfer *= max(link[sc], link[rc])
                        t0 = max(ts, tr)
                        end = t0 + latency + transfer + extra.get(key, 0.0)
                        flows.append((key, (sc, rc), kind, t0 + latency, transfer))
                        fin[sc][si] = fin[rc][ri] = end
                        why[sc][si] = why[rc][ri] = (scause if ts >= tr else rcause)
                        if record is not None:
                            record[1][key] = (t0, end, [(sc, ts, si, scause), (rc, tr, ri, rcause)])
                        del pending[key]
                    i += 1
                if i != ptr[c]:
                    progressed = True
                    ptr[c] = i
                if i >= n[c] and all(x == x for x in fin[c]):
                    finished[c] = True
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = [(reps[c], plan[c].names[ptr[c]] if ptr[c] < n[c] else "(waiting on p2p)")
                         for c in range(n_classes) if not finished[c]][:4]
                raise SimulationError(f"the replay deadlocks: {len(stuck)}+ classes wait forever, e.g. "
                                      f"rank {stuck[0][0]} at {stuck[0][1]}; the roles' communication "
                                      "does not match up (capture the graph again)")
        return post, fin, why, flows


def _placement(world, members) -> Placement:
    nodes: dict[int, int] = {}
    for m in members:
        node = m // world.gpus_per_node
        nodes[node] = nodes.get(node, 0) + 1
    return Placement(n=len(members), nodes=len(nodes), per_node=max(nodes.values()))


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _class_result(p: _Prepared, post: list, fin: list, offset: float, members: int,
                  rep: int) -> ClassResult:
    compute = [(post[i], fin[i]) for i in range(len(fin)) if p.comm[i] is None]
    colls = [(post[i], fin[i]) for i in range(len(fin)) if p.comm[i] is not None and not p.p2p[i]]
    iteration = max(fin) - offset if fin else 0.0
    busy = _union_length(compute)
    both = _union_length(compute + colls)
    return ClassResult(members=members, representative=rep, iteration_s=iteration,
                       compute_s=sum(b - a for a, b in compute), exposed_comm_s=max(0.0, both - busy),
                       bubble_s=max(0.0, iteration - both))  # (intervals lie after the offset)


def _critical_path(plan, post, fin, why, results, limit: int = 100000):
    c = max(range(len(results)), key=lambda k: results[k].iteration_s)
    if not fin[c]:
        return []
    i = max(range(len(fin[c])), key=lambda k: fin[c][k])
    path = []
    while i is not None and len(path) < limit:
        path.append((c, plan[c].names[i], post[c][i], fin[c][i]))
        nxt = why[c][i]
        if nxt is None:
            break
        c, i = nxt
    path.reverse()
    return path
