"""Which part of the structure hash (graph/model.py `structure_hash`) differs between two capture
slices of one class: the first differing node of each node column (with its name), then the capture's own verdict
(`structure_difference`: the parts that differ, and the memory peaks). A capture whose probes differ
captures every role of the class; this says why.

    python probe_diff.py SLICES_DIR/rank0.prism SLICES_DIR/rank63.prism
"""

import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from prism_megatron.graph.io import load_graph  # noqa: E402
from prism_megatron.graph.model import STRING_COLUMNS, _TIMING, structure_difference  # noqa: E402


def role_graph(path):
    g = load_graph(path, check=False)
    (role_graph,) = g.roles.values()  # a slice holds its one role
    return role_graph, g.strings


def main(a_path, b_path):
    (a, sa), (b, sb) = role_graph(a_path), role_graph(b_path)
    name = lambda s, g, i: s[g.columns["name"][i]] if g.columns["name"][i] >= 0 else ""
    print(f"nodes {len(a.columns['kind'])} / {len(b.columns['kind'])}")
    for col in sorted(a.columns):
        if col in _TIMING:
            continue
        x, y = a.columns[col], b.columns[col]
        if col in STRING_COLUMNS:
            x = np.asarray([sa[i] if i >= 0 else "" for i in x.tolist()], dtype=object)
            y = np.asarray([sb[i] if i >= 0 else "" for i in y.tolist()], dtype=object)
        if len(x) != len(y):
            print(f"column {col}: lengths differ")
            continue
        bad = np.flatnonzero(x != y)
        if len(bad):
            i = int(bad[0])
            print(f"column {col}: {len(bad)} nodes differ; first at {i} ({name(sa, a, i)!r}): {x[i]!r} vs {y[i]!r}")
    print("structure_difference:", structure_difference(a, sa, b, sb))  # the capture's own verdict

if __name__ == "__main__":
    main(*sys.argv[1:3])
