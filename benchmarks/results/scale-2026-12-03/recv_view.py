"""Host cost of the CPU p2p mirror's recv copy, before and after session 29: three views of numpy
bytes made at every recv (`torch.from_numpy(raw).view(dtype).view(shape)`, as before) against one
tensor viewed at the send (`comm/slots.py host_copy`, now). Hot loop, microseconds per recv.

    python benchmarks/results/scale-2026-12-03/recv_view.py
"""

import time

import torch

t = torch.randn(32, 1, 64)  # the tiny config's pipeline activation: seq 32, micro-batch 1, hidden 64
raw = t.reshape(-1).view(torch.uint8).numpy().copy()
kept = torch.from_numpy(raw).view(t.dtype).view(t.shape)
ways = {"views at every recv": lambda: t.copy_(torch.from_numpy(raw).view(t.dtype).view(t.shape)),
        "viewed at the send": lambda: t.copy_(kept)}
for name, recv in ways.items():
    for _ in range(200):
        recv()
    start = time.perf_counter()
    for _ in range(5000):
        recv()
    print(f"{name:>22}: {(time.perf_counter() - start) / 5000 * 1e6:.1f} us")
