#!/bin/bash
# One device call (1x H200): the module host table (calibrate --host-modules: the host-bound tiny jobs
# real on the GPU, timed per module call, then fake on this host's CPU, counted) into a copy of the
# shipped kernel calibration with this host's launch figures; then, in the same call (the device host
# differs from call to call), the same tiny jobs untimed and the [D] MoE EP1 job for real (held out).
# Run from the repository root with OUT set.
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
D=benchmarks/results/moe-routing-h200-2026-12-01
cp prism_megatron/kernels/data/h200-2026-12-01.json $OUT/cal.json
python3 -c "
from prism_megatron.kernels.host import calibrate_host_modules
calibrate_host_modules('$OUT/cal.json', keep='/tmp/hostcal')" || { tail -20 /tmp/hostcal/*.log; exit 1; }
tar czf $OUT/hostcal.tgz -C /tmp hostcal
for c in dense-tiny moe-tiny; do
  python3 examples/pretrain_gpt.py --prism-config /tmp/hostcal/$c-real.yaml --device cuda \
    --prism-summary-json $OUT/untimed-$c.json > /dev/null 2>&1
  python3 -c "import json; print('untimed $c', [round(x, 1) for x in json.load(open('$OUT/untimed-$c.json'))['iteration_times_ms']])"
done
python3 examples/pretrain_gpt.py --prism-config $D/config-moe-ep1.yaml --prism-override train.iters=6 \
  --prism-summary-json $OUT/real-moe-ep1.json > $OUT/real-moe-ep1.log 2>&1
grep "iteration time" $OUT/real-moe-ep1.log
