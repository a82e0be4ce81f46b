#!/bin/bash
# One device call (1x H200): two complete module-host calibrations back to back (how repeatable is the
# table on one host?), then the [D] MoE EP1 job for real. Run from the repository root with OUT set.
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
D=benchmarks/results/moe-routing-h200-2026-12-01
for k in a b; do
  cp prism_megatron/kernels/data/h200-2026-12-01.json /tmp/cal-$k.json
  python3 -c "
import json
from prism_megatron.kernels.host import calibrate_host_modules
calibrate_host_modules('/tmp/cal-$k.json', keep='/tmp/hostcal-$k')
d = json.load(open('/tmp/cal-$k.json'))
json.dump({'host_figures': d['host_figures'], 'host_modules': d['host_modules']}, open('$OUT/extract-$k.json', 'w'), indent=1)
" || { tail -20 /tmp/hostcal-$k/*.log; exit 1; }
done
cp /tmp/cal-b.json $OUT/cal-b.json
python3 examples/pretrain_gpt.py --prism-config $D/config-moe-ep1.yaml --prism-override train.iters=6 \
  --prism-summary-json $OUT/real-moe-ep1-repeat.json > /dev/null 2>&1
python3 -c "import json; print('real ep1', [round(x, 1) for x in json.load(open('$OUT/real-moe-ep1-repeat.json'))['iteration_times_ms']])"
