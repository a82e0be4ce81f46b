"""The recorder's graph semantics (pure, with a fake clock), the capture plan, and Chakra export."""

from __future__ import annotations

from dataclasses import replace

from pathlib import Path

import numpy as np
import pytest

from prism_megatron.capture.plan import plan_classes, stage_key
from prism_megatron.graph import StringTable, load_graph, save_graph
from prism_megatron.graph.chakra import NODE_TYPES, chakra_messages, decode, encode, write_chakra
from prism_megatron.graph.model import NO_PEER, NodeKind, structure_difference, structure_hash
from prism_megatron.graph.synthetic import synthetic_graph
from prism_megatron.emulate.holds import START, Hold
from prism_megatron.trace.clock import DelayAccount, HostHolds
from prism_megatron.trace.recorder import Recorder, RecorderError
from prism_megatron.world import Role, VirtualWorld


class FakeClock(HostHolds):
    """Each mark advances 1 ms, so durations count the marks a segment spans; a hold moves the time
    to its end."""

    kind = "fake"

    def __init__(self) -> None:
        self.t = 0.0
        self.delays = DelayAccount()
        self.held_until: list[float] = []

    def mark(self) -> float:
        self.t += 1e-3
        return self.t

    def now(self) -> float:
        return self.t

    def wait_until(self, goal: float) -> None:
        self.held_until.append(max(goal, self.t))
        if goal > self.t:
            self.delays.add(goal - self.t, goal - self.t)
            self.t = goal

    def stream(self) -> str:
        return "compute"

    def seconds(self, marks, origin):
        return np.asarray(marks, dtype="f8") - origin


class FakeWork:
    pass


ROLE = Role(pp=0, tp=0, cp=0, ep=0, etp=0)


def _comm(rec, op="all_reduce", dim="tp", nbytes=64, peer=None, group="g1", real_peer=False):
    rec.comm_begin(op=op, dim=dim, group=group, nbytes=nbytes, dtype="float32", peer_delta=peer,
                   real_peer=real_peer)
    work = FakeWork()
    rec.comm_issued(work)
    return work


def _built(rec, **kw):
    strings = StringTable()
    g = rec.build(ROLE, 0, strings, peak_bytes=100, peak_by_category={"params": 100}, **kw)
    names = [strings.strings[i] for i in g.columns["name"]]
    return g, names, strings


def test_segments_are_named_by_the_innermost_label_and_ordered_per_stream():
    rec = Recorder(FakeClock(), lambda: 7)
    rec.begin_iteration()
    rec.enter("forward_backward")
    rec.span_begin("forward", 0, 0)
    rec.enter("decoder.layers.0.self_attention")
    work = _comm(rec)  # a synchronous all-reduce in the middle of attention: waited at once
    rec.wait_end(rec.wait_begin(work))
    rec.exit()
    rec.span_end()
    rec.exit()
    rec.enter("optimizer.step")
    rec.exit()
    g, names, _ = _built(rec)
    kinds = g.columns["kind"].tolist()
    attention = "decoder.layers.0.self_attention"
    # waited right after its issue: no node and no mark between the return and the wait
    assert names == ["host", "forward_backward", "forward", attention, "all_reduce", attention,
                     "forward", "forward_backward", "host", "optimizer.step"]
    assert kinds.count(NodeKind.COMM) == 1
    comm = kinds.index(NodeKind.COMM)
    assert list(g.deps(comm)) == [comm - 1]              # issued by the attention segment
    assert sorted(g.deps(comm + 1)) == [comm - 1, comm]  # program order + the wait
    assert (g.spans["first"].tolist(), g.spans["last"].tolist()) == ([2], [6])  # inside the span
    assert g.peak_bytes == 100 and set(g.mem_bytes.tolist()) == {7}


@pytest.mark.parametrize("real_peer", [False, True])
def test_a_real_peers_transfer_after_the_return_belongs_to_no_node(real_peer):
    """Waited at once: with ghost peers only the backend returned when all was done; with another
    sandbox in the group the waiting stream stalls for the real transfer (here 50 ms), and that stall
    must not open the next compute node (it would count twice: as compute and in the replay)."""
    clock = FakeClock()
    rec = Recorder(clock, lambda: 0)
    rec.begin_iteration()
    rec.enter("decoder.layers.0.self_attention")
    work = _comm(rec, real_peer=real_peer)
    entry = rec.wait_begin(work)
    if real_peer:
        clock.t += 0.050  # the transfer with the other sandbox
    rec.wait_end(entry)
    rec.exit()
    g, names, _ = _built(rec)
    after = names.index("all_reduce") + 1
    assert names[after] == "decoder.layers.0.self_attention"
    assert g.columns["duration_s"][after] == pytest.approx(1e-3)  # one mark: its own end
    comm = names.index("all_reduce")
    assert comm in g.deps(after).tolist()


