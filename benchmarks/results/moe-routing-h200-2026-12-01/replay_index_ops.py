"""On the GPU machine: replay the shipped table's indexing signatures with valid random indices.

    python benchmarks/results/moe-routing-h200-2026-12-01/replay_index_ops.py OUT.json
"""
import json
import sys
from pathlib import Path

import torch

from prism_megatron.kernels.calibrate import _timer, replay_ops

here = Path(__file__).resolve().parent
torch.backends.cuda.matmul.allow_tf32 = False
rows = replay_ops(torch, _timer(torch), json.loads((here / "index-op-signatures.json").read_text())["ops"], print)
json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "rows": rows}, open(sys.argv[1], "w"))
