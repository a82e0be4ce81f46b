#!/bin/bash
# Fake predictions of the host-bound MoE jobs on this CPU, alternating a checkout of the code before
# HostScale (OLD, e.g. a worktree of e3b2a75) and this one, ROUNDS times each; one JSON line per job.
# PYTHONPATH picks the checkout: the editable install would otherwise serve this one to both.
#   OLD=/tmp/old ROUNDS=3 bash benchmarks/results/host-scale-2026-12-01/ab.sh > ab.jsonl
NEW=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PY:-$NEW/.venv/bin/python}
for i in $(seq 1 ${ROUNDS:-3}); do
  for side in old new; do
    root=$NEW; [ $side = old ] && root=$OLD
    (cd /tmp && PYTHONPATH=$root $PY $root/benchmarks/results/host-modules-2026-12-01/predict.py h200 moe-tiny moe-ep1 2>/dev/null) \
      | sed "s/^{/{\"side\": \"$side\", \"round\": $i, /"
  done
done
