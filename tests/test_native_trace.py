"""The recorder fed by the backend's native trace against the same recorder fed live, one process.

The native path records each operation's marks in C++ and the recorder replays them at its own
boundaries (labelled iterations) or when the next iteration begins (timed ones): the graph must be the
one the live path (a listener per operation, Python marks) builds for the same program.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from prism_megatron.comm import native
from prism_megatron.comm.backend import register_prism_backend
from prism_megatron.comm.session import PhysicalWorld, VirtualSession
from prism_megatron.graph import StringTable
from prism_megatron.trace.attach import connect_comm
from prism_megatron.trace.clock import CpuClock
from prism_megatron.trace.recorder import Recorder
from prism_megatron.world import Role

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _program(rec: Recorder, tp, pp) -> None:
    """Four iterations of spans, module labels and every kind of operation the recorder sees."""
    for _ in range(4):
        rec.begin_iteration()
        rec.span_begin("forward", 0, 0)
        rec.enter("decoder.layers.0.self_attention")
        work = dist.all_reduce(torch.ones(32), group=tp, async_op=True)    # overlapped
        dist.all_reduce(torch.ones(64), group=tp)                          # synchronous
        rec.exit()
        rec.enter("decoder.layers.0.mlp")
        torch.ones(8).sum()
        rec.exit()
        work.wait()
        with dist._coalescing_manager(group=tp, async_ops=False):
            dist.all_reduce(torch.ones(4), group=tp)
            dist.all_reduce(torch.ones(4), group=tp)
        dist.send(torch.ones(16), group_dst=1, group=pp)
        got = torch.empty(16)
        dist.recv(got, group_src=1, group=pp)
        rec.moe_tokens(1, [3, 5])
        rec.span_end()
        rec.enter("optimizer.step")
        rec.exit()


def _graph(native_trace: bool, iteration: int):
    register_prism_backend()
    session = VirtualSession(world_size=8, physical=PhysicalWorld(rank=0, sandbox_ranks=(0,)))
    dist.init_process_group("prism", store=dist.HashStore(), rank=0, world_size=8, pg_options=session)
    try:
        clock = CpuClock()
        if not native_trace:
            clock.trace = None  # a clock without a native trace: the recorder listens live
        rec = Recorder(clock, lambda: 100, two_pass=True)
        connect_comm(rec, session)
        tp, pp = dist.new_group([0, 1]), dist.new_group([0, 4])
        _program(rec, tp, pp)
        strings = StringTable()
        g = rec.build(Role(pp=0, tp=0, cp=0, ep=0, etp=0), 0, strings, iteration=iteration, peak_bytes=100,
                      peak_by_category={"params": 100})
        cols = g.columns
        text = {k: [strings.strings[i] for i in cols[k]] for k in ("name", "stream", "op", "dim")}
        return {"nodes": list(zip(cols["kind"].tolist(), *text.values(), cols["nbytes"].tolist(),
                                  cols["seq"].tolist(), cols["peer_delta"].tolist())),
                "deps": (g.dep_ptr.tolist(), g.dep_idx.tolist()),
                "spans": (g.spans["first"].tolist(), g.spans["last"].tolist()),
                "built": dict(rec.built)}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("iteration", [1, 2], ids=["timed", "labelled"])
def test_the_native_trace_builds_the_graph_the_live_recorder_builds(iteration):
    live, read = _graph(False, iteration), _graph(True, iteration)
    assert read["nodes"] == live["nodes"]
    assert read["deps"] == live["deps"]
    assert read["spans"] == live["spans"]
    assert read["built"]["timing"] == live["built"]["timing"] == "two-pass"
    ops = [n[3] for n in read["nodes"] if n[0] == 1]
    assert ops.count("all_reduce") == 4 and "send" in ops and "recv" in ops


def test_a_hold_book_reports_its_planned_ends():
    """The native hold book (every host clock's) says what it planned, by ordinal."""
    book = native.load().HoldBook([(0.0, (), False, 1.0), (0.5, ((0, 0.25),), False, None)])
    book.begin(0.0)
    book.stamp(0, 0.0)
    book.plan([0], 0.5)
    book.plan([1], 0.6)
    assert book.ends == {0: pytest.approx(1.0), 1: pytest.approx(1.25)}
