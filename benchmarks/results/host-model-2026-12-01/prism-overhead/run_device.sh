D=benchmarks/results/host-model-2026-12-01
export PYTHONWARNINGS=ignore
# one device call (1x H200), from the repository root with OUT set: plain, traced (both under cProfile), untraced with prism
python3 -m cProfile -o $OUT/plain.prof examples/pretrain_gpt.py --prism-config $D/config-dense-tiny.yaml --prism-override train.iters=6 --prism-summary-json $OUT/plain.json > $OUT/plain.log 2>&1
python3 -m cProfile -o $OUT/traced.prof examples/pretrain_gpt.py --prism-config $D/traced-dense-tiny.yaml --prism-override emulation.execution=real train.device=cuda train.iters=6 --prism-sandbox-ranks 0 --device cuda --prism-trace-path $OUT/t.prism --prism-trace-selection node-median --prism-summary-json $OUT/traced.json > $OUT/traced.log 2>&1
python3 examples/pretrain_gpt.py --prism-config $D/traced-dense-tiny.yaml --prism-override emulation.execution=real train.device=cuda train.iters=6 --prism-sandbox-ranks 0 --device cuda --prism-summary-json $OUT/untraced-prism.json > $OUT/untraced-prism.log 2>&1
for f in plain traced untraced-prism; do python3 -c "import json; d=json.load(open('$OUT/$f.json')); print('$f', [round(x, 1) for x in d['iteration_times_ms']])"; done
python3 - <<'PY'
import pstats, os, io
out = os.environ["OUT"]
for name in ("plain", "traced"):
    s = io.StringIO()
    st = pstats.Stats(f"{out}/{name}.prof", stream=s).sort_stats("tottime")
    st.print_stats(35)
    open(f"{out}/{name}-top.txt", "w").write(s.getvalue())
    print(name, "\n".join(s.getvalue().splitlines()[:48]))
PY
