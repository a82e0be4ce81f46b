"""The prism backend's frames inside the schedule's steps (forward_backward..., train_step...), from py-spy raw
stacks: inclusive and self sample counts. python hot_iter.py SPY.txt [TOP]"""
import collections, re, sys
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "hostcost-2026-12-02"))
from hot_frames import _records
path = sys.argv[1]; top = int(sys.argv[2]) if len(sys.argv) > 2 else 50
inc = collections.Counter(); own = collections.Counter(); tot = 0; train = 0
for line in _records(path):
    stack, _, count = line.rpartition(" ")
    if not count.isdigit(): continue
    n = int(count)
    frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
    names = [re.sub(r":\d+\)$", ")", f) for f in frames]
    if not any(f.startswith(("train_step", "forward_backward")) for f in names): continue
    train += n
    if not any(f.endswith("run (prism_megatron/comm/ops.py)") for f in names): continue
    # cut the stack at the outermost backend run
    k = next(i for i, f in enumerate(names) if f.endswith("run (prism_megatron/comm/ops.py)"))
    tot += n
    for f in set(names[k:]): inc[f] += n
    own[frames[-1]] += n
print("train_step samples", train, "backend", tot, f"{100*tot/max(1,train):.1f}%")
for f, n in inc.most_common(top): print(f"{n:7d} {100*n/tot:5.1f}% {f}")
print("-- self")
for f, n in own.most_common(top): print(f"{n:7d} {100*n/tot:5.1f}% {f}")
