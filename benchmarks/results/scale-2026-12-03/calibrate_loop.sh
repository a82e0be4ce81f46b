#!/bin/bash
# The calibrate test's command N times (the intermittent SIGABRT of session 29); keeps the log of
# every failed run under /tmp and prints the count.
#   N=30 bash benchmarks/results/scale-2026-12-03/calibrate_loop.sh > calibrate_loop-vm.txt
PM=${PM:-$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/prism-megatron}
fails=0
for i in $(seq 1 ${N:-30}); do
  $PM calibrate --device cpu --nproc 2 --min-bytes 1KiB --max-bytes 8KiB --out /tmp/cal-loop.json \
    > /tmp/cal-loop-$i.log 2>&1
  rc=$?
  if [ $rc != 0 ]; then fails=$((fails + 1)); echo "run $i rc=$rc (/tmp/cal-loop-$i.log)"; else rm -f /tmp/cal-loop-$i.log; fi
done
echo "fails=$fails of ${N:-30}"
