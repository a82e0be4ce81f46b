#!/bin/bash
# One device call (1x H200), session 28: one rank of an N = 8192 job emulated on one GPU, with the
# backend's host time and its device time against the sandbox's compute (issue [D]'s scale goal).
# Run from the repository root with the wheels installed and OUT set. WHICH=gpt175b | gpt175b_ops | gpt175b_pace | gpt175b_cold | gpt175b_spy | hostbound | copies | moe_ep64.
set -o pipefail
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
here=benchmarks/results/scale-2026-12-03
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${WHICH:?WHICH=gpt175b, gpt175b_ops, gpt175b_pace, gpt175b_cold, gpt175b_spy, hostbound, copies or moe_ep64}" in
  gpt175b)
    python3 benchmarks/emulate_scale.py --config configs/gpt175b_8192.yaml emulation.execution=real \
      train.global_batch_size=128 --device cuda --cluster dgx_h200 --sandbox 4711 first-stage \
      --json $OUT/emulate_scale-h200-gpt175b.json 2>&1 | grep -v -i warn | tail -6 ;;
  copies)  # (session 29) the ghosts' slots of a gather filled three ways (benchmarks/broadcast_copy.py)
    python3 benchmarks/broadcast_copy.py --device cuda --json $OUT/broadcast_copy-h200.json 2>&1 | grep -v -i warn ;;
  gpt175b_pace)  # (session 29) rank 4711 from one capture: paced (the default on GPU) and unpaced,
    # alternating, each with op_device.py's per-op device time
    args="--device cuda --cluster dgx_h200 --sandbox 4711"
    python3 benchmarks/emulate_scale.py --config configs/gpt175b_8192.yaml emulation.execution=real \
      train.global_batch_size=128 $args --keep /tmp/w175 --json $OUT/pace-on-0.json > $OUT/pace.log 2>&1
    for run in ${RUNS:-off-1 on-1 off-2}; do
      # (session 30) the host's speed before each run: slow runs had 1.6x the backend's host time
      python3 -c "from prism_megatron.kernels.calibrate import host_reference_s as r; print('$run host_reference_s', r())" \
        2>&1 | grep host_reference | tee -a $OUT/host_reference.txt
      echo "$run loadavg $(cat /proc/loadavg) MHz $(grep MHz /proc/cpuinfo | awk '{s+=$4; n++} END {print s/n}')" \
        | tee -a $OUT/host_reference.txt
      python3 benchmarks/emulate_scale.py --graph /tmp/w175/capture/graph.prism $args --pace ${run%-*} \
        --keep /tmp/w175-$run --json $OUT/pace-$run.json >> $OUT/pace.log 2>&1
    done
    grep -v -i warn $OUT/pace.log | grep -v '^capture \['
    for f in /tmp/w175/emu-4711 /tmp/w175-*/emu-4711; do
      echo "== $f"; python3 $here/op_device.py $f/sandbox/rank4711.prism 2>&1 | grep -v -i warn
    done
    # (session 31) at most 8 files come back: the runs' JSON in one tarball
    tar -C $OUT -czf $OUT/pace-json.tgz $(cd $OUT && ls pace-*.json) && rm $OUT/pace-*.json ;;
  gpt175b_cold)  # (written in session 29, not yet run) why the run right after the capture is slower
    # (6.8 % on the device against 3.7-4.3 % from the kept graph): a cold Triton cache (the holds'
    # kernels compile in that run) or the capture itself. Unpaced right after the capture, then from
    # the kept graph: paced with a fresh cache, paced warm, paced with a fresh cache again, unpaced.
    # Then the backend's host work without the waits of a GPU-bound job: unpaced with
    # CUDA_LAUNCH_BLOCKING=1 (every launch returns when its kernel is done, so the queue never
    # fills; the backend's host time is then its host work plus its own kernels). About 420 s.
    args="--device cuda --cluster dgx_h200 --sandbox 4711"
    python3 benchmarks/emulate_scale.py --config configs/gpt175b_8192.yaml emulation.execution=real \
      train.global_batch_size=128 $args --pace off --keep /tmp/w175 --json $OUT/cold-off-0.json > $OUT/cold.log 2>&1
    for run in cold-1 warm-1 cold-2 off-1 block-1 block-2; do
      pace=on; blocking=0
      case $run in off-*) pace=off ;; block-*) pace=off; blocking=1 ;; esac
      cache=/tmp/triton-warm; [ ${run%-*} = cold ] && cache=/tmp/triton-$run
      CUDA_LAUNCH_BLOCKING=$blocking TRITON_CACHE_DIR=$cache python3 benchmarks/emulate_scale.py \
        --graph /tmp/w175/capture/graph.prism $args --pace $pace --keep /tmp/w175-$run \
        --json $OUT/cold-$run.json >> $OUT/cold.log 2>&1
    done
    grep -v -i warn $OUT/cold.log | grep -v '^capture \['
    for f in /tmp/w175/emu-4711 /tmp/w175-*/emu-4711; do
      echo "== $f"; python3 $here/op_device.py $f/sandbox/rank4711.prism 2>&1 | grep -v -i warn | head -4
    done ;;
  gpt175b_spy)  # (session 30) where the sandbox's host time goes, paced and unpaced: a capture of
    # 12 iterations (the unpaced emulation right after it), then py-spy around a paced and an unpaced
    # emulation from the kept graph; hot_frames.py's summary of the sandbox process per run. The
    # raw stacks and the runs' JSON come back in one tarball (at most 8 files come back).
    args="--device cuda --cluster dgx_h200 --sandbox 4711"
    SPY=${SPY:-/tmp/site/bin/py-spy}
    python3 benchmarks/emulate_scale.py --config configs/gpt175b_8192.yaml emulation.execution=real \
      train.global_batch_size=128 train.iters=12 $args --pace off --keep /tmp/w175 \
      --json $OUT/spy-off-0.json > $OUT/spy.log 2>&1
    for pace in on off; do
      timeout ${LIMIT_S:-200} $SPY record --nonblocking --subprocesses --format raw -r ${RATE:-500} \
        -o /tmp/spy-$pace.txt -- python3 benchmarks/emulate_scale.py --graph /tmp/w175/capture/graph.prism \
        $args --pace $pace --keep /tmp/w175-spy-$pace --json $OUT/spy-$pace.json >> $OUT/spy.log 2>&1
      python3 benchmarks/results/hostcost-2026-12-02/hot_frames.py /tmp/spy-$pace.txt pretrain_gpt 70 \
        > $OUT/hot-$pace.txt
    done
    grep -v -i warn $OUT/spy.log | grep -v '^capture \['
    for f in /tmp/w175/emu-4711 /tmp/w175-spy-*/emu-4711; do
      echo "== $f"; python3 $here/op_device.py $f/sandbox/rank4711.prism 2>&1 | grep -v -i warn | head -4
    done
    gzip -f /tmp/spy-on.txt /tmp/spy-off.txt
    tar -C /tmp -czf $OUT/spy-extra.tgz spy-on.txt.gz spy-off.txt.gz w175/emu-4711/sandbox/summary4711.json \
      w175-spy-on/emu-4711/sandbox/summary4711.json w175-spy-off/emu-4711/sandbox/summary4711.json ;;
  hostbound)  # (session 31) the host-bound probe where the host must be the bottleneck: the tiny
    # layers of tiny_8192.yaml on the H200 (capture with its slices' shares, paced and unpaced
    # emulation), then `prism-megatron emulate` as a user sees its report
    args="--device cuda --cluster dgx_h200 --sandbox 4711"
    python3 benchmarks/emulate_scale.py --config configs/tiny_8192.yaml train.iters=6 $args \
      --keep /tmp/wt --json $OUT/hostbound-tiny-on.json > $OUT/hostbound.log 2>&1
    python3 benchmarks/emulate_scale.py --graph /tmp/wt/capture/graph.prism $args --pace off \
      --keep /tmp/wt-off --json $OUT/hostbound-tiny-off.json >> $OUT/hostbound.log 2>&1
    python3 -m prism_megatron.cli emulate /tmp/wt/capture/graph.prism cluster=dgx_h200 --sandbox 4711 \
      --out /tmp/wt-cli --json $OUT/hostbound-tiny-cli.json >> $OUT/hostbound.log 2>&1
    grep -v -i warn $OUT/hostbound.log | grep -v "^ *$"; grep -i "WARNING" $OUT/hostbound.log ;;
  gpt175b_ops)  # the same as gpt175b, keeping the sandboxes' graphs: per op kind
    python3 benchmarks/emulate_scale.py --config configs/gpt175b_8192.yaml emulation.execution=real \
      train.global_batch_size=128 --device cuda --cluster dgx_h200 --sandbox 4711 first-stage \
      --keep /tmp/w175 --json $OUT/emulate_scale-h200-gpt175b-ops.json > $OUT/gpt175b_ops.log 2>&1
    grep -v -i warn $OUT/gpt175b_ops.log | grep -v '^capture \[' | tail -4
    for f in /tmp/w175/emu-*/sandbox/rank*.prism; do
      echo "== $f"; cp $f $OUT/; python3 $here/op_device.py $f 2>&1 | grep -v -i warn
    done ;;
  moe_ep64)
    # The first try (the config as committed, piped through tail) ran past the call's 580 s with
    # nothing printed; this one logs to OUT and, past LIMIT_S, dumps every Python stack (py-spy) first.
    python3 benchmarks/emulate_scale.py --config $here/config-moe-ep64-h200.yaml "$@" \
      --device cuda --cluster dgx_h200 --sandbox ${SANDBOX:-4711} \
      --json $OUT/emulate_scale-h200-moe-ep64.json > $OUT/moe_ep64.log 2>&1 &
    job=$!
    for t in $(seq 1 ${LIMIT_S:-480}); do kill -0 $job 2>/dev/null || break; sleep 1; done
    if kill -0 $job 2>/dev/null; then
      for p in $(pgrep -f python3); do py-spy dump --pid $p > $OUT/stack-$p.txt 2>&1; done
      pkill -P $job; kill $job
    fi
    wait $job; grep -v -i warn $OUT/moe_ep64.log | tail -6 ;;
esac
