"""Plumbing shared by the prism group's operations: how an operation runs, how it completes,
reduce-op options for the inner backend, all-to-all splits, host copies for the p2p mirror."""

from __future__ import annotations

import functools
import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed import ReduceOp

REDUCE_NAMES = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max",
                ReduceOp.MIN: "min", ReduceOp.PRODUCT: "product"}


def operation(method):
    """Run a group operation without autograd and with Python dispatch modes suspended.

    torch's own collectives reach a backend as dispatched c10d ops, whose internals no Python
    dispatch mode sees; calling the inner backend directly from here would let a mode (such as the
    CPU memory tracker) see gloo's internal scratch tensors, which a plain run never shows. The
    ghost fills are in place, so nothing a real rank would allocate is hidden. The returned `Work` is
    announced to the session's log (`CommLog.issued`), which is how the recorder learns that an
    operation's host-side part is over and which work a later `wait()` completes. A coalesced
    operation (a loop over single ones, as torch's `_coalescing_manager` calls it) announces its one
    Work once, for all the operations it ran: waiting for it waits for every one of them.
    """

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        log = self.session.log
        running = log.running
        if getattr(running, "depth", 0):  # inside a coalesced operation: the outer one announces
            return method(self, *args, **kwargs)
        cpu_timed = log.cpu_timed
        start, cpu_start = time.perf_counter(), time.thread_time() if cpu_timed else 0.0
        # torch.no_grad() and a context manager for the modes cost 4x their hot time when the
        # caches are cold, as they are once per operation between a rank's kernels: flags instead
        grad = torch.is_grad_enabled()
        depth = _dispatch_depth()
        modes = [_pop_dispatch(None) for _ in range(depth)] if depth else ()
        running.depth = 1
        torch._C._set_grad_enabled(False)
        try:
            work = method(self, *args, **kwargs)
        finally:
            torch._C._set_grad_enabled(grad)
            for mode in reversed(modes):
                _push_dispatch(mode)
            running.depth = 0
        log.issued(work)
        log.host_s += time.perf_counter() - start
        if cpu_timed:
            log.host_cpu_s += time.thread_time() - cpu_start
        return work

    return run


_dispatch_depth = torch._C._len_torch_dispatch_stack
# what _pop_mode() and _push_mode() do for this stack, minus their Python (pre-dispatch modes, the
# only ones _push_mode treats otherwise, live on a stack of their own)
_pop_dispatch = torch._C._pop_torch_dispatch_stack
_push_dispatch = torch._C._push_on_torch_dispatch_stack


class DoneWork(dist.Work):
    """The `Work` of an operation that is over when the backend returns it (every prism operation
    but p2p between sandboxes). Cheaper than a Future-wrapping Work: 4.5 against 26 us per
    operation on the 2-core VM with cold caches (0.5 against 4.5 us hot), on every collective of
    the job. Its Future is made only when asked for (`get_future`, as torch's coalesced
    collectives return it to async callers)."""

    result_value: object = None

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch API
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self.result_value

    def synchronize(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.result_value)
        return fut


def done(result=None) -> dist.Work:
    work = DoneWork()
    if result is not None:
        work.result_value = result
    return work


_REDUCE_OPS = {int(op.value): op for op in REDUCE_NAMES}
"""By the enum's integer: a dict keyed by the pybind enum hashes it and compares it through pybind's
`__eq__` (twice the host time hot, and it showed in the H200 host's profile)."""


