import sys, collections
sys.path.insert(0, "/work/main")
import numpy as np
from prism_megatron.graph import load_graph
from prism_megatron.graph.model import structure_hash
def load(p):
    g = load_graph(p, check=False)
    r = next(iter(g.roles.values()))
    return r, g.strings
(a, sa), (b, sb) = load(sys.argv[1]), load(sys.argv[2])
print("nodes", len(a.columns["kind"]), len(b.columns["kind"]), "same structure:", structure_hash(a, sa) == structure_hash(b, sb))
def by_name(r, s):
    d = collections.defaultdict(float)
    for k, n, t in zip(r.columns["kind"], r.columns["name"], r.columns["duration_s"]):
        if k == 0:
            name = s[n]
            # group by module type: strip layer indices
            parts = [p for p in name.split(".") if not p.isdigit()]
            d[".".join(parts)] += t
    return d
da, db = by_name(a, sa), by_name(b, sb)
print("compute total: fake %.1f ms  real %.1f ms" % (sum(da.values())*1e3, sum(db.values())*1e3))
rows = sorted(set(da) | set(db), key=lambda k: -(db.get(k, 0) - da.get(k, 0)))
for k in rows[:18]:
    print(f"{k[:70]:70s} fake {da.get(k,0)*1e3:8.1f} real {db.get(k,0)*1e3:8.1f}  diff {(db.get(k,0)-da.get(k,0))*1e3:+8.1f} ms")
