#!/bin/bash
# One device call (1x H200): build the native backend with nvcc; then, as asked: the host-time
# breakdown of one all-reduce (BREAKDOWN=1), the host time per ghost operation against NCCL
# (benchmarks/ghost_op_cost.py, hot and cold; OPCOST=0 skips it), the 2-rank fidelity suite's
# emulations (benchmarks/fidelity.py --no-real) of CONFIGS, and the GPT-175B-shaped rank of the
# 8192-rank job (SCALE=1, benchmarks/emulate_scale.py) and the EP64 MoE rank of one (MOE_SCALE=1). Run from the repository root with .whl/
# carried and OUT set.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; which nvcc ninja; nproc
start=$(date +%s)
PRISM_NATIVE_VERBOSE=${VERBOSE:-} python3 -c "from prism_megatron.comm import native; print('native cuda:', native.load().CUDA)" \
  > $OUT/build.log 2>&1 || { grep -i -m 20 error $OUT/build.log; exit 1; }
echo "built in $(( $(date +%s) - start )) s"; tail -2 $OUT/build.log
if [ "${BREAKDOWN:-0}" = 1 ]; then
  timeout 120 python3 benchmarks/results/native/breakdown.py --device cuda --json $OUT/breakdown-h200.json 2>&1 | grep -v -i warn
fi
if [ "${OPCOST:-1}" = 1 ]; then
  for mode in hot cold; do
    timeout ${OPCOST_S:-200} python3 benchmarks/ghost_op_cost.py --device cuda --calls ${CALLS:-300} \
      $([ $mode = cold ] && echo --cold) --json $OUT/ghost_op_cost-h200-$mode.json 2>&1 | grep -v -i warn
  done
fi
for c in ${CONFIGS:-}; do
  s=$(date +%s)
  timeout ${LIMIT_S:-300} python3 benchmarks/fidelity.py --device cuda --no-real --configs $c --reps ${REPS:-1} \
    --iters ${ITERS:-8} --json $OUT/fidelity-$c.json > $OUT/fidelity-$c.log 2>&1
  echo "$c rc=$? $(( $(date +%s) - s )) s"
  grep -v -i warn $OUT/fidelity-$c.log | tail -4
done
if [ "${SCALE:-0}" = 1 ]; then  # the README's 8192-rank dense job, one sandbox
  s=$(date +%s)
  timeout ${SCALE_S:-330} python3 benchmarks/emulate_scale.py --config configs/gpt175b_8192.yaml emulation.execution=real \
    train.global_batch_size=128 --device cuda --cluster dgx_h200 --sandbox ${SCALE_SANDBOX:-4711} \
    --json $OUT/emulate_scale-gpt175b.json > $OUT/emulate_scale-gpt175b.log 2>&1
  echo "scale rc=$? $(( $(date +%s) - s )) s"; grep -v -i warn $OUT/emulate_scale-gpt175b.log | tail -6
fi
if [ "${MOE_SCALE:-0}" = 1 ]; then  # the Mixtral-like EP64 rank of an 8192-rank job, one sandbox
  s=$(date +%s)
  timeout ${MOE_SCALE_S:-330} python3 benchmarks/emulate_scale.py \
    --config benchmarks/results/scale-2026-12-03/config-moe-ep64-h200.yaml --device cuda --cluster dgx_h200 \
    --sandbox ${SCALE_SANDBOX:-4711} --json $OUT/emulate_scale-moe-ep64.json > $OUT/emulate_scale-moe-ep64.log 2>&1
  echo "moe scale rc=$? $(( $(date +%s) - s )) s"; grep -v -i warn $OUT/emulate_scale-moe-ep64.log | tail -6
fi
ls -la $OUT
