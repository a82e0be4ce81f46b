"""Temporary: profile the real 1-GPU MoE run (per-op device time, GPU busy per iteration)."""
import json, os, sys
import torch
from torch.profiler import ProfilerActivity, profile, record_function
sys.path.insert(0, "examples")
import pretrain_gpt

out = os.environ["OUT"]
orig = pretrain_gpt.mock_batches
def marked(cfg, iteration, device):
    with record_function(f"prism_iter_{iteration}"):
        pass
    return orig(cfg, iteration, device)
pretrain_gpt.mock_batches = marked
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    pretrain_gpt.main(["--prism-config", "benchmarks/results/moe-routing-h200-2026-12-01/config-moe-ep1.yaml",
                       "--prism-summary-json", f"{out}/prof{{rank}}.json"])
ev = prof.events()
marks = sorted((e.time_range.start, e.name) for e in ev if e.name.startswith("prism_iter_"))
kern = sorted((e.time_range.start, e.time_range.end) for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
bounds = [m[0] for m in marks] + [max(k[1] for k in kern)]
busy = []
for a, b in zip(bounds, bounds[1:]):
    tot, cur_s, cur_e = 0.0, None, None
    for s, e in kern:
        if s < a or s >= b:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                tot += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        tot += cur_e - cur_s
    busy.append({"window_ms": (b - a) / 1e3, "gpu_busy_ms": tot / 1e3})
ops = [{"op": k.key, "calls": k.count, "device_ms": k.device_time_total / 1e3, "self_device_ms": k.self_device_time_total / 1e3,
        "cpu_ms": k.cpu_time_total / 1e3} for k in prof.key_averages()]
ops.sort(key=lambda r: -r["self_device_ms"])
json.dump({"iterations": busy, "ops": ops[:80]}, open(f"{out}/profile.json", "w"), indent=1)
print(json.dumps(busy))
for r in ops[:25]:
    print(f"{r['self_device_ms']:10.1f} ms x{r['calls']:6d} {r['op']}")
