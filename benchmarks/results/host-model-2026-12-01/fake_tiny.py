"""Fake predictions on this CPU of the host-bound tiny configs, and of the [D] MoE EP1 job, against
their real 1-H200 runs (this folder's real-*.json, and ../moe-routing-h200-2026-12-01/).

    python benchmarks/results/host-model-2026-12-01/fake_tiny.py [moe-tiny dense-tiny moe-ep1]
"""
import json, statistics, sys, tempfile
from pathlib import Path
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "benchmarks")); sys.path.insert(0, str(REPO))
import fidelity, fake_fidelity
from prism_megatron.comm.cost import Calibration

TINY = ["model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=256"]
MOE = ["parallel.ep=1", "model.num_experts=4", "model.moe_router_topk=2", "moe.imbalance=zipf(1.2)"]
JOBS = {"moe-tiny": (MOE + TINY, HERE / "real-moe-tiny.json"),
        "dense-tiny": (TINY, HERE / "real-dense-tiny.json"),
        "moe-ep1": (MOE, HERE.parent / "moe-routing-h200-2026-12-01" / "real-ep1-vectorized.json")}
cal = Calibration.from_json((fake_fidelity.RESULTS / "calibration-h200x2-2026-11-30-device.json").read_text())
for name in sys.argv[1:] or list(JOBS):
    overrides, real_file = JOBS[name]
    fidelity.CONFIGS[name] = (1, overrides, ["0"])
    real = statistics.median(json.loads(real_file.read_text())["iteration_times_ms"][1:]) / 1e3
    out = fake_fidelity.predict(name, Path(tempfile.mkdtemp()), cal)
    print(json.dumps({"job": name, "real_iter_s": real, "fake_iter_s": out["iter_s"],
                      "err_pct": (out["iter_s"] / real - 1) * 100}), flush=True)
