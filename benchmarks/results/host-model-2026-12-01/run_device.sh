#!/bin/bash
# One device call (1x H200): real host-bound tiny runs for the fake host model, and a GPT-175B-shaped
# sandbox rank (TP8 PP16 at N = 8192, 2 microbatches) for the backend's host time per operation.
# Run from the repository root with OUT set.
D=benchmarks/results/host-model-2026-12-01
export PYTHONWARNINGS=ignore
for c in moe-tiny dense-tiny; do
  python3 examples/pretrain_gpt.py --prism-config $D/config-$c.yaml --prism-summary-json $OUT/real-$c.json > $OUT/real-$c.log 2>&1
  python3 -c "import json; d=json.load(open('$OUT/real-$c.json')); print('$c', [round(x, 1) for x in d['iteration_times_ms']])"
done
python3 examples/pretrain_gpt.py --prism-config configs/gpt175b_8192.yaml --prism-override emulation.execution=real \
  train.global_batch_size=128 train.iters=4 --prism-sandbox-ranks 4711 --device cuda \
  --prism-trace-path $OUT/rank4711.prism --prism-trace-selection node-median \
  --prism-summary-json $OUT/sandbox-175b.json > $OUT/sandbox-175b.log 2>&1
python3 - <<'PY'
import json, os, sys
from prism_megatron.graph import load_graph
out = os.environ["OUT"]
g = next(iter(load_graph(f"{out}/rank4711.prism", check=False).roles.values()))
s = json.load(open(f"{out}/sandbox-175b.json"))
kind = g.columns["kind"]
compute = float(g.columns["duration_s"][kind == 0].sum()); ops = int((kind != 0).sum())
backend = s["backend_host_s_per_iteration"]
print(json.dumps({"compute_s": compute, "comm_ops": ops, "backend_host_s_per_iteration": backend,
                  "iteration_times_ms": s["iteration_times_ms"],
                  "ratio_last": backend[-1] / compute, "us_per_op_last": backend[-1] / ops * 1e6}))
PY
