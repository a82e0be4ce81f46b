"""Where a realtime run's wall goes past the replay of its own compute, node by node.

The realtime sandbox graph (`<emu>/realtime/rank<R>.prism`) holds the recorded start and duration of
every node of the iteration (device clock). The replay of the job with that graph in the sandbox's
place (what `prism-megatron emulate --clock realtime` reports as `realtime_replay_iteration_s`) gives
each node's start and end on the job's timeline. The lead of the recorded run over the replay, taken
at each node's end, grows where the run spent time the replay does not have; this prints where it
grew (by the node kind before which it grew: compute segments by name, communication by op) and its
total, and the same for the paced virtual run (`<emu>/sandbox/`) against the replay of its compute.

    python benchmarks/results/realtime-2026-12-03/split_realtime.py KEEP_DIR CONFIG [CALIBRATION]
(KEEP_DIR: what `fidelity.py --keep` left; every `<config>-*-emu*` under it is split)
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from prism_megatron.emulate.cli import load_calibration  # noqa: E402
from prism_megatron.emulate.run import _with_sandbox  # noqa: E402
from prism_megatron.graph import load_graph  # noqa: E402
from prism_megatron.sim.cluster import load_cluster  # noqa: E402
from prism_megatron.sim.des import Simulator  # noqa: E402


def split(capture: Path, run: Path, rank: int, cost) -> dict:
    graph = load_graph(str(capture))
    mine = load_graph(str(run / f"rank{rank}.prism"), check=False)
    merged, rank_graphs = _with_sandbox(graph, {rank: (mine.graph_of(rank), mine.strings)})
    result = Simulator(merged, cost, rank_graphs=rank_graphs).run((rank,))
    post, fin = result.timelines[rank]
    g = rank_graphs[rank]
    cols = g.columns
    start, dur, kind = cols["start_s"], cols["duration_s"], cols["kind"]
    order = np.argsort(start, kind="stable")  # the recorded order on the device
    rec = start[order] - start.min()
    rep = post[order] - post.min()
    # the lead of the run over the replay at each node's start; what it gains up to the next node's start
    # belongs to the node (its recorded length and the gap after it, against its replayed span)
    rec_next = np.append(rec[1:], (start + dur).max() - start.min())
    rep_next = np.append(rep[1:], fin.max() - post.min())
    gain = (rec_next - rec) - (rep_next - rep)
    by = defaultdict(lambda: [0, 0.0, []])
    for j, i in enumerate(order.tolist()):
        key = (("compute " + merged.strings[cols["name"][i]]) if kind[i] == 0
               else ("comm " + merged.strings[cols["op"][i]]))
        by[key][0] += 1
        by[key][1] += gain[j]
        by[key][2].append(gain[j])
    comm = kind[order] != 0
    return {"recorded_span_s": float(rec_next[-1]), "replay_span_s": float(rep_next[-1]),
            "replay_iteration_s": float(result.iteration_s), "by": by, "comm_gain": gain[comm],
            "compute_gain_s": float(gain[~comm].sum()), "compute_s": float(dur[kind == 0].sum()),
            "comm_n": int(comm.sum())}


def main() -> int:
    keep, config = Path(sys.argv[1]), sys.argv[2]
    calibration = load_calibration(sys.argv[3] if len(sys.argv) > 3 else str(
        REPO / "benchmarks" / "results" / "calibration-h200x2-2026-11-30-device.json"))
    cost = load_cluster("h200x2").cost_model(calibration)
    capture = keep / f"{config}-capture" / "graph.prism"
    for emu in sorted(keep.glob(f"{config}-*-emu*")):
        for part in ("sandbox", "realtime"):
            run = emu / part
            ranks = sorted(int(p.stem[4:]) for p in run.glob("rank*.prism"))
            for rank in ranks:
                s = split(capture, run, rank, cost)
                print(f"== {emu.name}/{part} rank {rank}: recorded span {s['recorded_span_s'] * 1e3:.2f} ms, "
                      f"replay span {s['replay_span_s'] * 1e3:.2f} ms (iteration {s['replay_iteration_s'] * 1e3:.2f}); "
                      f"compute {s['compute_s'] * 1e3:.2f} ms; run past replay: over compute nodes "
                      f"{s['compute_gain_s'] * 1e3:+.2f} ms, over {s['comm_n']} comm nodes "
                      f"{s['comm_gain'].sum() * 1e3:+.2f} ms")
                g = s["comm_gain"] * 1e6
                print("   comm gain per op (us): " + ", ".join(
                    f"p{q} {np.percentile(g, q):+.1f}" for q in (1, 10, 50, 90, 99)) +
                    f"; ops > +20 us: {(g > 20).sum()} summing {g[g > 20].sum() / 1e3:+.2f} ms, "
                    f"ops < -20 us: {(g < -20).sum()} summing {g[g < -20].sum() / 1e3:+.2f} ms")
                rows = sorted(s["by"].items(), key=lambda kv: -abs(kv[1][1]))
                for key, (n, ms, _) in rows[:6]:
                    print(f"   {key[:58]:<58} n {n:>4}  lead grew {ms * 1e3:+8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
