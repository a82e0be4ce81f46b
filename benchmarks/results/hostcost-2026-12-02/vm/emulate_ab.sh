#!/bin/bash
# Interleaved A/B of emulated sandboxes on one captured graph G: OLD, a worktree of the code before
# (git worktree add /tmp/old 9cf0809), against this checkout; ROUNDS rounds, SANDBOX specs.
# PYTHONPATH picks the checkout for the emulator and the sandbox processes it starts.
#   prism-megatron capture --config configs/moe_8192.yaml --out /tmp/cap_ep64 emulation.sandbox_ranks=[] \
#     train.device=cpu parallel.tp=1 parallel.sequence_parallel=false parallel.ep=64 model.num_experts=64 \
#     train.global_batch_size=2048 moe.imbalance=force-balanced
#   OLD=/tmp/old G=/tmp/cap_ep64/graph.prism SANDBOX="4711 first-stage" bash emulate_ab.sh
NEW=$(cd "$(dirname "$0")/../../../.." && pwd)
for i in $(seq ${ROUNDS:-3}); do
  for side in $OLD $NEW; do
    (cd /tmp && PYTHONPATH=$side PYTHONWARNINGS=ignore $NEW/.venv/bin/python $side/benchmarks/emulate_scale.py \
       --graph $G --sandbox ${SANDBOX:-4711 first-stage} --json /tmp/es_ab_$(basename $side)_$i.json 2>&1 \
     | grep -E "^ +(4711|first|last)" | sed "s|^|$(basename $side) $i |")
  done
done
