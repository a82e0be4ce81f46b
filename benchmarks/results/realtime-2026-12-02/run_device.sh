#!/bin/bash
# One H200: the device hold kernel alone, then realtime emulation (closed-loop holds) against the
# virtual figure for the [D] configs, REPS repetitions each. Run from the repository root with the
# wheels of .whl/ on the path; CONFIGS names the configs (default: all four).
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
if [ "${SMOKE:-1}" = 1 ]; then
  timeout 120 python3 benchmarks/results/realtime-2026-12-02/hold_smoke.py 2>&1 | tee $OUT/hold_smoke.json | tail -3
  grep -q chain_ms $OUT/hold_smoke.json || { echo "hold smoke failed"; exit 1; }
fi
for c in ${CONFIGS:-tp2 moe_ep2 pp2_1f1b dp2_distopt_overlap}; do
  start=$(date +%s)
  timeout ${LIMIT_S:-290} python3 benchmarks/fidelity.py --device cuda --no-real --realtime --configs $c \
    --reps ${REPS:-2} --iters 8 --json $OUT/realtime-$c.json > $OUT/realtime-$c.log 2>&1
  echo "$c rc=$? $(( $(date +%s) - start )) s"
  grep -v -i warn $OUT/realtime-$c.log | tail -4
done
