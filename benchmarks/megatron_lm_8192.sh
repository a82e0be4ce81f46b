#!/bin/bash
# Megatron-LM's own pretrain_gpt.py (core_v0.16.1, unmodified) as the job of an 8192-GPU run on one
# GPU: GPT-175B-shaped layers (hidden 12288, 96 heads, seq 2048, bf16, local spec), TP8 x PP16 x
# DP64, distributed optimizer, GBS microbatches per pipeline over DP64 (default 512: 8 each).
#   MODE=launch  (default) each of RANKS through `prism-megatron launch`, one after another: Megatron's
#                own log and each rank's summary (iterations, peak memory, communication counts);
#   MODE=capture `prism-megatron capture -- pretrain_gpt.py ...` (the probes of every role class, one
#                slice at a time on the GPU), then `emulate --sandbox RANKS` and `report` of it. The
#                capture works in $WORK/capture and reuses the slices it finds there (capture/run.py),
#                so RESUME=capture.tar.gz of an earlier call (unpacked first) continues that capture.
#                What comes back to $OUT: the logs and JSON summaries, capture.tar.gz (slices, their
#                logs, graph) and emulation.tar.gz (the sandbox's trace, summary and report).
# Run from the repository root with ARCHIVE (../shared/vendor/'s tarball) and OUT set; the package is
# importable from the checkout (or from /tmp/site, where the wheels of .whl/ are installed).
set -o pipefail
: "${OUT:?set OUT}" "${ARCHIVE:?set ARCHIVE to megatron-lm-core_v0.16.1-training.tar.gz}"
repo=$(pwd)
if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
work=${WORK:-/tmp/megatron_lm}  # fixed: the job's directory is part of its config, which a resumed capture matches
[ -f "$work/pretrain_gpt.py" ] || { mkdir -p "$work" && tar xzf "$ARCHIVE" -C "$work"; } || exit 1
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="$work:/tmp/site:$repo:${PYTHONPATH:-}" PYTHONWARNINGS=ignore
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} NCCL_NVLS_ENABLE=0
job=(pretrain_gpt.py --num-layers ${LAYERS:-96} --hidden-size ${HIDDEN:-12288} --num-attention-heads ${HEADS:-96}
  --seq-length ${SEQ:-2048} --max-position-embeddings ${SEQ:-2048} --micro-batch-size 1
  --global-batch-size ${GBS:-512} --train-iters ${TRAIN_ITERS:-1000}
  --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 51200 --transformer-impl local
  --bf16 --eval-iters 0 --eval-interval 100000 --log-interval 1 --no-gradient-accumulation-fusion
  --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm
  --no-rope-fusion --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
  --sequence-parallel --use-distributed-optimizer --prism-virtual-world-size 8192 ${EXTRA:-})
if [ "${MODE:-launch}" = capture ]; then
  s=$(date +%s)  # the native backend once, before the slices (each would otherwise wait on the first's build)
  python3 -c "from prism_megatron.comm import native; native.load()" > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
  echo "native backend built in $(( $(date +%s) - s )) s"
  runs=$work/prism; mkdir -p $runs
  [ -n "${RESUME:-}" ] && tar xzf "$RESUME" -C $runs && echo "resumed: $(ls $runs/capture/slices/*.prism | wc -l) slices"
  s=$(date +%s)
  (cd "$work" && timeout ${CAPTURE_S:-480} python3 -m prism_megatron.cli capture --out $runs/capture --workers 1 \
    --json $OUT/capture.json -- "${job[@]}") > $OUT/capture.log 2>&1
  echo "capture rc=$? $(( $(date +%s) - s )) s"; grep -v -i warn $OUT/capture.log | tail -12
  tar czf $OUT/capture.tar.gz -C $runs capture
  [ -f $runs/capture/graph.prism ] || exit 1
  s=$(date +%s)
  (cd "$work" && timeout ${EMULATE_S:-480} python3 -m prism_megatron.cli emulate $runs/capture/graph.prism \
    --out $runs/emulation --sandbox "$(echo ${RANKS:-0} | tr ' ' ,)" cluster=dgx_h200 \
    --json $OUT/emulation.json) > $OUT/emulation.log 2>&1
  echo "emulate rc=$? $(( $(date +%s) - s )) s"; grep -v -i warn $OUT/emulation.log | tail -12
  python3 -m prism_megatron.cli report $runs/emulation --out $runs/emulation/report 2>&1 | tail -2
  tar czf $OUT/emulation.tar.gz -C $runs emulation
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
