"""Fake predictions on this CPU of the host-bound tiny jobs and of the [D] MoE EP1 job, with a given
kernel calibration (default: the shipped one), as `prism-megatron train` makes them: the modelled
iteration times, median of iterations 2-3.

    python benchmarks/results/host-modules-2026-12-01/predict.py CAL.json|h200 [dense-tiny moe-tiny moe-ep1]
"""
import json, os, statistics, subprocess, sys, tempfile
from pathlib import Path
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
from prism_megatron.kernels.host import HOST_JOBS  # noqa: E402

EP1 = REPO / "benchmarks/results/moe-routing-h200-2026-12-01/config-moe-ep1.yaml"
JOBS = {**{k: (None, v) for k, v in HOST_JOBS.items()}, "moe-ep1": (str(EP1), [])}
target = sys.argv[1]
for name in sys.argv[2:] or list(JOBS):
    config, overrides = JOBS[name]
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "s.json")
        cmd = [sys.executable, str(REPO / "examples/pretrain_gpt.py"), *(["--prism-config", config] if config else []),
               "--prism-override", *overrides, "train.iters=3", "emulation.virtual_world_size=1",
               "emulation.execution=fake", "train.device=cpu", f"emulation.target_gpu={target}",
               "--prism-sandbox-ranks", "0", "--device", "cpu", "--prism-summary-json", summary]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        out = json.load(open(summary))
        times = out["iteration_times_ms"]
    fake = out.get("execution") or {}
    print(json.dumps({"job": name, "target": target, "iteration_times_ms": [round(t, 1) for t in times],
                      "median_2_3_ms": round(statistics.median(times[1:]), 1),
                      **{k: fake[k] for k in ("host_scale", "host_scale_samples", "host_work_s") if k in fake}}),
          flush=True)
