#!/bin/bash
# The EP64 rank's backend overhead with routed (zipf(1.2), every slot its own size) against
# force-balanced all-to-alls, on the 2-core VM, interleaved. N = 8192 as TP1 PP1 DP8192 EP64 with
# 2 MoE layers: at PP16 a routed capture is 962 slices (an hour here); at PP1 it is 64 (4 min).
# Captures (from the repository root):
#   prism-megatron capture --config configs/moe_8192.yaml --out /tmp/caps/ep64z1 emulation.sandbox_ranks=[] \
#     train.device=cpu parallel.tp=1 parallel.pp=1 model.num_layers=2 parallel.sequence_parallel=false \
#     parallel.ep=64 model.num_experts=64 train.global_batch_size=8192 'moe.imbalance=zipf(1.2)'
#   (the same with --out /tmp/caps/ep64b1 and moe.imbalance=force-balanced)
# Then: ROUNDS=3 bash benchmarks/results/scale-2026-12-03/routed_vm.sh
here=benchmarks/results/scale-2026-12-03
for i in $(seq 1 ${ROUNDS:-3}); do
  for g in ep64z1 ep64b1; do
    echo "== $g round $i"
    PYTHONWARNINGS=ignore python benchmarks/emulate_scale.py --graph /tmp/caps/$g/graph.prism \
      --sandbox 4711 0 --json $here/vm-$g-$i.json 2>&1 | grep -v -i warn | tail -3
  done
done
