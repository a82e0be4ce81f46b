"""The table of benchmarks/results/realtime-2026-12-03/README.md from the calls' JSON:

    python benchmarks/results/realtime-2026-12-03/summarize.py
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    pairs = []
    print("| call | config | rep | virtual ms | sandbox share (paced / realtime) | compute factor | "
          "realtime wall ms | vs virtual | vs node-median replay | realtime, iteration by iteration | "
          "paced, iteration by iteration | debt run up / paid back ms |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---|---|---|")
    for call in sorted(HERE.glob("call*")):
        for path in sorted(call.glob("realtime-*.json")):
            for row in json.loads(path.read_text())["rows"]:
                for rep, s in enumerate(row["sandbox"]):
                    waits = s["realtime_injected_waits"]

                    def own(run: str) -> str:
                        its = s.get(f"{run}_own_iterations")
                        if not its:
                            return "-"
                        errs = [x["err_pct"] for x in its]
                        return (f"{statistics.median(errs):+.2f} % ({min(errs):+.2f} to {max(errs):+.2f}, "
                                f"{len(errs)} it.)")

                    pairs.append((s["realtime_compute_factor"], s["realtime_vs_virtual_pct"],
                                  s["realtime_host_bound"]["share"] - s["host_bound"]["share"]))
                    print(f"| {call.name[4:]} | {row['config']} | {rep} | {s['iteration_time_s'] * 1e3:.1f} | "
                          f"{s['host_bound']['share'] * 100:.1f} / {s['realtime_host_bound']['share'] * 100:.1f} % | "
                          f"{s['realtime_compute_factor']:.3f} | {s['realtime_iteration_s'] * 1e3:.1f} | "
                          f"{s['realtime_vs_virtual_pct']:+.2f} % | {s['realtime_vs_replay_pct']:+.2f} % | "
                          f"{own('realtime')} | {own('paced')} | "
                          f"{waits['overhead_accrued_s'] * 1e3:.1f} / {waits['overhead_absorbed_s'] * 1e3:.1f} |")

    factor, miss, share = zip(*pairs)
    print(f"\ncorrelation over {len(pairs)} runs of the realtime wall against the virtual figure with the "
          f"realtime run's compute over the paced run's: {statistics.correlation(factor, miss):.3f}; with its "
          f"host-bound share less the paced run's: {statistics.correlation(share, miss):.3f}")


if __name__ == "__main__":
    main()
