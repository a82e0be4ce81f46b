"""The CUDA caching allocator model (runtime/allocator_model.py): hand-worked sequences, and the
allocator traces recorded on an H200 (benchmarks/gpu_memory_trace.py) replayed to their exact peaks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prism_megatron.runtime.allocator_model import AllocatorModel, round_size, segment_size

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert segment_size(512) == 2 * MiB and segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB and segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(25 * MiB) == 26 * MiB


def test_small_requests_pack_into_2_mib_segments():
    m = AllocatorModel()
    for i in range(4):
        assert m.malloc(i, 100) == 512
    assert m.figures()["reserved_bytes"] == 2 * MiB and m.allocated == 4 * 512
    m.malloc("big-small", MiB)  # fits the rest of the first segment
    assert m.segments == 1
    m.malloc("one-more", MiB)   # 2 MiB - 2 KiB - 1 MiB left: a second segment
    assert m.segments == 2 and m.peak_reserved == 4 * MiB


def test_large_requests_split_a_20_mib_segment_and_unsplit_remainders_count_as_allocated():
    m = AllocatorModel()
    m.malloc("a", int(1.5 * MiB))           # 20 MiB segment, split: 18.5 MiB free
    m.malloc("b", 10 * MiB)                 # best fit is the 18.5 MiB block: split, 8.5 MiB free
    assert m.allocated == int(11.5 * MiB) and m.reserved == 20 * MiB and m.segments == 1
    assert m.malloc("c", int(7.75 * MiB)) == int(8.5 * MiB)  # 0.75 MiB left: not split, all of it held
    assert m.allocated == 20 * MiB and m.peak_allocated == 20 * MiB
    assert m.malloc("d", 25 * MiB) == 26 * MiB  # own segment, 1 MiB rest is not > 1 MiB: held whole
    assert m.reserved == 46 * MiB


def test_frees_merge_neighbours_and_the_merged_block_is_reused():
    m = AllocatorModel()
    m.malloc("a", 4 * MiB)
    m.malloc("b", 4 * MiB)
    m.malloc("c", 4 * MiB)           # 20 MiB segment: a, b, c, 8 MiB free
    m.free("a")
    m.free("b")                      # a and b merge: an 8 MiB block at the segment's start
    assert m.allocated == 4 * MiB
    m.malloc("d", 7 * MiB)           # two free 8 MiB blocks: the lower address wins; its 1 MiB rest
    assert m.segments == 1           # is not > 1 MiB, so d holds all 8 MiB
    assert m.allocated == 12 * MiB
    m.free("c")
    m.free("d")                      # everything merges back into the 20 MiB segment
    assert m.malloc("e", 19 * MiB) == 20 * MiB and m.segments == 1
    assert m.peak_reserved == 20 * MiB


def test_replay_and_bad_events():
    events = [("alloc", 1, 3 * MiB), ("alloc", 2, 100), ("free", 1), ("alloc", 3, 2 * MiB)]
    figures = AllocatorModel().replay(events)
    assert figures["peak_reserved_bytes"] == 22 * MiB and figures["peak_allocated_bytes"] == 3 * MiB + 512
    with pytest.raises(ValueError, match="unknown allocator event"):
        AllocatorModel().replay([("realloc", 1)])


def test_a_snapshot_trace_replays_with_its_segment_addresses():
    from prism_megatron.runtime.allocator_model import events_from_snapshot

    snapshot = {"device_traces": [[
        {"action": "segment_alloc", "addr": 4096 << 20, "size": 20 * MiB},
        {"action": "alloc", "addr": 4096 << 20, "size": 4 * MiB},
        {"action": "alloc", "addr": (4096 << 20) + 4 * MiB, "size": 4 * MiB},
        {"action": "free_requested", "addr": 4096 << 20, "size": 4 * MiB},
        {"action": "free_completed", "addr": 4096 << 20, "size": 4 * MiB}]]}
    events, segments = events_from_snapshot(snapshot)
    assert segments == [4096 << 20] and [e[0] for e in events] == ["alloc", "alloc", "free"]
    m = AllocatorModel(segment_addresses=segments)
    assert m.replay(events)["peak_allocated_bytes"] == 8 * MiB and m.reserved == 20 * MiB
    with pytest.raises(ValueError, match="no trace for device 1"):
        events_from_snapshot(snapshot, device=1)


TRACES = sorted((Path(__file__).parent / "data").glob("cuda-alloc-trace-*-h200.npz"))
ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free"]


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_h200_traces_replay_to_the_exact_peaks(path):
    """Three iterations of a GPT rank (8 layers, hidden 4096, seq 2048, bf16; TP2, PP2 and DP2 with the
    distributed optimizer) recorded by the real caching allocator: tens of thousands of allocations
    and frees. Replayed, the model's peaks equal torch.cuda.max_memory_allocated/reserved exactly."""
    data = np.load(path)
    figures = json.loads(str(data["figures"]))
    action, addr, size = data["action"], data["addr"], data["size"]
    segments = [int(a) for a, c in zip(addr, action) if ACTIONS[c] == "segment_alloc"]
    events = [("alloc", int(a), int(s)) if ACTIONS[c] == "alloc" else ("free", int(a))
              for c, a, s in zip(action, addr, size) if ACTIONS[c] in ("alloc", "free_completed")]
    assert len(events) > 20_000 and figures["exit_code"] == 0
    got = AllocatorModel(segment_addresses=segments).replay(events)
    assert got["peak_allocated_bytes"] == figures["max_memory_allocated"]
    assert got["peak_reserved_bytes"] == figures["max_memory_reserved"]
    assert got["segments"] == len(segments)
    # without the recorded addresses, ties between equal free blocks break by the model's own order
    plain = AllocatorModel().replay(events)
    assert plain["peak_allocated_bytes"] == figures["max_memory_allocated"]
