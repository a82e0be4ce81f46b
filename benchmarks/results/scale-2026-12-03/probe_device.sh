#!/bin/bash
# One device call (1x H200), session 28: why a GPU capture of the balanced EP64 MoE (config-moe-ep64-h200.yaml)
# planned 962 slices. The same layers at PP1 (one class, two probe slices: EP ranks 0 and 63), cut off
# after the probes, then probe_diff.py on them. From the repository root, wheels installed, OUT set.
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
here=benchmarks/results/scale-2026-12-03
timeout ${LIMIT_S:-80} python3 -m prism_megatron.cli capture --config $here/config-moe-ep64-h200.yaml \
  --out $OUT/cap emulation.sandbox_ranks=[] train.device=cuda parallel.pp=1 model.num_layers=2 \
  train.global_batch_size=8192 > $OUT/cap.log 2>&1
grep -v -i warn $OUT/cap.log | grep -v '^capture \[' | tail -5
ls $OUT/cap/slices
python3 $here/probe_diff.py $OUT/cap/slices/rank0.prism $OUT/cap/slices/rank63.prism 2>&1 | grep -v -i warn
