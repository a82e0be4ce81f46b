"""The device hold kernel alone (trace/cuda_hold.py), on one GPU: does a hold end where its plan says,
how coarse is the global timer, and what does a hold cost the host. Prints one JSON line.

    python benchmarks/results/realtime-2026-12-02/hold_smoke.py
"""

import json
import statistics
import time

import torch

from prism_megatron.trace.cuda_hold import DeviceHolds

out = {}
ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

# 1. a chain: op0 ends 3 ms after the start (ghosts) or 1 ms after itself; op1 2 ms after op0's end
#    or 0.5 ms after itself; op2 0.2 ms after itself: 5.2 ms in all
holds = DeviceHolds([(1e-3, ((-1, 3e-3),)), (0.5e-3, ((0, 2e-3),)), (0.2e-3, ())])
for _ in range(3):  # the first compiles
    a, b = ev(), ev()
    a.record()
    holds.begin()
    for k in range(3):
        holds.hold([k], True)
    b.record()
    torch.cuda.synchronize()
out["chain_ms_expected"] = 5.2
out["chain_ms"] = a.elapsed_time(b)

# 2. a late stream: 4 ms of compute before op0 makes its own 1 ms the later; op1 still 2 ms after it
x = torch.randn(4096, 4096, device="cuda")
a, b, c = ev(), ev(), ev()
a.record()
holds.begin()
t0 = time.perf_counter()
while True:  # about 4 ms of matmuls
    y = x @ x
    c.record()
    torch.cuda.synchronize()
    if a.elapsed_time(c) > 4.0:
        break
mid = ev()
mid.record()
holds.hold([0], True)
holds.hold([1], True)
b.record()
torch.cuda.synchronize()
out["late_after_compute_ms"] = mid.elapsed_time(b)
out["late_expected_ms"] = 1.0 + 2.0

# 3. accuracy of single holds of several lengths, measured by events
for us in (10, 100, 1000):
    h = DeviceHolds([(us * 1e-6, ())])
    got = []
    for _ in range(50):
        a, b = ev(), ev()
        h.begin()
        a.record()
        h.hold([0], True)
        b.record()
        torch.cuda.synchronize()
        got.append(a.elapsed_time(b) * 1e3)
    out[f"hold_{us}us_measured_us_median"] = statistics.median(got[5:])
    out[f"hold_{us}us_report"] = h.report()

# 4. host cost per hold launch (no wait: self 0, the device idle), through the compiled kernel's
#    launcher (since 2026-12-02, session 26) and the plain `kernel[grid](...)` way, median of 5 rounds
h = DeviceHolds([(0.0, ((-1, 0.0),))] * 1000)
out["launcher_in_use"] = all(r is not None for r in h._runners.values())
fast = dict(h._runners)
for name, runners in (("host_us_per_hold", fast), ("host_us_per_hold_plain", dict.fromkeys(fast))):
    h._runners = runners
    rounds = []
    for _ in range(5):
        h.begin()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(1000):
            h.hold([k], True)
        rounds.append((time.perf_counter() - t0) / 1000 * 1e6)
        torch.cuda.synchronize()
    out[name] = statistics.median(rounds)
print(json.dumps(out))
