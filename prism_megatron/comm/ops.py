"""Plumbing shared by the prism group's operations: how an operation runs, how it completes,
reduce-op options for the inner backend, all-to-all splits, host copies for the p2p mirror."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.utils._python_dispatch import _pop_mode, _push_mode

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
        if log.depth:  # inside a coalesced operation: the outer one announces its Work for all
            return method(self, *args, **kwargs)
        start, cpu_start = time.perf_counter(), time.thread_time()
        log.depth += 1
        try:
            with torch.no_grad(), _suspended_dispatch_modes():
                work = method(self, *args, **kwargs)
        finally:
            log.depth -= 1
        log.issued(work)
        log.host_s += time.perf_counter() - start
        log.host_cpu_s += time.thread_time() - cpu_start
        return work

    return run


@contextlib.contextmanager
def _suspended_dispatch_modes():
    """Pop the Python dispatch modes for the block and push them back after (cheap when none)."""
    modes = [_pop_mode() for _ in range(torch._C._len_torch_dispatch_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            _push_mode(mode)


def done(result=None) -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def reduce_op_of(opts) -> ReduceOp:
    for op in REDUCE_NAMES:
        if opts.reduceOp == op:
            return op
    raise ValueError(f"reduce op {opts.reduceOp} is not supported by the prism backend; "
                     "expected SUM, AVG, MAX, MIN or PRODUCT")


def nbytes_of(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def inner_reduce_opts(cls, op: ReduceOp, **extra):
    opts = cls()
    opts.reduceOp = ReduceOp.SUM if op == ReduceOp.AVG else op  # gloo has no AVG
    for key, value in extra.items():
        setattr(opts, key, value)
    return opts


def split_rows(tensor: torch.Tensor, sizes, n: int) -> list[torch.Tensor]:
    sizes = [int(x) for x in sizes] if sizes is not None else []  # a list or a tensor of sizes
    if not sizes:
        if tensor.shape[0] % n:
            raise ValueError(f"all_to_all: dim 0 ({tensor.shape[0]}) is not divisible by the group "
                             f"size {n}; pass split sizes")
        return list(tensor.chunk(n)) if tensor.shape[0] else [tensor] * n
    return list(torch.split(tensor, list(sizes)))


def host_bytes(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().copy()