def test_coarse_memory_sampling_keeps_the_nodes_and_reads_memory_only_at_spans_and_comm():
    def run(fine):
        reads = []
        rec = Recorder(FakeClock(), lambda: reads.append(1) or 7, memory_at_module_boundaries=fine)
        rec.begin_iteration()
        rec.enter("forward_backward")
        rec.span_begin("forward", 0, 0)
        rec.enter("decoder.layers.0.mlp")
        rec.wait_end(rec.wait_begin(_comm(rec)))
        rec.exit()
        rec.span_end()
        rec.exit()
        g, names, _ = _built(rec)
        return names, g.dep_ptr.tolist(), g.dep_idx.tolist(), len(reads), len(g.mem_bytes)

    fine, coarse = run(True), run(False)
    assert fine[:3] == coarse[:3]  # the same program
    assert fine[3] == 8 and coarse[3] == 4  # every cut, against iteration, span begin/end, comm begin
    assert coarse[4] < fine[4]


def test_async_work_waited_later_makes_the_waiting_segment_depend_on_it():
    rec = Recorder(FakeClock(), lambda: 0)
    rec.begin_iteration()
    rec.enter("ddp.start_grad_sync")
    work = _comm(rec, dim="dp", nbytes=4096, group="dp0")
    rec.exit()
    rec.enter("decoder.layers.0.mlp.backward")  # overlapped compute
    rec.exit()
    entry = rec.wait_begin(work)
    rec.wait_end(entry)
    rec.enter("optimizer.step")
    rec.exit()
    g, names, _ = _built(rec)
    comm = names.index("all_reduce")
    waiting = names.index("optimizer.step") - 1  # the segment that starts at the wait
    assert comm in g.deps(waiting).tolist()
    assert all(comm not in g.deps(i).tolist() for i in range(comm + 1, waiting))
    assert g.columns["duration_s"][comm] == pytest.approx(1e-3)  # issue to the backend's return
    assert g.columns["stream"][comm] != g.columns["stream"][comm - 1]


def test_p2p_keeps_its_peer_and_sequence_numbers_restart_each_iteration():
    rec = Recorder(FakeClock(), lambda: 0)
    for _ in range(2):
        rec.begin_iteration()
        _comm(rec, op="send", dim="pp", peer=1, group="pp0")
        _comm(rec, op="recv", dim="pp", peer=-1, group="pp0")
        _comm(rec, op="all_reduce", dim="tp", group="tp0")
    g, names, _ = _built(rec, iteration=0)
    comm = g.columns["kind"] == NodeKind.COMM
    assert g.columns["seq"][comm].tolist() == [0, 1, 0]
    assert g.columns["peer_delta"][comm].tolist() == [1, -1, NO_PEER]
    g2, _, _ = _built(rec, iteration=-1)
    assert g2.columns["seq"][g2.columns["kind"] == NodeKind.COMM].tolist() == [0, 1, 0]


def test_a_stream_waiting_for_an_event_depends_on_the_node_it_marks():
    clock = FakeClock()
    clock.current = "compute"
    clock.stream = lambda: clock.current
    rec = Recorder(clock, lambda: 0)
    rec.begin_iteration()
    rec.enter("embedding")
    event = object()
    rec.event_recorded(event, "compute")   # marks the end of the embedding segment
    rec.exit()
    clock.current = "side"
    rec.enter("overlapped")
    rec.event_waited(event, "side")
    rec.exit()
    clock.current = "compute"
    rec.stream_waited("compute", "side")    # the compute stream joins the side stream
    rec.enter("next")
    rec.exit()
    g, names, strings = _built(rec)
    streams = [strings.strings[i] for i in g.columns["stream"]]
    marked = names.index("embedding")
    side = [i for i, s in enumerate(streams) if s == "side"]
    assert marked in g.deps(side[-1]).tolist()  # the side node that starts at the wait
    assert all(marked not in g.deps(i).tolist() for i in side[:-1])
    after = names.index("next")
    assert any(d in side for d in g.deps(after - 1).tolist() + g.deps(after).tolist())


def test_moe_tokens_are_kept_per_layer_and_microbatch():
    rec = Recorder(FakeClock(), lambda: 0)
    rec.begin_iteration()
    for mb in range(2):
        rec.span_begin("forward", mb, 0)
        rec.moe_tokens(3, [5, 0, 11 + mb])
        rec.span_end()
    g, _, _ = _built(rec)
    assert g.moe["layer"].tolist() == [3, 3] and g.moe["microbatch"].tolist() == [0, 1]
    assert g.moe_tokens[g.moe_ptr[1]:g.moe_ptr[2]].tolist() == [5, 0, 12]


