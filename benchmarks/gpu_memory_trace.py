"""Run examples/pretrain_gpt.py on a GPU with the CUDA caching allocator's history recorded.

    python benchmarks/gpu_memory_trace.py --out DIR -- <pretrain_gpt.py arguments>

Writes OUT.npz: the allocator's trace from `torch.cuda.memory._snapshot()` (every alloc,
free_requested, free_completed, segment_alloc and segment_free event of device 0 as integer arrays
`action`, `addr`, `size`; codes in `ACTIONS`) and `figures` (JSON: max_memory_allocated/reserved and the
memory_stats peaks), the
ground truth `runtime/allocator_model.py` is checked against (tests/test_allocator_model.py) and
fake-execution memory is compared with (benchmarks/fake_fidelity.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))


ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output file (.npz)")
    parser.add_argument("--max-entries", type=int, default=2_000_000)
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    import pretrain_gpt
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=args.max_entries)
    code = pretrain_gpt.main(rest)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    figures = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
               "max_memory_reserved": torch.cuda.max_memory_reserved(),
               "stats": {k: v for k, v in stats.items() if k.endswith((".peak", ".current"))
                         and k.startswith(("allocated_bytes.all", "reserved_bytes.all", "requested"))},
               "exit_code": code, "argv": rest}
    import numpy as np

    trace = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    kept = [e for e in trace if e.get("action") in ACTIONS]
    tmp = f"{args.out}.tmp{os.getpid()}.npz"
    np.savez_compressed(tmp, action=np.asarray([ACTIONS.index(e["action"]) for e in kept], dtype="i1"),
                        addr=np.asarray([e["addr"] for e in kept], dtype="i8"),
                        size=np.asarray([e["size"] for e in kept], dtype="i8"),
                        figures=np.asarray(json.dumps(figures)))
    os.replace(tmp, args.out)
    print(json.dumps({k: v for k, v in figures.items() if k != "stats"}))
    return code


if __name__ == "__main__":
    sys.exit(main())
