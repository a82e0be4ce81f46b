"""Cold-cache cost of the backend pieces this session replaced, old against new, on this machine:
each call follows a matmul and a dict build (as a collective follows a rank's kernels).

    python benchmarks/results/overhead-2026-12-01/cold_pieces.py
"""
import time, torch, sys, contextlib
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from torch.utils._python_dispatch import _pop_mode, _push_mode
from prism_megatron.comm.ops import done as new_done
from prism_megatron.comm.slots import RowPieces
a = torch.randn(384, 384)
t = torch.ones(2048)
def thrash():
    (a @ a).sum(); d = {i: str(i) for i in range(3000)}
def cold(name, fn, n=400):
    res = []
    for rep in range(5):
        tot = 0
        for _ in range(n):
            thrash(); t0 = time.perf_counter(); fn(); tot += time.perf_counter() - t0
        res.append(tot / n)
    res.sort()
    print(f"{name:34s} cold median of 5 blocks {res[2]*1e6:6.1f} us (min {res[0]*1e6:.1f})")
def old_done(result=None):
    fut = torch.futures.Future(); fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)
@contextlib.contextmanager
def old_modes():
    modes = [_pop_mode() for _ in range(torch._C._len_torch_dispatch_stack())]
    try: yield
    finally:
        for m in reversed(modes): _push_mode(m)
def old_wrap():
    with torch.no_grad(), old_modes(): pass
dd = torch._C._len_torch_dispatch_stack
def new_wrap():
    grad = torch.is_grad_enabled(); modes = [_pop_mode() for _ in range(dd())] if dd() else ()
    torch._C._set_grad_enabled(False)
    try: pass
    finally:
        torch._C._set_grad_enabled(grad)
        for m in reversed(modes): _push_mode(m)
cold("old done([t]) (Future-wrapping Work)", lambda: old_done([t]))
cold("new done([t]) (DoneWork)", lambda: new_done([t]))
cold("old no_grad + modes context", old_wrap)
cold("new grad flag + inline mode check", new_wrap)
out = torch.empty(64 * 8, 16)
rows = [8] * 64
cold("torch.split into 64 views", lambda: list(torch.split(out, rows)))
cold("RowPieces + one piece", lambda: RowPieces(out, rows)[5])
