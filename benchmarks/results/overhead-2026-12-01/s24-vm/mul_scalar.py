# Hot host time of an in-place multiply by a Python number against a cached 0-dim tensor (session 24):
#   cd /tmp && OMP_NUM_THREADS=1 /work/main/.venv/bin/python /work/main/benchmarks/results/overhead-2026-12-01/s24-vm/mul_scalar.py
# then whether bf16 multiplies agree bit for bit (257 is not a bf16 number).
import time, torch
t = torch.ones(1024); b = torch.ones(1024, dtype=torch.bfloat16)
f32 = torch.tensor(8.0); i64 = torch.tensor(8); bf = torch.tensor(8, dtype=torch.bfloat16)
fns = {"f32 mul_(8)": lambda: t.mul_(8), "f32 mul_(f32 0d)": lambda: t.mul_(f32), "f32 mul_(i64 0d)": lambda: t.mul_(i64),
       "bf16 mul_(8)": lambda: b.mul_(8), "bf16 mul_(bf16 0d)": lambda: b.mul_(bf)}
torch.set_grad_enabled(False)
res = {k: [] for k in fns}
for rep in range(7):
    for k, f in fns.items():
        s = time.perf_counter()
        for _ in range(20000): f()
        res[k].append((time.perf_counter() - s) / 20000 * 1e6)
for k, v in res.items(): print(f"{k:>20} {sorted(v)[1]:.2f} us")
x = torch.randn(4096).to(torch.bfloat16)
for n in (3, 7, 8, 24, 257, 8192):
    a = x.clone().mul_(n); c = x.clone().mul_(torch.tensor(n, dtype=torch.bfloat16))
    print(n, torch.equal(a, c), float(torch.tensor(n, dtype=torch.bfloat16)))
