"""Export a rank's timeline as Chrome-trace JSON (opens in Perfetto and chrome://tracing).

One process per exported virtual rank, one track (thread) per stream; every node is a complete
("X") event with its measured start and duration in microseconds, and its communication fields
(op, dim, bytes, dtype, sequence number, p2p peer) as args. The pipeline spans (forward/backward of
each microbatch and virtual stage) are one more track, `pipeline`. The timeline is the captured one of the
rank's role, or a simulated one (`simulate`, `emulate`) through the same function.
"""

from __future__ import annotations

import json
from typing import Iterable, Optional

import numpy as np

from prism_megatron.graph.model import NO_PEER, ExecutionGraph, NodeKind
from prism_megatron.util import atomic_write_text


def chrome_trace(graph: ExecutionGraph, ranks: Iterable[int], times: Optional[dict] = None,
                 source: str = "captured", rank_graphs: Optional[dict] = None) -> dict:
    """The Chrome-trace document for `ranks` (virtual ranks of `graph.world`); `times[rank]` =
    (start_s, end_s) arrays replace the captured times (a simulated timeline); `rank_graphs[rank]`
    replaces a rank's role graph (an emulation's sandbox)."""
    events: list[dict] = []
    for rank in ranks:
        g = (rank_graphs or {}).get(rank) or graph.graph_of(rank)
        cols = g.columns
        if times and rank in times:
            start, end = times[rank]
            cols = dict(cols, start_s=np.asarray(start), duration_s=np.asarray(end) - np.asarray(start))
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} {g.role}"}})
        tids: dict[int, int] = {}
        for stream in sorted({int(s) for s in cols["stream"]}):
            tids[stream] = len(tids) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tids[stream],
                           "args": {"name": graph.string(stream) or "default"}})
        for i in range(g.num_nodes):
            event = {"ph": "X", "pid": rank, "tid": tids[int(cols["stream"][i])],
                     "name": graph.string(int(cols["name"][i])),
                     "ts": float(cols["start_s"][i]) * 1e6, "dur": float(cols["duration_s"][i]) * 1e6,
                     "cat": "comm" if cols["kind"][i] == NodeKind.COMM else "compute"}
            if cols["kind"][i] == NodeKind.COMM:
                event["args"] = {"dim": graph.string(int(cols["dim"][i])),
                                 "bytes": int(cols["nbytes"][i]),
                                 "dtype": graph.string(int(cols["dtype"][i])), "seq": int(cols["seq"][i])}
                if cols["peer_delta"][i] != NO_PEER:
                    event["args"]["peer_delta"] = int(cols["peer_delta"][i])
            events.append(event)
        spans = g.spans
        if len(spans["name"]):
            tid = len(tids) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": "pipeline"}})
            for j in range(len(spans["name"])):
                start, end = float(spans["start_s"][j]), float(spans["end_s"][j])
                if times and rank in times:  # the simulated span: its first node's start to last's end
                    first, last = int(spans["first"][j]), int(spans["last"][j])
                    start = float(cols["start_s"][first])
                    end = float(cols["start_s"][last] + cols["duration_s"][last])
                label = (f"{graph.string(int(spans['name'][j]))} mb{int(spans['microbatch'][j])} "
                         f"chunk{int(spans['chunk'][j])}")
                events.append({"ph": "X", "pid": rank, "tid": tid, "cat": "pipeline", "name": label,
                               "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6,
                               "args": {"first_node": int(spans["first"][j]),
                                        "last_node": int(spans["last"][j])}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"world_size": graph.world.world_size, "source": source}}


def write_chrome_trace(graph: ExecutionGraph, ranks: Iterable[int], path: str,
                       times: Optional[dict] = None, source: str = "captured",
                       rank_graphs: Optional[dict] = None) -> None:
    """Write the trace of `ranks` to `path` atomically."""
    ranks = list(ranks)
    bad = [r for r in ranks if not 0 <= r < graph.world.world_size]
    if bad:
        raise ValueError(f"ranks {bad} are outside the virtual world of {graph.world.world_size}; "
                         f"choose ranks in 0..{graph.world.world_size - 1}")
    atomic_write_text(path, json.dumps(chrome_trace(graph, ranks, times, source, rank_graphs)))