def _moe_stage(first_layer: int, counts=(5, 0, 11)):
    rec = Recorder(FakeClock(), lambda: 0)
    rec.begin_iteration()
    rec.span_begin("forward", 0, 0)
    for layer in (first_layer, first_layer + 1):  # megatron's layer numbers: global, 1-based
        rec.moe_tokens(layer, list(counts))
    rec.span_end()
    return _built(rec)


def test_stages_that_route_alike_hash_alike_and_an_inferred_stage_gets_its_own_layers():
    (g1, _, s1), (g5, _, s5) = _moe_stage(3), _moe_stage(11)  # stages 1 and 5 of two layers each
    assert structure_hash(g1, s1.strings) == structure_hash(g5, s5.strings)
    other, _, s_other = _moe_stage(11, counts=(5, 1, 10))
    assert structure_hash(g1, s1.strings) != structure_hash(other, s_other.strings)
    stage5 = g1.as_role(Role(pp=5, tp=0, cp=0, ep=0, etp=0), 5, "inferred:stage1", layer_shift=(5 - 1) * 2)
    assert stage5.moe["layer"].tolist() == [11, 12] and g1.moe["layer"].tolist() == [3, 4]
    assert stage5.moe_tokens is g1.moe_tokens  # counts shared, only the layer numbers differ


def test_no_iteration_is_an_error_that_says_why():
    rec = Recorder(FakeClock(), lambda: 0)
    with pytest.raises(RecorderError, match="forward_backward_func"):
        _built(rec)


def test_structure_hash_ignores_timings_but_not_bytes():
    world = VirtualWorld(world_size=16, tp=2, pp=4)
    a, b = synthetic_graph(world), synthetic_graph(world)
    role = world.roles()[0]
    ga, gb = a.roles[role], b.roles[role]
    gb.columns["duration_s"] = gb.columns["duration_s"] * 3
    assert structure_hash(ga, a.strings) == structure_hash(gb, b.strings)
    gb.columns["nbytes"] = gb.columns["nbytes"] + (gb.columns["kind"] == NodeKind.COMM)
    assert structure_hash(ga, a.strings) != structure_hash(gb, b.strings)


def test_probes_whose_peaks_differ_within_the_memory_goal_still_verify_but_other_differences_do_not():
    world = VirtualWorld(world_size=16, tp=2, pp=4)
    a, b = synthetic_graph(world), synthetic_graph(world)
    role = world.roles()[0]
    ga, gb = (replace(g.roles[role], peak_bytes=10**9, peak_by_category={"params": 4 * 10**8, "activations": 6 * 10**8})
              for g in (a, b))
    assert structure_difference(ga, a.strings, gb, b.strings) is None
    moved = 3 * 512  # three 512-byte split-size blocks whose free waited on megatron's D2H stream
    late = replace(gb, peak_bytes=gb.peak_bytes + moved,
                   peak_by_category={"params": 4 * 10**8, "activations": 6 * 10**8 + moved})
    assert structure_difference(ga, a.strings, late, b.strings) is None  # exact trackers: within 0.01 %
    over = replace(gb, peak_bytes=gb.peak_bytes + 2 * 10**5)
    assert "memory" in structure_difference(ga, a.strings, over, b.strings)
    on_gpu = [replace(g, memory_source="cuda-allocator") for g in (ga, late)]
    assert structure_difference(on_gpu[0], a.strings, on_gpu[1], b.strings) is None
    beyond = replace(on_gpu[1], peak_bytes=ga.peak_bytes + 2 * 10**5)  # past 0.01 % of the peak
    assert structure_difference(on_gpu[0], a.strings, beyond, b.strings).startswith("memory (peak 1,000,000,000 vs")
    more_bytes = gb.columns["nbytes"] + (gb.columns["kind"] == NodeKind.COMM)
    bytes_differ = replace(on_gpu[1], columns={**gb.columns, "nbytes": more_bytes})
    assert structure_difference(on_gpu[0], a.strings, bytes_differ, b.strings) == "nodes"