def reduce_op_of(opts) -> ReduceOp:
    given = opts.reduceOp  # a property that builds a new object per read
    op = _REDUCE_OPS.get(int(getattr(given, "op", given).value))
    if op is not None:
        return op
    raise ValueError(f"reduce op {opts.reduceOp} is not supported by the prism backend; "
                     "expected SUM, AVG, MAX, MIN or PRODUCT")


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do `a` and `b` begin at the same memory? A fake tensor has no data pointer (torch warns when
    asked for one): its storage and offset tell instead."""
    if isinstance(a, FakeTensor) or isinstance(b, FakeTensor):
        return (a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size()
                and a.untyped_storage()._cdata == b.untyped_storage()._cdata)
    return a.data_ptr() == b.data_ptr()


def nbytes_of(tensors: Sequence[torch.Tensor]) -> int:
    if len(tensors) == 1:  # nearly every operation: no generator
        return tensors[0].nbytes  # one C getter, against two method calls
    return sum(t.nbytes for t in tensors)


def inner_reduce_opts(cls, op: ReduceOp, **extra):
    opts = cls()
    opts.reduceOp = ReduceOp.SUM if op == ReduceOp.AVG else op  # gloo has no AVG
    for key, value in extra.items():
        setattr(opts, key, value)
    return opts


def row_sizes(tensor: torch.Tensor, sizes, n: int) -> list[int]:
    """Dim-0 rows of each of n all-to-all pieces: the split sizes (a list or a tensor), or equal."""
    if sizes is None:
        sizes = []
    elif hasattr(sizes, "tolist"):  # a tensor or an array: one conversion, not one per element
        sizes = list(map(int, sizes.tolist()))
    else:
        sizes = list(map(int, sizes))  # one C loop: 64 sizes per MoE all-to-all
    if sizes:
        return sizes
    if tensor.shape[0] % n:
        raise ValueError(f"all_to_all: dim 0 ({tensor.shape[0]}) is not divisible by the group "
                         f"size {n}; pass split sizes")
    return [tensor.shape[0] // n] * n


def split_rows(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """`tensor` cut into dim-0 pieces of `sizes` rows (from `row_sizes`)."""
    if not tensor.shape[0]:
        return [tensor] * len(sizes)
    return list(torch.split(tensor, sizes))


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a host tensor `src`, without making the host wait for the device: a copy
    from pageable memory into a GPU tensor first waits for the stream to drain (a synchronize a real
    rank's NCCL call or router does not make), so on GPU `src` is pinned and copied asynchronously
    (torch's pinned-memory cache keeps it until the copy is done)."""
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16)
"""The element types a byte copy may be viewed as, widest first (16, 8, 4, 2 bytes)."""

WIDEN_MIN_BYTES = 32 << 20
"""Below this many destination bytes the copy is launch-bound and the widened views only add their
host time. On an H200 (benchmarks/broadcast_copy.py, scale-2026-12-03), 8 rows: the plain copy took
19-25 us from 64 KiB to 8 MiB against 30-34 us widened; 30.5 against 32.9 us at 16 MiB; 40.0
against 35.1 us at 32 MiB; 55-57 against 30-37 us at 48 MiB."""


def copy_broadcast(dst: torch.Tensor, row: torch.Tensor, widen: Optional[bool] = None) -> None:
    """Every row of the contiguous [k, m] `dst` becomes `row` (m elements, any shape): the ghosts'
    slots of a gather or an all-to-all, each a copy of ours. On a GPU the copy kernel reads a
    broadcast source through its strided path, one element per thread: on an H200, 8 rows of 6 MiB
    of bf16 took 44 us (1.1 TB/s). There both sides are viewed as the widest type that their bytes
    and addresses allow (16 bytes for any real activation): the same bytes in an eighth of the
    elements. On CPU the plain copy is the faster one (benchmarks/broadcast_copy.py); a copy that
    converts dtypes, or a row that is not contiguous, also stays as it was. `widen`: force the
    widened copy (True) or the plain one (False); by default widened on a GPU only, from
    `WIDEN_MIN_BYTES` of destination up."""
    k = dst.shape[0]
    if widen is None:
        widen = dst.is_cuda and dst.nbytes >= WIDEN_MIN_BYTES  # two C getters: no device object
    if (widen and type(dst) is torch.Tensor and type(row) is torch.Tensor
            and dst.dtype == row.dtype and row.dim() and dst.is_contiguous() and row.is_contiguous()):
        size = row.element_size()
        row_bytes = dst.shape[-1] * size  # what dst's view needs; the row (as many elements) the same
        for wide in _WIDE_DTYPES:
            width = wide.itemsize
            if width <= size:
                break
            if not (row_bytes % width or dst.data_ptr() % width or row.data_ptr() % width):
                dst.detach().view(wide).copy_(row.detach().view(-1).view(wide).expand(k, -1))
                return
    dst.copy_(row.reshape(1, -1).expand(k, -1))


def host_bytes(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().copy()
