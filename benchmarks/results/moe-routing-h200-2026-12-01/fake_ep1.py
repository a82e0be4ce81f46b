"""Fake prediction of config-moe-ep1.yaml on this CPU against the real 1-GPU run (2273 ms, 112,594,896,384 B).

    python benchmarks/results/moe-routing-h200-2026-12-01/fake_ep1.py
"""
import sys, json, tempfile
from pathlib import Path
REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks")); sys.path.insert(0, str(REPO))
import fidelity, fake_fidelity
from prism_megatron.comm.cost import Calibration
fidelity.CONFIGS["moe_ep1"] = (1, ["parallel.ep=1", "model.num_experts=4", "model.moe_router_topk=2",
                                   "moe.imbalance=zipf(1.2)"], ["0"])
cal = Calibration.from_json((fake_fidelity.RESULTS / "calibration-h200x2-2026-11-30-device.json").read_text())
out = fake_fidelity.predict("moe_ep1", Path(tempfile.mkdtemp()), cal)
real = 2.2733417834999977
print(json.dumps({"fake_iter_s": out["iter_s"], "real_iter_s": real, "err_pct": (out["iter_s"] / real - 1) * 100,
                  "fake_peak_allocated": out["sandbox"]["peak_allocated_bytes"], "real_peak_allocated": 112594896384,
                  "alloc_err_pct": (out["sandbox"]["peak_allocated_bytes"] / 112594896384 - 1) * 100,
                  "capture_s": out["capture_s"], "sandbox": out["sandbox"]}, indent=1, default=str))
