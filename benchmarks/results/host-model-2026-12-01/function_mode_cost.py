"""Hot cost of tensor metadata calls with and without the CPU runtime's function mode, on a real and a
fake tensor (us per call, min of 3 repeats of 20000): python benchmarks/results/host-model-2026-12-01/function_mode_cost.py
"""
import sys, timeit, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from prism_megatron.runtime.cpu import _CudaToCpuMode
from torch._subclasses.fake_tensor import FakeTensorMode
x = torch.ones(4, 4)
def T(name, fn, n=20000):
    return min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6
with FakeTensorMode():
    f = torch.empty(64, 64)
for label, t in (("real", x), ("fake", f)):
    base = {k: T(k, fn) for k, fn in (("shape", lambda: t.shape), ("size()", lambda: t.size()), ("dim()", lambda: t.dim()), ("is_contiguous", lambda: t.is_contiguous()))}
    with _CudaToCpuMode():
        mode = {k: T(k, fn) for k, fn in (("shape", lambda: t.shape), ("size()", lambda: t.size()), ("dim()", lambda: t.dim()), ("is_contiguous", lambda: t.is_contiguous()))}
    print(label, {k: (round(base[k], 2), round(mode[k], 2)) for k in base})
