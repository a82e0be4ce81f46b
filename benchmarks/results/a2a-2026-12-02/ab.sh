#!/bin/bash
# Interleaved A/B of a2a_cold.py: OLD, a worktree of the code before (git worktree add /tmp/old 8041844),
# against this checkout; ROUNDS rounds. Run from anywhere: OLD=/tmp/old bash ab.sh > ab.txt
HERE=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$HERE/../../.." && pwd)
port=29700
for i in $(seq ${ROUNDS:-3}); do
  for side in $OLD $NEW; do
    port=$((port + 1))
    PYTHONWARNINGS=ignore $NEW/.venv/bin/python $HERE/a2a_cold.py $side $port 2>&1 | sed "s|^|$(basename $side) $i |"
  done
done
