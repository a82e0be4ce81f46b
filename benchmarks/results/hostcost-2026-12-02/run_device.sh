#!/bin/bash
# One H200, from the repository root with OUT set and the wheels of .whl/ (py-spy among them) on the
# path: (1) the real 1-GPU MoE EP1 job of issue [J] (moe-routing-h200-2026-12-01's config) after the
# router's copy stopped synchronizing; (2) where the prism backend's host time goes on this host, from
# py-spy samples of an emulated MoE EP2 and TP2 (raw stacks gzipped, and hot_frames.py's
# summary of the sandbox process).
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
SPY=${SPY:-/tmp/site/bin/py-spy}
ref() { python3 -c "from prism_megatron.kernels.calibrate import host_reference_s as r; print('host_reference_s', r())"; }
if [ "${EP1:-1}" = 1 ]; then
  ref | tee -a $OUT/host_reference.txt
  start=$(date +%s)
  timeout 200 python3 examples/pretrain_gpt.py \
    --prism-config benchmarks/results/moe-routing-h200-2026-12-01/config-moe-ep1.yaml \
    --prism-summary-json $OUT/real-ep1.json > $OUT/real-ep1.log 2>&1
  echo "real ep1 rc=$? $(( $(date +%s) - start )) s"
  python3 -c "import json; d=json.load(open('$OUT/real-ep1.json')); print('ep1 iteration ms', d['iteration_times_ms'], 'peak', d['peak_allocated_bytes'])"
  ref | tee -a $OUT/host_reference.txt
  rm -f $OUT/real-ep1.log  # (at most 8 files come back)
fi
for c in ${CONFIGS:-moe_ep2 tp2}; do
  start=$(date +%s)
  timeout ${LIMIT_S:-200} $SPY record --nonblocking --subprocesses --format raw -r ${RATE:-250} \
    -o $OUT/spy-$c.txt -- python3 benchmarks/fidelity.py --device cuda --no-real --configs $c \
    --reps 1 --iters ${ITERS:-6} --json $OUT/emu-$c.json > $OUT/emu-$c.log 2>&1
  echo "$c rc=$? $(( $(date +%s) - start )) s"
  grep -v -i warn $OUT/emu-$c.log | tail -3
  python3 benchmarks/results/hostcost-2026-12-02/hot_frames.py $OUT/spy-$c.txt node-median 70 > $OUT/hot-$c.txt
  gzip -f $OUT/spy-$c.txt; rm -f $OUT/emu-$c.log
done
