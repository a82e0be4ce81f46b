#!/bin/bash
# Real runs on one H200 of the exact sandbox configs that fake execution ran (traced-*.yaml, as written
# by the fake runs), with the recorder on as an emulation's sandbox has it: per-node durations to set
# beside the fake graphs'. Run from the repository root with OUT set.
D=benchmarks/results/host-model-2026-12-01
export PYTHONWARNINGS=ignore
for c in moe-tiny dense-tiny moe-ep1; do
  python3 examples/pretrain_gpt.py --prism-config $D/traced-$c.yaml --prism-override emulation.execution=real \
    train.device=cuda train.iters=6 --prism-sandbox-ranks 0 --device cuda --prism-trace-path $OUT/real-$c.prism \
    --prism-trace-selection node-median --prism-summary-json $OUT/traced-$c.json > $OUT/traced-$c.log 2>&1
  python3 -c "import json; d=json.load(open('$OUT/traced-$c.json')); print('$c', [round(x, 1) for x in d['iteration_times_ms']])"
done
