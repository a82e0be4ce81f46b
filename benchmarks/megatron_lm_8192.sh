#!/bin/bash
# Megatron-LM's own pretrain_gpt.py (core_v0.16.1, unmodified) as one rank of an 8192-GPU job on one
# GPU: GPT-175B-shaped layers (hidden 12288, 96 heads, seq 2048, bf16, local spec), TP8 x PP16 x DP64,
# 16 microbatches per iteration, through `prism-megatron launch`. Prints Megatron's own log (the last
# rank logs iteration time and loss) and writes each rank's summary (iterations, peak memory,
# communication counts) to $OUT. Needs ARCHIVE (the vendored training code, ../shared/vendor/) and the
# package importable; RANKS picks the sandboxes run one after another.
set -o pipefail
: "${OUT:?set OUT}" "${ARCHIVE:?set ARCHIVE to megatron-lm-core_v0.16.1-training.tar.gz}"
work=$(mktemp -d); tar xzf "$ARCHIVE" -C "$work"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="$work:${PYTHONPATH:-}" PYTHONWARNINGS=ignore
for rank in ${RANKS:-8191 0}; do
  s=$(date +%s)
  (cd "$work" && timeout ${LIMIT_S:-200} python3 -m prism_megatron.launch -- pretrain_gpt.py \
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 \
    --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1024 --train-iters ${ITERS:-3} \
    --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 51200 --transformer-impl local \
    --bf16 --eval-iters 0 --eval-interval 1000 --log-interval 1 --no-gradient-accumulation-fusion \
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm \
    --no-rope-fusion --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 \
    --sequence-parallel --use-distributed-optimizer \
    --prism-virtual-world-size 8192 --prism-sandbox-ranks $rank \
    --prism-summary-json $OUT/megatron_lm-rank$rank.json) > $OUT/megatron_lm-rank$rank.log 2>&1
  echo "rank $rank rc=$? $(( $(date +%s) - s )) s"
  grep -E "iteration +[0-9]+/|Error|error" $OUT/megatron_lm-rank$rank.log | grep -v -i warn | tail -5
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k in ('virtual_rank','iterations','peak_allocated_bytes')})" $OUT/megatron_lm-rank$rank.json 2>/dev/null
done
