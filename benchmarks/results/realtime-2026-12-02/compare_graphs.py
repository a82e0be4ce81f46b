"""Where a realtime sandbox run's time went, against the virtual (paced) run of the same emulation:
compute per segment name, communication nodes' device time per op, summed over the timed iteration.

    python benchmarks/results/realtime-2026-12-02/compare_graphs.py EMU_DIR RANK
(EMU_DIR: an emulation's --out, holding sandbox/ and realtime/; fidelity.py --keep DIR keeps them)
"""

import sys
from collections import defaultdict

from prism_megatron.graph import load_graph


def sums(path, rank):
    g = load_graph(path, check=False)
    r = g.graph_of(rank)
    cols = r.columns
    by = defaultdict(lambda: [0, 0.0])
    for kind, name, op, d in zip(cols["kind"].tolist(), cols["name"].tolist(), cols["op"].tolist(),
                                 cols["duration_s"].tolist()):
        key = ("compute " + g.strings[name]) if kind == 0 else ("comm " + g.strings[op])
        by[key][0] += 1
        by[key][1] += d
    span = float((cols["start_s"] + cols["duration_s"]).max() - cols["start_s"].min())
    return by, span


emu, rank = sys.argv[1], int(sys.argv[2])
virtual, vspan = sums(f"{emu}/sandbox/rank{rank}.prism", rank)
real, rspan = sums(f"{emu}/realtime/rank{rank}.prism", rank)
print(f"recorded span: virtual {vspan * 1e3:.2f} ms, realtime {rspan * 1e3:.2f} ms")
for tag in ("compute", "comm"):
    tv = sum(v[1] for k, v in virtual.items() if k.startswith(tag))
    tr = sum(v[1] for k, v in real.items() if k.startswith(tag))
    print(f"{tag}: virtual {tv * 1e3:.2f} ms, realtime {tr * 1e3:.2f} ms")
rows = sorted(set(virtual) | set(real), key=lambda k: -abs(real.get(k, [0, 0])[1] - virtual.get(k, [0, 0])[1]))
for k in rows[:25]:
    v, r = virtual.get(k, [0, 0.0]), real.get(k, [0, 0.0])
    print(f"{k[:60]:<60} n {v[0]:>4}/{r[0]:<4} virtual {v[1] * 1e3:9.3f} realtime {r[1] * 1e3:9.3f} "
          f"diff {(r[1] - v[1]) * 1e3:+8.3f} ms")
