"""The intermittent tests/test_deepspeed_moe.py::test_a_sandbox_among_ghost_experts_logs_and_holds_what_the_real_rank_does:
its real job (4 gloo processes) and its emulated job (1 process), N times; prints "same" or every
differing field of rank 1's MoE log lines. CAPACITY=1.0 for the [1.0] case; GCREAL=1 makes Python's
collector aggressive in the real ranks (gc.set_threshold(20, 1, 1) through a sitecustomize).

    python benchmarks/results/scale-2026-12-03/flaky_loop.py N"""
import json, os, subprocess, sys, tempfile
REPO = os.path.abspath(__file__).rsplit("/benchmarks/", 1)[0]
sys.path.insert(0, REPO)
from prism_megatron.util import free_port
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
MODEL = ["--device", "cpu", "--hidden-size", "32", "--num-layers", "2", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "256", "--micro-batch-size", "2", "--moe-router-topk", "2",
         "--deepspeed-config", f"{REPO}/configs/deepspeed/zero2.json"]
args = ["--num-experts", "8", "--expert-model-parallel-size", "4", "--global-batch-size", "16",
        "--train-iters", "2", "--prism-moe-imbalance", "dirichlet(0.5)"]
if os.environ.get("CAPACITY"):
    args += ["--moe-expert-capacity-factor", os.environ["CAPACITY"]]
GCSITE = tempfile.mkdtemp()
with open(f"{GCSITE}/sitecustomize.py", "w") as f:
    f.write("import gc; gc.set_threshold(20, 1, 1)\n")
def run(extra, out, name, nproc):
    env = dict(ENV, PYTHONPATH=GCSITE) if name == "real" and os.environ.get("GCREAL") else ENV
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", str(free_port())] if nproc > 1 else [sys.executable])
    p = subprocess.run([*launcher, f"{REPO}/examples/deepspeed_train.py", *MODEL, *args, *extra,
                        "--prism-moe-log-path", f"{out}/{name}{{rank}}.jsonl",
                        "--prism-summary-json", f"{out}/{name}{{rank}}.json"],
                       capture_output=True, text=True, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
for i in range(int(sys.argv[1])):
    with tempfile.TemporaryDirectory() as out:
        run([], out, "real", 4)
        run(["--prism-virtual-world-size", "4", "--prism-sandbox-ranks", "1"], out, "virt", 1)
        real = [json.loads(l) for l in open(f"{out}/real1.jsonl")]
        virt = [json.loads(l) for l in open(f"{out}/virt1.jsonl")]
        bad = [(j, k, a.get(k), b.get(k)) for j, (a, b) in enumerate(zip(real, virt)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        print(i, "same" if not bad and len(real) == len(virt) else bad, flush=True)
        if bad:
            for j, (a, b) in enumerate(zip(real, virt)): print(" real", j, a, "\n virt", j, b)
            for r in range(4):
                print(" real rank", r, [ {k: l.get(k) for k in l if 'mem' in k or 'bytes' in k} for l in map(json.loads, open(f"{out}/real{r}.jsonl"))])
