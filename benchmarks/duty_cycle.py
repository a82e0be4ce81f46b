"""One rank of an 8192-GPU job at its production duty cycle against the same kernels back to back.

The job: GPT (8 layers, hidden 4096, seq 2048, bf16) data-parallel over 8192 virtual ranks on the
dgx_h100 cluster model, 4 microbatches per rank. Captured once on this GPU, then emulated twice with
the GPU's SM clock, power and temperature sampled (prism_megatron/faults/telemetry.py):

- production duty cycle: `emulate --clock realtime` (its sandbox runs hold each collective's stream
  for the wait the replay computes: the gradient all-reduce over 8192 ranks leaves the GPU idle as a
  real rank's would be);
- back to back: `emulate --pace off` (the same kernels, every collective ending at once: no gaps).

Prints the two telemetry summaries side by side and writes them, with the emulations' figures, to
benchmarks/results/duty_cycle.json (or --json PATH).

    python benchmarks/duty_cycle.py [--iters 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JOB = ["model.num_layers=8", "model.hidden_size=4096", "model.num_attention_heads=32",
       "model.seq_length=2048", "model.vocab_size=32000", "model.params_dtype=bf16",
       "train.micro_batch_size=1",
       "train.global_batch_size=32768", "train.device=cuda", "emulation.virtual_world_size=8192",
       "emulation.sandbox_ranks=[]"]


def main() -> int:
    from prism_megatron.capture.run import Capture
    from prism_megatron.config import load_config
    from prism_megatron.faults.telemetry import sample_during
    from prism_megatron.util import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--cluster", default="dgx_h100")
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        work = Path(args.out or name)
        cfg = load_config([*JOB, f"train.iters={args.iters}"])
        graph = Capture(cfg, str(work / "capture"), workers=1, device="cuda", log=print).run().graph_path
        results = {}
        for mode, flags in (("production_duty_cycle", ["--clock", "realtime"]),
                            ("back_to_back", ["--pace", "off"])):
            out = work / mode
            cmd = [sys.executable, "-m", "prism_megatron.cli", "emulate", graph, f"cluster={args.cluster}",
                   "--out", str(out), "--device", "cuda", *flags]
            code, telemetry = sample_during(cmd)
            if code:
                print(f"{mode}: emulate failed (exit {code})", file=sys.stderr)
                return 1
            summary = json.loads((out / "emulation.json").read_text())
            results[mode] = {"telemetry": telemetry["summary"], "samples": telemetry["samples"],
                             "iteration_time_s": summary["iteration_time_s"],
                             "sandbox": summary["sandbox"], "clock": summary["clock"],
                             "paced": summary["paced"]}
    print(f"{'':>24}{'duty cycle':>14}{'back to back':>14}")
    a, b = (results[m]["telemetry"].get("active", {}) for m in ("production_duty_cycle", "back_to_back"))
    for key, label in (("sm_mhz_mean", "SM clock mean (MHz)"), ("sm_mhz_min", "SM clock min (MHz)"),
                       ("power_w_mean", "power mean (W)"), ("power_w_max", "power max (W)"),
                       ("temp_c_max", "temperature max (C)"), ("capped_fraction", "capped fraction")):
        print(f"{label:>24}{a.get(key, float('nan')):>14.2f}{b.get(key, float('nan')):>14.2f}")
    path = args.json or str(REPO / "benchmarks" / "results" / "duty_cycle.json")
    atomic_write_text(path, json.dumps({"job": JOB, "iters": args.iters, "cluster": args.cluster,
                                        "results": results}, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
