#!/bin/bash
# One H200: realtime emulation of CONFIGS (default moe_ep2) with the per-operation timer of opstat/
# in every sandbox process (opstat/sitecustomize.py), then a summary per process (summarize.py).
# Run from the repository root with the wheels of .whl/ installed on the path and OUT set.
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
HERE=benchmarks/results/opcost-2026-12-02
mkdir -p $OUT/opstat
for c in ${CONFIGS:-moe_ep2}; do
  start=$(date +%s)
  OPSTAT_OUT=$OUT/opstat PYTHONPATH=$PWD/$HERE/opstat:$PYTHONPATH timeout ${LIMIT_S:-290} \
    python3 benchmarks/fidelity.py --device cuda --no-real --realtime --configs $c \
    --reps ${REPS:-1} --iters 8 --json $OUT/realtime-$c.json > $OUT/realtime-$c.log 2>&1
  echo "$c rc=$? $(( $(date +%s) - start )) s"
  grep -v -i warn $OUT/realtime-$c.log | tail -3
done
python3 $HERE/summarize.py $OUT/opstat | tee $OUT/opstat-summary.txt
