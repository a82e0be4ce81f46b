# The workload the before/after callgrind counts ran (benchmarks/backend_instructions.py is the same
# workload, committed afterwards and not yet run under valgrind):
#   cd /tmp && PYTHONHASHSEED=0 PYTHONWARNINGS=ignore OMP_NUM_THREADS=1 PYTHONPATH=<checkout> CALLS=200 valgrind --tool=callgrind \
#     --collect-atstart=no --toggle-collect=functools_reduce --callgrind-out-file=OUT .venv/bin/python callgrind_ops.py
"""Under callgrind: instructions per synchronous all_reduce in a prism group of WORLD (1 real), with
the recorder in a timed iteration. Only the calls inside functools.reduce are collected
(--collect-atstart=no --toggle-collect=functools_reduce)."""
import functools, os, sys, tempfile
import torch
import torch.distributed as dist
import prism_megatron
from prism_megatron.config import load_config

world = int(os.environ.get("WORLD", "8")); calls = int(os.environ.get("CALLS", "200"))
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", MASTER_PORT=os.environ.get("PORT", "29731"))
trace = os.path.join(tempfile.mkdtemp(), "cost.prism")
inst = prism_megatron.install(load_config([
    "train.device=cpu", f"emulation.virtual_world_size={world}", "emulation.sandbox_ranks=[0]",
    f"train.global_batch_size={2 * world}", f"trace.path={trace}"]))
dist.init_process_group(backend="gloo")
t = torch.ones(1024)
op = lambda a, b: dist.all_reduce(t)  # noqa: E731
rec = inst.recorder
rec.begin_iteration()
rec.begin_iteration()
a = torch.randn(384, 384)
for _ in range(50):
    dist.all_reduce(t)
for _ in range(calls):
    (a @ a).sum(); {i: str(i) for i in range(3000)}
    functools.reduce(op, (0, 0))
inst.recorder.iterations.clear(); inst.recorder = None
dist.destroy_process_group(); inst.uninstall()
print("done", calls)
