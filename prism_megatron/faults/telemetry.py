"""GPU telemetry beside a run: SM clock, power, temperature and throttle reasons, sampled periodically.

`python -m prism_megatron.faults.telemetry --out samples.json [--gpu 0] [--period-ms 100] -- CMD ...`
runs CMD and samples the GPU meanwhile with `nvidia-smi --query-gpu ... -lms` (present wherever the
driver is; NVML through nvidia-ml-py reads the same counters). The JSON holds every sample (seconds
since the start, SM MHz, W, deg C, the active clock-event reasons as a bit mask) and a summary: mean
and minimum SM clock, mean and maximum power, maximum temperature, the fraction of samples with a
thermal or power cap active. A run at production duty cycle (realtime emulation: the waits for
ghosts injected as idle device time) and the same kernels back to back differ here: that difference
is what a small test misses and a production rank sees.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from typing import Optional

from prism_megatron import procs

FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
# nvidia-smi's clock-event reason bits: SW power cap, HW slowdown, HW thermal, SW thermal, HW power brake
CAPS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def parse(lines: list[str], t0: float, stamps: list[float]) -> list[dict]:
    samples = []
    for line, t in zip(lines, stamps):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            samples.append({"t_s": round(t - t0, 3), "sm_mhz": float(parts[0]), "power_w": float(parts[1]),
                            "temp_c": float(parts[2]), "reasons": int(parts[3], 16)})
        except ValueError:
            continue
    return samples


def summarize(samples: list[dict]) -> dict:
    """Over all samples, and over the `active` ones (power above 1.5 x the idle power of the first
    samples, i.e. while the job runs rather than while Python starts)."""
    if not samples:
        return {"samples": 0}
    idle = min(s["power_w"] for s in samples[:5])  # the run starts idle (Python, model build)
    active = [s for s in samples if s["power_w"] > 1.5 * idle]
    out = _figures(samples)
    out["idle_power_w"] = idle
    out["active"] = _figures(active) if active else {"samples": 0}
    return out


def _figures(samples: list[dict]) -> dict:
    n = len(samples)
    return {"samples": n, "sm_mhz_mean": sum(s["sm_mhz"] for s in samples) / n,
            "sm_mhz_min": min(s["sm_mhz"] for s in samples),
            "power_w_mean": sum(s["power_w"] for s in samples) / n,
            "power_w_max": max(s["power_w"] for s in samples),
            "temp_c_max": max(s["temp_c"] for s in samples),
            "capped_fraction": sum(1 for s in samples if s["reasons"] & CAPS) / n}


def sample_during(cmd: list[str], gpu: int = 0, period_ms: int = 100) -> tuple[int, dict]:
    """Run `cmd`, sampling GPU `gpu`; returns (cmd's exit code, {"samples": [...], "summary": {...}})."""
    smi = procs.popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                       f"--id={gpu}", f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    lines: list[str] = []
    stamps: list[float] = []

    def read() -> None:
        for line in smi.stdout:
            lines.append(line)
            stamps.append(time.perf_counter())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = procs.call(cmd)
    finally:
        smi.terminate()
        procs.wait(smi, timeout=10)
        reader.join(timeout=10)
    samples = parse(lines, t0, stamps)
    return code, {"command": cmd, "gpu": gpu, "period_ms": period_ms, "samples": samples,
                  "summary": summarize(samples)}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("telemetry: error: give the command after --, e.g. telemetry --out s.json -- prism-megatron "
              "emulate ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="telemetry", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--period-ms", type=int, default=100)
    args = parser.parse_args(argv[:split])
    from prism_megatron.util import atomic_write_text

    code, data = sample_during(argv[split + 1:], args.gpu, args.period_ms)
    atomic_write_text(args.out, json.dumps(data, indent=1))
    s = data["summary"]
    if s.get("samples"):
        print(f"telemetry: {s['samples']} samples: SM {s['sm_mhz_mean']:.0f} MHz mean ({s['sm_mhz_min']:.0f} "
              f"min), {s['power_w_mean']:.0f} W mean ({s['power_w_max']:.0f} max), {s['temp_c_max']:.0f} C "
              f"max, capped {s['capped_fraction'] * 100:.0f}% of the time", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
