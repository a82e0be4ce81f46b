#!/bin/bash
# One H200: realtime emulation against the virtual figure for the [D] configs, after the
# coalesced-Work fix (the figures of 2026-11-30 predate it). Run from the repository root, with the
# wheels of .whl/ on the path; CONFIGS names the configs (default: all four).
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
for c in ${CONFIGS:-dp2_distopt_overlap moe_ep2 tp2 pp2_1f1b}; do
  start=$(date +%s)
  timeout ${LIMIT_S:-290} python3 benchmarks/fidelity.py --device cuda --no-real --realtime --configs $c \
    --reps 1 --iters 8 --json $OUT/realtime-$c.json > $OUT/realtime-$c.log 2>&1
  echo "$c rc=$? $(( $(date +%s) - start )) s"
  grep -v -i warn $OUT/realtime-$c.log | tail -6
done
# GPT175B=1: the GPT-175B-shaped rank 4711 paced and not paced: is the backend's host time per
# operation its own work, or the host blocked in launches behind the paced waits?
if [ -n "${GPT175B:-}" ]; then
  timeout 200 python3 -m prism_megatron.cli capture --config configs/gpt175b_8192.yaml --out /tmp/g175 \
    emulation.sandbox_ranks=[] emulation.execution=real train.device=cuda train.global_batch_size=128 \
    2>&1 | grep -v -i warn | tail -2
  for pace in ${PACES:-on off}; do
    timeout 150 python3 benchmarks/emulate_scale.py --graph /tmp/g175/graph.prism --device cuda \
      --cluster dgx_h200 --sandbox 4711 --pace $pace --json $OUT/emulate_scale-gpt175b-pace-$pace.json \
      2>&1 | grep -v -i warn | tail -2
  done
fi
