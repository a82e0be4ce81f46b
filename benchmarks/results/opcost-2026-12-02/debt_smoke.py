"""The device holds' debt (trace/cuda_hold.py, emulate/holds.py), on one GPU: an operation stamped
where it begins whose local work (a 1 ms sleep kernel) outlasts its modelled transfer (0.5 ms) is not
held and leaves 0.5 ms of debt; the next one, 3 ms of transfer after its own 1 ms of local work, pays
it back and ends 0.5 ms early. Without stamps and transfers, the same rows (recorded local parts of
1 ms) give the same; with recorded local parts of 0.2 ms (the backend was slower this time) only the
stamps see the overrun. Also the host cost of a stamp. Prints one JSON line.

    python benchmarks/results/opcost-2026-12-02/debt_smoke.py
"""

import json
import statistics
import time

import torch

from prism_megatron.trace.cuda_hold import DeviceHolds

out = {}
ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731


def cycles_per_ms() -> float:
    """The sleep kernel's cycles per ms, measured after the clocks have ramped up (an idle GPU sits
    at 345 MHz: the first call of 2026-12-02 measured there, and its '1 ms' sleeps took 0.32 ms)."""
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(50):
        x @ x
    rates = []
    for _ in range(5):
        a, b = ev(), ev()
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        torch.cuda.synchronize()
        rates.append(20_000_000 / a.elapsed_time(b))
    return statistics.median(rates)


CYC = cycles_per_ms()


def run(rows, stamp: bool) -> tuple[float, dict]:
    """Two operations of 1 ms local work each, held by `rows`: device ms from the first begin to
    the second hold's end, and the report."""
    h = DeviceHolds(rows)
    for _ in range(3):  # the last one counts
        torch.cuda.synchronize()
        h.begin()
        a, b = ev(), ev()
        a.record()
        for k in range(2):
            if stamp:
                h.stamp(k)
            torch.cuda._sleep(int(CYC))  # the backend's local work, 1 ms
            h.hold([k], True)
        b.record()
        torch.cuda.synchronize()
    return a.elapsed_time(b), h.report()


def sleep_ms() -> float:
    a, b = ev(), ev()
    a.record()
    torch.cuda._sleep(int(CYC))
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


out["sleep_ms_before"] = sleep_ms()
stamped_rows = [(-0.5e-3, (), 0.5e-3), (2e-3, (), 3e-3)]
out["stamped_ms"], out["stamped_report"] = run(stamped_rows, True)
out["stamped_expected_ms"] = 1.0 + 1.0 + 2.0 - 0.5
out["unstamped_ms"], out["unstamped_report"] = run([(-0.5e-3, ()), (2e-3, ())], False)
out["unstamped_expected_ms"] = 1.0 + 1.0 + 2.0 - 0.5
# recorded local parts 0.2 ms: self_s = transfer - 0.2 ms; the run's local work is 1 ms
slow_rows = [(0.3e-3, (), 0.5e-3), (2.8e-3, (), 3e-3)]
out["slow_stamped_ms"], out["slow_stamped_report"] = run(slow_rows, True)
out["slow_stamped_expected_ms"] = 1.0 + 1.0 + 2.0 - 0.5
out["slow_unstamped_ms"], out["slow_unstamped_report"] = run([r[:2] for r in slow_rows], False)
out["slow_unstamped_expected_ms"] = 1.0 + 0.3 + 1.0 + 2.8  # every overrun stays in the wall
# a group issued together (a coalesced call): op0 stamped, 0.3 ms, op1 stamped, 0.7 ms, one hold for
# both; 0.5 ms of transfer each, so the group ends 0.8 ms after op0's begin and runs up 0.2 ms of
# debt once (not 0.5 + 0.2); op2 then pays it back: 1.0 + 3.0 - 0.2 ms (after the review, call 5)
group = DeviceHolds([(-0.5e-3, (), 0.5e-3), (-0.5e-3, (), 0.5e-3), (2e-3, (), 3e-3)])
for _ in range(3):
    torch.cuda.synchronize()
    group.begin()
    a, b = ev(), ev()
    a.record()
    group.stamp(0)
    torch.cuda._sleep(int(0.3 * CYC))
    group.stamp(1)
    torch.cuda._sleep(int(0.7 * CYC))
    group.hold([0, 1], True)
    group.stamp(2)
    torch.cuda._sleep(int(CYC))
    group.hold([2], True)
    b.record()
    torch.cuda.synchronize()
out["group_ms"], out["group_report"] = a.elapsed_time(b), group.report()
out["group_expected_ms"] = 1.0 + 3.0 - 0.2
out["group_expected_accrued_and_absorbed_s"] = 3 * 0.2e-3
out["sleep_ms_after"] = sleep_ms()
# the reports add up the 3 rounds of each run: 0.5 ms run up and paid back per round where the
# overrun is seen (all but slow_unstamped)
out["expected_accrued_and_absorbed_s"] = {"stamped": 1.5e-3, "unstamped": 1.5e-3, "slow_stamped": 1.5e-3,
                                          "slow_unstamped": 0.0}
# host cost of a stamp (the device idle), median of 5 rounds of 1000
h = DeviceHolds([(0.0, (), 0.0)] * 1000)
out["launcher_in_use"] = h._stamper is not None
rounds = []
for _ in range(5):
    h.begin()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(1000):
        h.stamp(k)
    rounds.append((time.perf_counter() - t0) / 1000 * 1e6)
    torch.cuda.synchronize()
out["host_us_per_stamp"] = statistics.median(rounds)
print(json.dumps(out))
