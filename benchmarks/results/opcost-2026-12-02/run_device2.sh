#!/bin/bash
# One H200, after the debt (emulate/holds.py): the debt's own smoke test and the hold kernel's, then
# realtime emulation of CONFIGS (default "moe_ep2 tp2") with the per-operation timer (run_device.sh).
# Run from the repository root with the wheels of .whl/ installed on the path and OUT set.
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
HERE=benchmarks/results/opcost-2026-12-02
timeout 120 python3 $HERE/debt_smoke.py 2>&1 | tee $OUT/debt_smoke.json | tail -c 2000
timeout 120 python3 benchmarks/results/realtime-2026-12-02/hold_smoke.py 2>&1 | tee $OUT/hold_smoke.json | tail -c 600
CONFIGS=${CONFIGS:-"moe_ep2 tp2"} bash $HERE/run_device.sh
