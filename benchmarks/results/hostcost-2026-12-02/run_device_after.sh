#!/bin/bash
# One H200, after the host-time cuts of this directory's README: the hold kernel alone (its launcher
# and the plain launch side by side), then realtime emulation against the virtual figure
# (realtime-2026-12-02/run_device.sh) for CONFIGS (default moe_ep2 tp2), REPS each.
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
timeout 120 python3 benchmarks/results/realtime-2026-12-02/hold_smoke.py 2>&1 | tee $OUT/hold_smoke.json | tail -2
for c in ${CONFIGS:-moe_ep2 tp2}; do
  start=$(date +%s)
  timeout ${LIMIT_S:-250} python3 benchmarks/fidelity.py --device cuda --no-real --realtime --configs $c \
    --reps ${REPS:-2} --iters 8 --json $OUT/realtime-$c.json > $OUT/realtime-$c.log 2>&1
  echo "$c rc=$? $(( $(date +%s) - start )) s"
  grep -v -i warn $OUT/realtime-$c.log | tail -4
done
