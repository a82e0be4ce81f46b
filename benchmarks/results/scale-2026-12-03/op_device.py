"""Where a sandbox's backend time falls, per (op, group dim): calls, bytes, and the time between each
operation's begin and issue marks (on GPU the device's, on CPU the host's), from the sandbox graph
that `emulate` writes (`<out>/sandbox/rank<R>.prism`; `emulate_scale.py --keep DIR` keeps it under
`DIR/emu-<spec>/sandbox/`), against the graph's compute.

    python op_device.py RANK.prism [--calls OP DIM]

`--calls OP DIM` (session 29) also lists that (op, dim)'s calls in program order, with their median.
"""

import sys
from collections import defaultdict

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from prism_megatron.graph.io import load_graph  # noqa: E402


def main(path: str, calls=None) -> None:
    g = load_graph(path, check=False)
    (rg,) = g.roles.values()  # a sandbox's graph holds its one role
    c = rg.columns
    text = lambda i: g.strings[i] if i >= 0 else "-"
    compute_s = float(c["duration_s"][c["kind"] == 0].sum())
    rows = defaultdict(lambda: [0, 0, 0.0, 0.0])
    listed = []
    for i in (c["kind"] != 0).nonzero()[0]:
        key = (text(c["op"][i]), text(c["dim"][i]))
        row = rows[key]
        d = float(c["duration_s"][i])
        if calls is not None and key == tuple(calls):
            listed.append(d)
        row[0] += 1
        row[1] += int(c["nbytes"][i])
        row[2] += d
        row[3] = max(row[3], d)
    total = sum(r[2] for r in rows.values())
    print(f"compute {compute_s * 1e3:.2f} ms; backend {total * 1e3:.3f} ms = {100 * total / compute_s:.2f} %")
    print(f"{'op':>24}{'dim':>8}{'calls':>7}{'MiB':>10}{'ms':>9}{'% of compute':>14}{'max us':>9}")
    for (op, dim), (n, nbytes, s, most) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"{op:>24}{dim:>8}{n:>7}{nbytes / 2**20:>10.2f}{s * 1e3:>9.3f}{100 * s / compute_s:>14.2f}"
              f"{most * 1e6:>9.0f}")
    if calls is not None:
        us = sorted(d * 1e6 for d in listed)
        print(f"{' '.join(calls)}: {len(us)} calls, median {us[len(us) // 2]:.0f} us; in order (us):",
              " ".join(f"{d * 1e6:.0f}" for d in listed))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3:5] if sys.argv[2:3] == ["--calls"] else None)
