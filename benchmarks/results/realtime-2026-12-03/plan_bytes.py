"""How far the sandbox's GPU peak allocated bytes were above the real rank's of 2026-11-30, against
the caching allocator's bytes of the holds' two plan buffers (trace/cuda_hold.py DeviceHolds: an int64
table of (operations + 1) rows x (2 + 2 x paths) and an int64 vector of 2 x operations + 10 slots;
each rounded up to 512 B as the allocator counts it), per run of calls 3-4 (their kept plans).

    python benchmarks/results/realtime-2026-12-03/plan_bytes.py
"""

import json
import math
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REAL = json.loads((HERE.parent / "fidelity-h200x2-2026-11-30-paced.json").read_text())
REAL_PEAK = {row["config"]: int(row["real_peak_bytes"]) for row in (REAL["rows"] if isinstance(REAL, dict) else REAL)}


def counted(nbytes: int) -> int:
    return 512 * math.ceil(nbytes / 512)


def plan_bytes(plan: dict, rank: str) -> int:
    rows = plan["holds"][rank]
    n = len(rows)
    paths = max([len(r[1]) for r in rows if r is not None] + [1])
    return counted((n + 1) * (2 + 2 * paths) * 8) + counted((2 * n + 10) * 8)


for tgz in sorted(HERE.glob("call[34]/kept*.tgz")):
    with tarfile.open(tgz) as tar:
        files = {m.name: m for m in tar.getmembers() if m.isfile()}
        for name in sorted(files):
            if not name.endswith("/emulation.json"):
                continue
            emu = json.load(tar.extractfile(files[name]))
            config = name.split("/")[0].removeprefix("keep-")
            base = name.rsplit("/", 1)[0]
            for row in emu["sandbox"]:
                rank = str(row["virtual_rank"])
                pace = json.load(tar.extractfile(files[f"{base}/pace_plan.json"]))
                held = plan_bytes(pace, rank)
                above = row["peak_allocated_bytes"] - REAL_PEAK[config]
                print(f"{base}: paced run's peak {row['peak_allocated_bytes']:,} B, {above:+,} B against the "
                      f"real rank's of 2026-11-30; the pace plan's buffers {held:,} B")
