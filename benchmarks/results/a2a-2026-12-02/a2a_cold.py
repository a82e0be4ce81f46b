"""Host time of one all-to-all in a prism group of 64 (one real member, 63 ghosts, mirror), cold
caches: each call follows a matmul and a dict build, as a collective follows a rank's kernels. No
recorder. Median (and lower quartile) of 10 blocks of 200 calls, microseconds per call.

  a2a_even     all_to_all_single, no splits (2 rows per slot)
  a2a_splits   the same with explicit equal splits (a list of 64, as megatron's dispatcher passes)
  a2a_uneven   output splits of 0-4 rows per slot (a routed MoE's), our own slot 2 rows
  allreduce    a synchronous all-reduce of the same tensor, for scale

    python a2a_cold.py CHECKOUT PORT     (CHECKOUT: the repository whose prism_megatron is timed)
"""

import os
import random
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import prism_megatron  # noqa: E402
from prism_megatron.config import load_config  # noqa: E402

WORLD = 64
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
inst = prism_megatron.install(load_config(["train.device=cpu", f"emulation.virtual_world_size={WORLD}",
                                           "emulation.sandbox_ranks=[0]", f"train.global_batch_size={2 * WORLD}"]))
dist.init_process_group(backend="gloo")
x = torch.randn(128, 64)
out = torch.empty_like(x)
splits = [2] * WORLD
random.seed(1)
out_splits = [random.randint(0, 4) for _ in range(WORLD)]
out_splits[0] = 2  # what we send ourselves
out_uneven = torch.empty(sum(out_splits), 64)
a = torch.randn(384, 384)


def thrash():
    (a @ a).sum()
    return {i: str(i) for i in range(3000)}


ops = {"a2a_even": lambda: dist.all_to_all_single(out, x),
       "a2a_splits": lambda: dist.all_to_all_single(out, x, splits, splits),
       "a2a_uneven": lambda: dist.all_to_all_single(out_uneven, x, out_splits, splits),
       "allreduce": lambda: dist.all_reduce(x)}
for name, fn in ops.items():
    for _ in range(200):
        fn()
    per = []
    for _ in range(10):
        total = 0.0
        for _ in range(200):
            thrash()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        per.append(total / 200 * 1e6)
    print(f"{name:12s} cold {statistics.median(per):7.1f} us  (lq {sorted(per)[2]:.1f})", flush=True)
dist.destroy_process_group()
