#!/bin/bash
# One device call (1x H200), session 32: realtime emulation of CONFIGS (default tp2) with the runs kept
# (the sandboxes' graphs; from call 3 on with each pooled iteration's node durations beside them),
# while nvidia-smi logs the GPU's clocks, power and temperature (does the compute that moves between
# runs follow the SM clock?). Run from the repository root with the wheels of .whl/ on the path and OUT
# set. At most 8 files come back: the kept runs in one tarball.
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms ${SMI_MS:-200} > $OUT/smi.csv 2>&1 &
smi=$!
for c in ${CONFIGS:-tp2}; do
  start=$(date +%s)
  timeout ${LIMIT_S:-420} python3 benchmarks/fidelity.py --device cuda --no-real --realtime --configs $c \
    --reps ${REPS:-2} --iters ${ITERS:-10} --keep /tmp/keep-$c --json $OUT/realtime-$c.json > $OUT/realtime-$c.log 2>&1
  echo "$c rc=$? $(( $(date +%s) - start )) s"
  grep -v -i warn $OUT/realtime-$c.log | tail -3
  date +%s.%N > /tmp/keep-$c/ended_at
done
kill $smi
# the sandbox graphs, summaries and plans of every emulation, and the capture's graph
(cd /tmp && tar -czf $OUT/kept.tgz --exclude='*.trace.json' $(ls -d keep-*))
ls -la $OUT