def test_plan_groups_stages_by_schedule_and_probes_differ_most():
    world = VirtualWorld(world_size=8192, tp=8, pp=16)
    classes = plan_classes(world, microbatches=2)
    assert [c.key for c in classes] == ["first+warmup2", "warmup2", "warmup1", "last+warmup0"]
    assert [len(c.roles) for c in classes] == [8, 104, 8, 8]
    middle = classes[1]
    a, b = middle.probes
    assert (a.pp, a.tp) == (1, 0) and (b.pp, b.tp) == (13, 7)
    assert sum(len(c.probes) for c in classes) == 8
    many = plan_classes(world, microbatches=64)  # a long 1F1B: every stage its own warm-up
    assert len(many) == 16
    interleaved = VirtualWorld(world_size=64, tp=2, pp=4, vpp=2)
    assert stage_key(interleaved, 1, 8) == "stage1" and len(plan_classes(interleaved, 8)) == 4
    with pytest.raises(ValueError, match="microbatches"):
        plan_classes(world, 0)


def test_inferred_roles_share_one_stored_graph(tmp_path):
    world = VirtualWorld(world_size=64, tp=4, pp=2)
    graph = synthetic_graph(world)
    source = graph.roles[world.roles()[0]]
    for role in world.roles()[1:4]:  # stage 0: tensor ranks 1..3 inferred from rank 0's graph
        graph.roles[role] = source.as_role(role, world.representative(role), f"inferred:{source.role}")
    save_graph(graph, str(tmp_path / "g.prism"))
    back = load_graph(str(tmp_path / "g.prism"))
    stage0 = [back.roles[r] for r in world.roles()[:4]]
    assert all(g.dep_ptr is stage0[0].dep_ptr for g in stage0)  # one array, four roles
    assert [g.source.split(":")[0] for g in stage0] == ["captured", "inferred", "inferred", "inferred"]
    assert [g.representative for g in stage0] == [world.representative(r) for r in world.roles()[:4]]


