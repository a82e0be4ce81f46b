#!/bin/bash
# Megatron-LM's own pretrain_gpt.py (core_v0.16.1, unmodified) as the job of an 8192-GPU run on one
# GPU: GPT-175B-shaped layers (hidden 12288, 96 heads, seq 2048, bf16, local spec), TP8 x PP16 x
# DP64, distributed optimizer, GBS microbatches per pipeline over DP64 (default 512: 8 each).
#   MODE=launch  (default) each of RANKS through `prism-megatron launch`, one after another: Megatron's
#                own log and each rank's summary (iterations, peak memory, communication counts);
#   MODE=capture `prism-megatron capture -- pretrain_gpt.py ...` (the probes of every role class, one
#                slice at a time on the GPU), then `emulate --sandbox RANKS` and `report` of it.
# Run from the repository root with ARCHIVE (../shared/vendor/'s tarball) and OUT set; the package is
# importable from the checkout (and /tmp/site where run_device.sh installed the wheels).
set -o pipefail
: "${OUT:?set OUT}" "${ARCHIVE:?set ARCHIVE to megatron-lm-core_v0.16.1-training.tar.gz}"
repo=$(pwd)
if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
work=$(mktemp -d); tar xzf "$ARCHIVE" -C "$work"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="$work:/tmp/site:$repo:${PYTHONPATH:-}" PYTHONWARNINGS=ignore
job=(pretrain_gpt.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
  --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size ${GBS:-512} --train-iters 1000
  --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 51200 --transformer-impl local
  --bf16 --eval-iters 0 --eval-interval 100000 --log-interval 1 --no-gradient-accumulation-fusion
  --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm
  --no-rope-fusion --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
  --sequence-parallel --use-distributed-optimizer --prism-virtual-world-size 8192)
if [ "${MODE:-launch}" = capture ]; then
  s=$(date +%s)
  (cd "$work" && timeout ${LIMIT_S:-480} python3 -m prism_megatron.cli capture --out $OUT/capture --workers 1 \
    --json $OUT/capture.json -- "${job[@]}") > $OUT/capture.log 2>&1
  echo "capture rc=$? $(( $(date +%s) - s )) s"; grep -v -i warn $OUT/capture.log | tail -6
  s=$(date +%s)
  (cd "$work" && timeout ${LIMIT_S:-480} python3 -m prism_megatron.cli emulate $OUT/capture/graph.prism \
    --out $OUT/emulation --sandbox "$(echo ${RANKS:-0} | tr ' ' ,)" cluster=dgx_h200 \
    --json $OUT/emulation.json) > $OUT/emulation.log 2>&1
  echo "emulate rc=$? $(( $(date +%s) - s )) s"; grep -v -i warn $OUT/emulation.log | tail -8
  python3 -m prism_megatron.cli report $OUT/emulation --out $OUT/report 2>&1 | tail -2
  exit 0
fi
for rank in ${RANKS:-8191 0}; do
  s=$(date +%s)
  (cd "$work" && timeout ${LIMIT_S:-200} python3 -m prism_megatron.launch -- "${job[@]}" --prism-stop-after ${ITERS:-3} \
    --prism-sandbox-ranks $rank --prism-summary-json $OUT/megatron_lm-rank$rank.json) > $OUT/megatron_lm-rank$rank.log 2>&1
  echo "rank $rank rc=$? $(( $(date +%s) - s )) s"
  grep -E "iteration +[0-9]+/|Error|error" $OUT/megatron_lm-rank$rank.log | grep -v -i warn | tail -5
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k in ('virtual_rank','iterations','iteration_times_ms','peak_allocated_bytes')})" $OUT/megatron_lm-rank$rank.json 2>/dev/null
done
