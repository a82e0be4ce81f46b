"""Which part of the structure hash (graph/model.py `structure_hash`) differs between two capture
slices of one class: the node columns (first differing node, with its name and op), the dependencies,
the memory peak and its breakdown, the pipeline spans, the MoE rows. A capture whose probes differ
captures every role of the class; this says why.

    python probe_diff.py SLICES_DIR/rank0.prism SLICES_DIR/rank63.prism
"""

import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from prism_megatron.graph.io import load_graph  # noqa: E402
from prism_megatron.graph.model import STRING_COLUMNS, _TIMING  # noqa: E402


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
    print("deps equal:", np.array_equal(a.dep_ptr, b.dep_ptr) and np.array_equal(a.dep_idx, b.dep_idx))
    print("peak:", a.peak_bytes, b.peak_bytes, "delta", b.peak_bytes - a.peak_bytes)
    for k in sorted(set(a.peak_by_category) | set(b.peak_by_category)):
        va, vb = a.peak_by_category.get(k), b.peak_by_category.get(k)
        if va != vb:
            print(f"  peak_by_category[{k}]: {va} vs {vb}")
    for col in sorted(a.spans):
        if col not in ("start_s", "end_s") and not np.array_equal(a.spans[col], b.spans[col]):
            print(f"spans {col} differ")
    for col in sorted(a.moe):
        if col != "layer" and not np.array_equal(a.moe[col], b.moe[col]):
            print(f"moe {col} differ")
    print("moe tokens equal:", np.array_equal(a.moe_ptr, b.moe_ptr) and np.array_equal(a.moe_tokens, b.moe_tokens))


if __name__ == "__main__":
    main(*sys.argv[1:3])
