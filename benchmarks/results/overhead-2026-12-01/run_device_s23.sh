#!/bin/bash
# One device call (1x H200), session 23: the host's cold cost per synchronous all-reduce before the
# per-operation trims (a copy of e3b2a75^ in _ab_old/) and after, interleaved; then the GPT-175B-shaped
# rank 4711 and first stage emulated (TP8 PP16 DP64, 2 microbatches). Run from the repository root.
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
for i in 1 2; do
  for side in old new; do
    root=.; [ $side = old ] && root=_ab_old
    python3 $root/benchmarks/recorder_cost.py --device cuda --cold --world 8 --calls 2000 \
      --json $OUT/recorder_cost-cold-$side-$i.json | sed "s/^/$side $i /"
  done
done
python3 benchmarks/emulate_scale.py --config configs/gpt175b_8192.yaml emulation.execution=real \
  train.global_batch_size=128 --device cuda --cluster dgx_h200 --sandbox 4711 first-stage \
  --json $OUT/emulate_scale-h200-gpt175b.json 2>&1 | grep -v -i warn | tail -4
