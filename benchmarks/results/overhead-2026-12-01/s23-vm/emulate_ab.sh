#!/bin/bash
# Interleaved A/B of the emulated tiny sandboxes (rank 4711, first stage) on one captured graph:
# OLD, a worktree of the code before (git worktree add /tmp/old f0c2eec), against this checkout.
# PYTHONPATH picks the checkout for the emulator and the sandbox processes it starts.
#   prism-megatron capture --config configs/tiny_8192.yaml --out /tmp/cap_tiny emulation.sandbox_ranks=[] train.device=cpu
#   OLD=/tmp/old G=/tmp/cap_tiny/graph.prism bash benchmarks/results/overhead-2026-12-01/s23-vm/emulate_ab.sh
NEW=$(cd "$(dirname "$0")/../../../.." && pwd)
for i in 1 2 3; do
  for side in $OLD $NEW; do
    (cd /tmp && PYTHONPATH=$side PYTHONWARNINGS=ignore $NEW/.venv/bin/python $side/benchmarks/emulate_scale.py \
       --graph $G --sandbox 4711 first-stage --json /tmp/es2_$(basename $side)_$i.json 2>&1 \
     | grep -E "^ +(4711|first)" | sed "s|^|$(basename $side) $i |")
  done
done
