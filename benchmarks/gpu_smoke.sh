#!/usr/bin/env bash
# On the GPU machine (2x H200): the virtual world on CUDA/NCCL with the image's torch.
#   1. one process as ranks 0 / 4711 / 8191 of a dense 8192-rank job, and rank 8191 of the MoE job;
#   2. no-ghost equivalence on 2 GPUs (NCCL): TP2 and PP2, plain vs prism with N = 2.
# Writes summaries under $OUT (or /tmp/gpu_smoke) and prints a comparison; see benchmarks/results/.
set -u
OUT=${OUT:-/tmp/gpu_smoke}; mkdir -p "$OUT"
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=4
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPUs')"
DENSE="--prism-virtual-world-size 8192 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --num-layers 16 --num-attention-heads 8 --global-batch-size 128 --micro-batch-size 1"
for r in 0 4711 8191; do
  timeout 300 python3 examples/pretrain_gpt.py --device cuda $DENSE --prism-sandbox-ranks $r \
    --prism-summary-json "$OUT/dense8192_r$r.json" 2>&1 | grep -E "iteration |rror" | tail -3
done
timeout 300 python3 examples/pretrain_gpt.py --device cuda --prism-config configs/moe_8192.yaml \
  --prism-sandbox-ranks 8191 --prism-summary-json "$OUT/moe8192_r8191.json" 2>&1 | grep -E "iteration |rror" | tail -3
port=29700
for cfg in tp2 pp2; do
  case $cfg in tp2) A="--tensor-model-parallel-size 2";; pp2) A="--pipeline-model-parallel-size 2";; esac
  for mode in plain prism; do
    X=""; [ $mode = prism ] && X="--prism-virtual-world-size 2"
    port=$((port+1))
    timeout 300 torchrun --nproc-per-node 2 --master-port $port examples/pretrain_gpt.py --device cuda $A \
      --hidden-size 1024 --num-attention-heads 16 --seq-length 512 --global-batch-size 8 --train-iters 5 $X \
      --prism-summary-json "$OUT/${cfg}_${mode}.json" > /tmp/${cfg}_${mode}.log 2>&1 \
      || { echo "== $cfg $mode failed:"; grep -E "^\[rank0\]" /tmp/${cfg}_${mode}.log | tail -30; }
  done
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*8192*.json")):
    s = json.loads(f.read_text())
    print(f"{f.stem:>20}: losses {s['losses']} grad norms {[round(g, 3) for g in s['grad_norms']]} "
          f"peak {s['peak_allocated_bytes']} B")
for cfg in ("tp2", "pp2"):
    for r in (0, 1):
        try:
            a = json.loads((out / f"{cfg}_plain.rank{r}.json").read_text())
            b = json.loads((out / f"{cfg}_prism.rank{r}.json").read_text())
        except FileNotFoundError as err:
            print(cfg, r, "missing", err); continue
        print(f"{cfg} rank {r}: losses equal {a['losses'] == b['losses']} grad norms equal "
              f"{a['grad_norms'] == b['grad_norms']} peak plain {a['peak_allocated_bytes']} prism "
              f"{b['peak_allocated_bytes']} iter ms plain {[round(x) for x in a['iteration_times_ms']]} "
              f"prism {[round(x) for x in b['iteration_times_ms']]}")
PY