def test_chakra_export_round_trips_through_the_protobuf_schema(tmp_path):
    world = VirtualWorld(world_size=16, tp=2, pp=4)
    graph = synthetic_graph(world)
    meta, nodes = chakra_messages(graph, 5)
    meta2, nodes2 = decode(encode([meta, *nodes]))
    assert meta2 == meta and nodes2 == nodes and len(nodes) == graph.graph_of(5).num_nodes
    attrs = {a.name: a for a in meta2.attr}
    assert attrs["rank"].int64_val == 5 and attrs["world_size"].int64_val == 16
    types = {n.type for n in nodes2}
    assert types == {NODE_TYPES["COMP_NODE"], NODE_TYPES["COMM_COLL_NODE"], NODE_TYPES["COMM_SEND_NODE"],
                     NODE_TYPES["COMM_RECV_NODE"]}
    send = next(n for n in nodes2 if n.type == NODE_TYPES["COMM_SEND_NODE"])
    a = {x.name: x for x in send.attr}
    stage_next = world.group(5, "pp")[world.group(5, "pp").index(5) + 1]
    assert a["comm_src"].int32_val == 5 and a["comm_dst"].int32_val == stage_next
    assert a["comm_size"].int64_val == 8192
    deps = {d for n in nodes2 for d in (*n.ctrl_deps, *n.data_deps)}
    assert deps and all(d < len(nodes2) for d in deps)
    paths = write_chakra(graph, [0, 5], str(tmp_path / "et"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["et.0.et", "et.5.et"]
    with open(paths[1], "rb") as handle:
        assert decode(handle.read())[1] == nodes
    with pytest.raises(ValueError, match="truncated"):
        decode(encode([meta, *nodes])[:-3])


class StepClock(FakeClock):
    """Marks advance by `step` seconds, which a test changes between iterations."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 1e-3

    def mark(self) -> float:
        self.t += self.step
        return self.t


def _layer_iteration(rec, comm_group="tp0", mlp_extra_s=0.0):
    """One forward with two module-level ops around a synchronous all-reduce."""
    rec.begin_iteration()
    rec.span_begin("forward", 0, 0)
    rec.enter("decoder.layers.0.self_attention")
    rec.exit()
    rec.enter("decoder.layers.0.mlp")
    rec.clock.t += mlp_extra_s
    rec.wait_end(rec.wait_begin(_comm(rec, group=comm_group)))
    rec.exit()
    rec.span_end()


def test_two_pass_takes_labels_from_a_labelled_iteration_and_times_from_the_timed_one():
    clock = StepClock()
    rec = Recorder(clock, lambda: 5, two_pass=True)
    modes = []
    rec.mode_listeners.append(modes.append)
    for step in (1e-3, 3e-3, 1e-3):  # the timed iteration runs 3x slower per mark
        clock.step = step
        _layer_iteration(rec)
    assert modes == [False, True]  # timed iteration 2 detaches the hooks, labelled 3 attaches them
    assert [it.labelled for it in rec.iterations] == [True, False, True]
    timed_nodes = len(rec.iterations[1].nodes)
    assert timed_nodes < len(rec.iterations[0].nodes)  # no cut at module boundaries
    assert rec.iterations[1].mem == []                 # and no memory read

    g, names, _ = _built(rec, iteration=1)
    assert rec.built == {"timing": "two-pass", "timed_iteration": 2, "labelled_iteration": 1,
                         "pooled_iterations": []}
    assert "decoder.layers.0.self_attention" in names and "decoder.layers.0.mlp" in names
    cols = g.columns
    end = float((cols["start_s"] + cols["duration_s"]).max())
    # the timed iteration's anchors (iteration, span, comm begin, issued, span end; the synchronous
    # wait adds none) are 3 ms apart, and the next iteration's begin comes 1 ms after the span end
    assert end == pytest.approx(4 * 3e-3 + 1e-3)
    comm = names.index("all_reduce")
    assert cols["duration_s"][comm] == pytest.approx(3e-3)
    attention = names.index("decoder.layers.0.self_attention")
    # span begin -> comm begin: one timed interval (3 ms) that holds four labelled segments of 1 ms
    assert cols["duration_s"][attention] == pytest.approx(0.75e-3)
    assert float(cols["start_s"][comm]) == pytest.approx(2 * 3e-3)  # anchors map one to one
    assert g.mem_bytes.tolist() and set(g.mem_bytes.tolist()) == {5}

    g_label, names3, _ = _built(rec, iteration=2)  # a labelled iteration is timed by its neighbour
    assert rec.built["timed_iteration"] == 2
    assert names3 == names[:-1]  # the run's last iteration has no segment up to a next one


class ProbedClock(StepClock):
    """A device clock: `idle[k]` says whether the k-th probe finds the device idle."""

    kind = "cuda"

    def __init__(self, idle) -> None:
        super().__init__()
        self.idle = list(idle)

    def device_idle(self, mark) -> bool:
        assert mark == self.t  # the mark that ended the segment: the latest
        return self.idle.pop(0)


def test_host_bound_counts_the_timed_iterations_compute_that_ended_with_the_device_idle():
    """Two-pass: the figures are the timed iteration's (its anchors only), the labelled iterations'
    probes count nowhere, and a segment counts when the operation it ends found the device idle."""
    clock = ProbedClock([True, False, True, True])  # one probe per operation: iterations 1, 2, 2, 3
    rec = Recorder(clock, lambda: 0, two_pass=True)
    _layer_iteration(rec)
    rec.begin_iteration()  # the timed iteration: two operations, the device idle before the second
    clock.t += 0.010  # 10 ms of compute before the first operation, found busy
    _comm(rec, group="tp0")
    clock.t += 0.030  # 30 ms before the second, found idle
    _comm(rec, group="tp0")
    _layer_iteration(rec)
    _built(rec, iteration=1)
    bound = rec.built["host_bound"]
    assert (bound["ops"], bound["idle_ops"]) == (2, 1)
    # marks advance 1 ms: the segment ending at the second operation is its issue mark to its begin
    assert bound["idle_compute_s"] == pytest.approx(0.031)
    # its segments: begin to the first operation, issue to the second, issue to the next iteration
    assert bound["compute_s"] == pytest.approx(0.011 + 0.031 + 0.001)
    assert bound["share"] == pytest.approx(0.031 / 0.043)
    host = Recorder(FakeClock(), lambda: 0)
    _layer_iteration(host)
    _built(host)
    assert "host_bound" not in host.built  # the host is the device: nothing to wait for


def test_two_pass_falls_back_to_one_pass_when_the_programs_differ():
    rec = Recorder(FakeClock(), lambda: 0, two_pass=True)
    _layer_iteration(rec, comm_group="tp0")
    _layer_iteration(rec, comm_group="other")  # not the labelled iteration's program
    g, names, _ = _built(rec, iteration=0)
    assert rec.built == {"timing": "single-pass", "timed_iteration": 1, "labelled_iteration": 1,
                         "pooled_iterations": []}
    assert "decoder.layers.0.mlp" in names
    _built(rec, iteration=1)
    assert rec.built["labelled_iteration"] == 2 and rec.built["timing"] == "single-pass"


def test_holds_belong_to_no_node_at_the_issue_or_at_the_wait():
    """A synchronous operation is held at its issue; an overlapped one gets its end planned at its
    issue and is held where it is waited for, by what is left of it. Neither hold is a node."""
    clock = FakeClock()
    rec = Recorder(clock, lambda: 0)
    rec.inject_holds([Hold(0.5, (), False), Hold(0.25, (), True)])
    rec.begin_iteration()
    rec.enter("attention")
    rec.wait_end(rec.wait_begin(_comm(rec, group="tp0")))  # synchronous: held at its issue
    work = _comm(rec, dim="dp", group="dp0")               # overlapped
    planned_end = clock.t - 1e-3 + 0.25  # its issue mark, plus its hold
    rec.enter("overlapped")
    rec.exit()
    waited_at = clock.t
    rec.wait_end(rec.wait_begin(work))
    rec.exit()
    g, names, _ = _built(rec)
    cols = g.columns
    end = float((cols["start_s"] + cols["duration_s"]).max())
    # the two holds are gaps: the synchronous one whole, the overlapped one less what ran meanwhile
    gaps = 0.5 + (planned_end - waited_at)
    assert float(cols["duration_s"].sum()) == pytest.approx(end - gaps - 2e-3)
    sync = names.index("all_reduce")
    assert cols["duration_s"][sync] == pytest.approx(1e-3)  # the call itself
    assert cols["start_s"][sync + 1] == pytest.approx(cols["start_s"][sync] + 1e-3 + 0.5 + 1e-3)
    assert clock.delay_report()["count"] == 2


def test_a_hold_ends_when_the_later_of_the_sandbox_and_its_ghosts_arrives():
    """Closed loop: ghosts that arrive 0.3 s after the iteration's start hold an early sandbox until
    then (plus the transfer), and not a late one; a chain anchored on the sandbox's first operation
    moves with that operation's end, as real peers would."""
    for late in (0.0, 0.5):
        clock = FakeClock()
        rec = Recorder(clock, lambda: 0)
        rec.inject_holds([Hold(0.01, ((START, 0.31),), False), Hold(0.01, ((0, 0.2),), False)])
        rec.begin_iteration()
        start = clock.t
        clock.t += late  # the sandbox's compute before its first operation
        rec.wait_end(rec.wait_begin(_comm(rec, group="tp0")))
        # issued after two marks (the segment's cut and the issue)
        assert clock.held_until[-1] == pytest.approx(max(start + late + 2e-3 + 0.01, start + 0.31))
        first_end = clock.held_until[-1]
        issued = clock.t + 2e-3
        rec.wait_end(rec.wait_begin(_comm(rec, group="tp0")))
        assert clock.held_until[-1] == pytest.approx(max(issued + 0.01, first_end + 0.2))
    assert clock.delay_report()["count"] == 2


def test_the_backends_own_time_past_a_stamped_begin_is_paid_back_by_the_next_hold():
    """An operation stamped where it begins whose local part (1 ms: two marks) outlasts its modelled
    transfer (0.5 ms) is not held and leaves 0.5 ms of debt; the next operation's hold, 2 ms past its
    issue, pays it back and ends 0.5 ms early: the iteration keeps the replay's length."""
    clock = FakeClock()
    rec = Recorder(clock, lambda: 0)
    rec.inject_holds([Hold(-0.5e-3, (), False, 0.5e-3), Hold(2e-3, (), False, 3e-3)])
    rec.begin_iteration()
    rec.enter("attention")
    rec.wait_end(rec.wait_begin(_comm(rec, group="tp0")))
    assert clock.held_until[-1] == pytest.approx(clock.t - 1e-3)  # issued past its end: not held
    begin = clock.t + 1e-3  # the next operation begins at its segment's cut
    rec.wait_end(rec.wait_begin(_comm(rec, group="tp0")))
    assert clock.held_until[-1] == pytest.approx(begin + 3e-3 - 0.5e-3)
    report = clock.delay_report()
    assert report["overhead_accrued_s"] == pytest.approx(0.5e-3)
    assert report["overhead_absorbed_s"] == pytest.approx(0.5e-3)


def test_operations_issued_together_run_up_the_debt_once_by_the_groups_latest_end():
    """Two stamped operations issued together (a coalesced call) at 3.0, begun at 0.0 and 0.3 with
    1.0 of transfer each: the group ends at 1.3 on the job's timeline, so it runs up 1.7 of debt
    once, not once per operation, and a later hold pays it back out of its own spin."""
    from prism_megatron.trace.clock import HoldBook

    book = HoldBook([(0.0, (), 1.0), (0.0, (), 1.0), (5.0, (), 5.0)])
    book.begin(0.0)
    book.stamp(0, 0.0)
    book.stamp(1, 0.3)
    assert book.plan([0, 1], 3.0) == pytest.approx(3.0)  # on the clock: issued past its end
    assert book.ends == {0: pytest.approx(1.0), 1: pytest.approx(1.3)}
    assert book.debt == pytest.approx(1.7) and book.accrued_s == pytest.approx(1.7)
    assert book.goal([0, 1], 3.0) == pytest.approx(3.0)  # no slack: nothing paid back, no hold
    book.plan([2], 4.0)  # its own part: 4.0 - 1.7 + 5.0 on the job's timeline
    assert book.goal([2], 4.0) == pytest.approx(4.0 + 5.0 - 1.7)
    assert book.debt == 0.0 and book.absorbed_s == pytest.approx(1.7)


def test_median_selection_takes_the_steady_timed_iteration_of_median_length():
    clock = StepClock()
    rec = Recorder(clock, lambda: 0, two_pass=True)
    assert rec.median_iteration() is None
    # iterations 0..8: labelled 0, 2, 4, 6, 8; timed 1, 3, 5, 7; 8 is the last. Steady: 3, 5, 7 (the
    # second iteration, 1, often still settles: it is left out when two or more remain)
    for step in (1e-3, 9e-3, 1e-3, 3e-3, 1e-3, 1e-3, 1e-3, 2e-3, 1e-3):
        clock.step = step
        _layer_iteration(rec)
    assert rec.steady_iterations() == [3, 5, 7]
    # a timed iteration's length: its marks at its own step, the next iteration's begin at the next's
    assert rec.median_iteration() == 7  # lengths: 3 -> 3 ms steps, 5 -> 1 ms, 7 -> 2 ms
    _built(rec, iteration=7)
    assert rec.built["timed_iteration"] == 8 and rec.built["labelled_iteration"] in (7, 9)


def test_node_median_pools_the_steady_iterations_interval_by_interval():
    """A 50 ms hiccup inside one timed iteration's mlp: pooled over three steady iterations, each
    interval takes its median, so the hiccup does not reach the graph, and the graph stays
    consistent (every node starts where its predecessor on the stream ended)."""
    clock = StepClock()
    rec = Recorder(clock, lambda: 0, two_pass=True)
    for k, (step, extra) in enumerate([(1e-3, 0), (1e-3, 0), (1e-3, 0), (1e-3, 0.05), (1e-3, 0),
                                       (1e-3, 0), (1e-3, 0), (1e-3, 0), (1e-3, 0)]):
        clock.step = step
        _layer_iteration(rec, mlp_extra_s=extra)
    assert rec.steady_iterations() == [3, 5, 7]
    clean, _, _ = _built(rec, iteration=7)
    single, names, _ = _built(rec, iteration=3)
    pooled, names_pooled, _ = _built(rec, iteration=3, pool=rec.steady_iterations())
    assert names == names_pooled and rec.built["pooled_iterations"] == [4, 6, 8]
    mlp = names.index("decoder.layers.0.mlp")
    # timed iterations cut at anchors only: the hiccup spreads over the labelled segments between two
    assert single.columns["duration_s"][mlp] > 0.01
    # per interval the median of (hiccup, clean, clean): the clean iteration's times
    assert np.allclose(pooled.columns["duration_s"], clean.columns["duration_s"])
    assert clean.columns["duration_s"][mlp] < 2e-3
    cols = pooled.columns
    assert np.allclose(cols["start_s"][1:], (cols["start_s"] + cols["duration_s"])[:-1])
    # each pooled iteration as it ran, for the realtime check iteration by iteration: the hiccup stays
    # in its own iteration's row, and a single-iteration build keeps its own row alone
    iterations, durations = rec.iteration_durations
    assert iterations == [4, 6, 8] and durations.shape == (3, len(names))
    assert durations[0][mlp] > 0.01 and np.allclose(durations[1:], clean.columns["duration_s"])
    assert np.allclose(np.median(durations, axis=0), cols["duration_s"])
    _built(rec, iteration=3)  # one iteration: its own row, the graph's durations
    assert rec.iteration_durations[0] == [4] and np.allclose(rec.iteration_durations[1], single.columns["duration_s"])


def test_per_iteration_durations_are_kept_beside_the_graph_and_read_back(tmp_path):
    from prism_megatron.trace.iterations import durations_path, read_durations, write_durations

    graph = str(tmp_path / "rank0.prism")
    assert read_durations(graph) is None
    write_durations(graph, [4, 6], np.array([[1e-3, 2e-3], [1.5e-3, 2e-3]]))
    iterations, durations = read_durations(graph)
    assert iterations == [4, 6] and durations.tolist() == [[1e-3, 2e-3], [1.5e-3, 2e-3]]
    whole = Path(durations_path(graph)).read_bytes()
    for broken in (b"not an npz", b"", whole[:len(whole) // 2]):  # garbage, empty, cut short
        Path(durations_path(graph)).write_bytes(broken)
        assert read_durations(graph) is None, broken[:20]
    write_durations(graph, [4, 6, 8], np.array([[1e-3, 2e-3], [1.5e-3, 2e-3]]))  # rows do not match
    assert read_durations(graph) is None


def test_a_coalesced_work_covers_every_operation_it_ran():
    """torch's _coalescing_manager (megatron's bucketed grad reduce-scatter): several operations, one
    Work. Waiting for it makes the next segment depend on all of them, and each keeps its own ordinal
    for injected waits."""
    clock = FakeClock()
    rec = Recorder(clock, lambda: 0)
    rec.inject_holds([Hold(0.25, (), True), Hold(0.5, (), True), None])
    rec.begin_iteration()
    rec.enter("backward")
    for group in ("dp0", "dp0"):
        rec.comm_begin(op="reduce_scatter", dim="dp", group=group, nbytes=64, dtype="float32",
                       peer_delta=None)
    work = FakeWork()
    rec.comm_issued(work)
    planned_end = clock.t + 0.5  # the later of the two, from their issue
    rec.enter("more.backward")  # overlapped
    rec.exit()
    waited_at = clock.t
    rec.wait_end(rec.wait_begin(work))
    rec.exit()
    rec.enter("optimizer.step")
    rec.exit()
    g, names, _ = _built(rec)
    comms = [i for i, k in enumerate(g.columns["kind"].tolist()) if k == NodeKind.COMM]
    assert len(comms) == 2
    waiting = [i for i in range(g.num_nodes) if set(comms) & set(g.deps(i).tolist())
               and g.columns["kind"][i] == NodeKind.COMPUTE]
    assert len(waiting) == 1 and set(comms) <= set(g.deps(waiting[0]).tolist())
    assert waiting[0] > names.index("more.backward")  # the segment after the wait, not the overlap
    cols = g.columns
    end = float((cols["start_s"] + cols["duration_s"]).max())
    # one stall, from the wait's mark until the later of the two ends, then the mark that ends it
    assert float(cols["duration_s"].sum()) == pytest.approx(end - (planned_end - (waited_at + 1e-3)) - 1e-3)


def test_cpu_holds_take_the_measured_oversleep_off_the_next_ones(monkeypatch):
    """A sleep overshoots (timer slack, wake-up); the clock asks the next sleeps for less by what it
    measured, and reports what was planned against what was measured."""
    from prism_megatron.trace import clock as clock_module

    now = [0.0]
    asked = []

    def sleep(s):  # a host whose sleeps last 200 us longer than asked
        asked.append(s)
        now[0] += s + 200e-6

    monkeypatch.setattr(clock_module.time, "sleep", sleep)
    monkeypatch.setattr(clock_module.time, "perf_counter", lambda: now[0])
    clock = clock_module.CpuClock()
    clock.set_holds([(1e-3, ())])
    for _ in range(40):
        clock.hold_iteration()
        clock.hold([0], spin=True)
    report = clock.delay_report()
    assert report["count"] == 40 and report["planned_s"] == pytest.approx(40e-3)
    assert asked[0] == pytest.approx(1e-3) and asked[-1] == pytest.approx(0.8e-3, rel=1e-3)
    late = [a + 200e-6 for a in asked[-10:]]  # what the last sleeps lasted
    assert sum(late) == pytest.approx(10e-3, rel=1e-3)
    # the first sleeps overshot before the estimate settled: the whole is a few percent long
    assert 0 < report["error_pct"] < 5


def test_hold_book_plans_the_later_of_own_and_ghost_ends():
    from prism_megatron.trace.clock import HoldBook

    book = HoldBook([(0.1, ((START, 1.0),)), (0.1, ((0, 0.5),)), (0.2, ()), (0.0, ((1, 0.3), (START, 2.0)))])
    book.begin(10.0)
    assert book.plan([0], 10.2) == pytest.approx(11.0)   # ghosts 1 s after the start
    assert book.plan([1], 12.0) == pytest.approx(12.1)   # the sandbox late: its own end
    assert book.plan([2], 12.5) == pytest.approx(12.7)   # no ghost
    assert book.plan([3], 12.0) == pytest.approx(12.4)   # anchored on operation 1's end
    assert book.plan([3], 11.0) == pytest.approx(12.4)   # (the later of two paths: 12.0 from the start)
    assert book.goal([0, 1, 2], 12.5) == pytest.approx(12.7)
    book.begin(20.0)
    assert book.plan([1], 20.0) == pytest.approx(20.1)   # a new iteration: op 0 not planned yet
