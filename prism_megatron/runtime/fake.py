"""Fake execution: the real training program runs on tensors that have shapes and dtypes but no data.

`FakeExecution` enters torch's `FakeTensorMode`, so a rank of a 175B-parameter model costs no memory
and no compute: every aten op still runs through the dispatcher (the recorder, the cost clock and the
allocator model see each one with its shapes), but only its output metadata is computed. On this CPU
runtime megatron-core's device is already mapped to the CPU, so the fake tensors are fake CPU tensors.

What cannot be faked is answered instead of failing:

- `.item()` / `float(t)` / `.tolist()` of a fake tensor (aten `_local_scalar_dense`) returns a value
  from `ScalarModel`: no inf/nan found (False), gradient norms and losses 1.0, integer counts from a
  registered provider (MoE tokens per expert come from the routing model) or 1.
- Object collectives (`all_gather_object`, `broadcast_object_list`, ...) carry pickled Python objects,
  so they run with real tensors (fake mode suspended around them).
- The autograd engine sums two gradients of one tensor in place on a GPU, but out of place for tensor
  subclasses; under fake execution that sum is the first gradient itself (no new allocation).
- Where CUDA's kernels give an output another dtype than the CPU meta kernels (a bf16 layer norm's
  mean and rstd are fp32 on CUDA), the output is made as CUDA makes it.
- megatron-core's fallback gradient-norm kernel builds a tensor from a list of norms with
  `torch.tensor(list)`, which reads data; it is replaced by the same sum over `torch.stack`.

Time: `CostClock` is the recorder's clock under fake execution. `_FakeMode` hands it every aten op
after it ran (fake) and advances a modelled host and device stream: the host pays the GPU's per-op launch
time, the device starts a kernel when both it and the launch are ready and runs it for the
kernel-cost model's duration (`kernels/model.py`); `.item()` and `synchronize` join them. The
program's Python between ops is added from the GPU host's module table where the model has one
(`kernels/host.py`: per op of the module class whose forward issued it). Nothing of the host time is
measured on this CPU: a prediction depends on the config and the calibrations only, not on the CPU it
runs on or its load (two runs of one config give the same figures). A mark is
the device time at which an event recorded there would complete. Every op's signature can be kept
(`ops`) to be measured on a real GPU (`prism-megatron calibrate --kernels --ops FILE`).

Limits: host work of the program that the module table does not hold (a custom data loader, a
Python loop between iterations of the user's own script) is not charged; calibrate the table on the GPU
machine with that job (`calibrate --host-modules`) to include it. Only one process (all peers ghosts): real peers would need real bytes. Ops whose output shape
depends on data (`nonzero`, boolean masks) take the sizes the provider gives or fail with a one-line
error naming the op.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from prism_megatron.kernels.model import KernelCostModel
from prism_megatron.kernels.signature import OpCall
from prism_megatron.runtime.patching import PatchSet
from prism_megatron.runtime.holds import DelayAccount, HostHolds

__all__ = ["CostClock", "FakeExecution", "ScalarModel", "is_fake"]

_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                       "scatter_object_list", "send_object_list", "recv_object_list")
_ITEM = torch.ops.aten._local_scalar_dense.default
_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_ADD = torch.ops.aten.add.Tensor
_MASKED_SELECT = torch.ops.aten.masked_select.default
_FUNCTION_PY = os.path.join(os.path.dirname(torch.__file__), "autograd", "function.py")
_REDUCED = (torch.bfloat16, torch.float16)


@dataclass
class ScalarModel:
    """Values of data-dependent scalars under fake execution (see module docstring)."""

    float_value: float = 1.0
    """What a floating-point `.item()` returns (norms, losses, scales): finite and neutral."""
    int_value: int = 1
    """What an integer `.item()` returns when no provider claims it."""
    providers: list[Callable[[torch.Tensor], Optional[list]]] = field(default_factory=list)
    """Called with the fake tensor whose values are asked for; the first to return a flat list of
    values (one per element) answers, e.g. MoE routing's tokens per expert."""

    def values(self, tensor: torch.Tensor) -> Optional[list]:
        for provider in self.providers:
            answer = provider(tensor)
            if answer is not None:
                if len(answer) != tensor.numel():
                    raise RuntimeError(f"fake execution: a scalar provider gave {len(answer)} values for a "
                                       f"tensor of {tensor.numel()} elements")
                return answer
        return None

    def scalar(self, tensor: torch.Tensor) -> Any:
        if tensor.dtype == torch.bool:
            return False  # found_inf / has_nan: the healthy answer
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            return self.float_value
        return self.int_value


def _engine_accumulation(args: tuple) -> bool:
    """Is this `add(a, b)` of two alike fake tensors the autograd engine accumulating a gradient? It
    runs during a backward (a node is current, grad mode off) with no Python backward of an
    `autograd.Function` on the stack (adds inside one are that function's own)."""
    if len(args) != 2 or torch.is_grad_enabled() or torch._C._current_autograd_node() is None:
        return False
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and is_fake(a) and is_fake(b)
            and a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous() and a._base is None):
        return False
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == _FUNCTION_PY:
            return False
        frame = frame.f_back
    return True


def _all_real(func: Any, args: tuple, kwargs: dict) -> bool:
    """True when the call has tensor arguments and none of them is fake, or is a factory of integer or
    bool tensors (counts, indices, masks: their values decide shapes, so they are kept real)."""
    seen = False
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                if is_fake(item):
                    return False
                seen = True
    if seen:
        return True
    dtype = kwargs.get("dtype")
    if dtype is None:  # arange of integers and randint default to int64
        name = func.__name__
        if name.startswith("arange") and all(isinstance(a, int) for a in args):
            return True
        return name.startswith("randint")
    return isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex)


def _collective(func: Any, args: tuple, kwargs: dict) -> Any:
    """A c10d op: the prism backend's, run as it is (no kernel of the job: the cost of a collective
    is the backend's and the replay's, not this clock's). FakeTensorMode would
    answer it from a meta kernel, without the backend: its device's kernel is called instead, which
    hands the (fake) tensors to the backend, whose own ops on them stay fake."""
    if _all_real(func, args, kwargs):
        with unset_fake_temporarily():
            return func(*args, **kwargs)
    leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    key = torch._C.DispatchKey.CUDA if leaves and leaves[0].device.type == "cuda" else torch._C.DispatchKey.CPU
    return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)


class _FakeMode(TorchDispatchMode):
    """The one dispatch mode of fake execution above FakeTensorMode (one layer: every layer costs
    Python per op): answers `_local_scalar_dense` of fake tensors from the `ScalarModel`, runs ops on
    real tensors for real, applies the CUDA semantics listed in the module docstring, and hands every
    op on fake tensors to the `CostClock`."""

    def __init__(self, model: ScalarModel, clock: Optional["CostClock"]) -> None:
        super().__init__()
        self.model = model
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            return _collective(func, args, kwargs or {})
        return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func, args, kwargs):
        clock = self.clock
        if func is _ITEM and is_fake(args[0]):
            if clock is not None:
                clock.sync()  # the host waits for the device to read a value
            return self._item(args[0])
        if _all_real(func, args, kwargs):  # real in, real out (e.g. comparing RNG states)
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is _ADD and not kwargs and _engine_accumulation(args):
            # the autograd engine summing two gradients of one tensor: on a GPU it adds in place into
            # a buffer nothing else holds; for tensor subclasses (fake) it allocates a new sum
            if clock is not None:
                clock.account(func, args, kwargs, args[0])
            return args[0]
        if func is _MASKED_SELECT and is_fake(args[0]) and not is_fake(args[1]):
            # the mask is real (MoE routing from the routing model): the output's length is known
            with unset_fake_temporarily():
                count = int(torch.broadcast_to(args[1], torch.broadcast_shapes(
                    args[0].shape, args[1].shape)).sum())
            out = args[0].new_empty((count,))
        else:
            out = func(*args, **kwargs)
        if clock is not None:
            clock.account(func, args, kwargs, out)
        if func is _LAYER_NORM and out[1].dtype in _REDUCED:
            # CUDA keeps a reduced-precision layer norm's mean and rstd in fp32 (the CPU meta kernel
            # gives them the input's dtype): what a GPU allocates, and what its backward expects
            out = (out[0], out[1].float(), out[2].float())
        return out

    def _item(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else None
        source = base if base is not None and is_fake(base) else tensor
        values = self.model.values(source)
        if values is not None and source is not tensor:  # .tolist() reads element views one by one
            return values[tensor.storage_offset() - source.storage_offset()]
        if values is not None:
            return values[0]
        return self.model.scalar(tensor)


class CostClock(HostHolds):
    """The recorder's clock under fake execution: modelled host and device time (module docstring)."""

    kind = "model"

    def __init__(self, model: KernelCostModel, keep_ops: bool = False, allocator: Any = None) -> None:
        self.model = model
        self.delays = DelayAccount()  # holds are modelled, not measured: none is counted
        self.allocator = allocator
        """The AllocatorModel that also takes each op's scratch (borrowed and returned inside it)."""
        self.scratch_ops = 0
        self._known: dict = {}
        self.host_s = 0.0
        self.device_s = 0.0
        self.ops: Optional[dict] = {} if keep_ops else None
        self.by_source: dict[str, list] = {}  # source -> [ops, device seconds]
        self.module: Optional[str] = None
        """The module class whose forward runs now (kernels/host.py's ModuleStack), if one is set."""
        self.module_host_s = 0.0
        """Host seconds the current module's Python adds to each of its ops (the module table)."""
        self.by_module: Optional[dict[str, list]] = None
        """When a dict: module key -> [kernel ops, views] (counted for the calibration)."""

    def enter_module(self, key: Optional[str], per_op_s: float = 0.0, per_call_s: float = 0.0) -> None:
        """The innermost running module is now `key` (None: none): its ops carry `per_op_s` of host
        time each, and `per_call_s` is paid now (when it is entered)."""
        self.module = key
        self.module_host_s = per_op_s
        self.host_s += per_call_s

    def mark(self) -> float:
        return max(self.host_s, self.device_s)

    def sync(self, *args: Any, **kwargs: Any) -> None:
        self.host_s = max(self.host_s, self.device_s)

    def now(self) -> float:
        return max(self.host_s, self.device_s)

    def wait_until(self, goal: float) -> None:
        """A hold (runtime/holds.py HostHolds) keeps the device busy until `goal`."""
        self.device_s = max(self.device_s, goal)

    def stream(self) -> str:
        return "compute"

    def seconds(self, marks, origin) -> Any:
        import numpy as np

        return np.asarray(marks, dtype="f8") - float(origin)

    def account(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        key = (func, _fast_key(args), _fast_key(tuple(kwargs.items())) if kwargs else ())
        known = self._known.get(key)
        if known is None:  # the signature, prediction and scratch of a call seen before are reused
            call = OpCall(func, args, kwargs, out)
            if call.kind in ("comm", "free"):
                known = (call.kind, 0.0, "free", (), None)
            else:
                seconds, source = self.model.predict(call)
                known = (call.kind, seconds, source, tuple(self.model.scratch_events(call)),
                         call.sig if self.ops is not None else None)
            self._known[key] = known
        kind, seconds, source, events, sig = known
        if kind == "comm":
            return
        if self.by_module is not None:
            self.by_module.setdefault(self.module, [0, 0])[kind == "free"] += 1
        if kind == "free":
            self.host_s += 0.25 * self.model.host_launch_s + self.module_host_s
            return
        self.host_s += self.model.host_launch_s + self.module_host_s
        self.device_s = max(self.device_s, self.host_s) + seconds
        if self.allocator is not None:
            for event in events:
                if event[0] == "alloc":
                    self.allocator.malloc((self, event[1]), event[2])
                else:
                    self.allocator.free((self, event[1]))
            self.scratch_ops += bool(events)
        tally = self.by_source.setdefault(source, [0, 0.0])
        tally[0] += 1
        tally[1] += seconds
        if self.ops is not None:
            entry = self.ops.get(key)
            if entry is None:
                self.ops[key] = {"sig": sig, "calls": 1, "s": seconds, "source": source}
            else:
                entry["calls"] += 1


def _fast_key(values: tuple) -> tuple:
    """A hashable summary of call arguments: tensors by shape, strides and dtype; the rest as is."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append((value.shape, value.stride(), value.dtype))
        elif isinstance(value, (list, tuple)):
            out.append(_fast_key(tuple(value)))
        else:
            try:
                hash(value)
                out.append(value)
            except TypeError:
                out.append(type(value).__name__)
    return tuple(out)


def _unfaked(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return run


def _apply_in_place(original: Callable) -> Callable:
    """`Module._apply` for fake parameters: `param.data = fn(param)` (as torch does for plain tensors)
    instead of torch's swap of subclass tensors, which fails on tensors something holds a weak
    reference to (megatron's Float16Module converts a model with `.bfloat16()`)."""

    @functools.wraps(original)
    def _apply(self, fn, recurse=True):
        if not any(is_fake(t) for t in (*self._parameters.values(), *self._buffers.values())
                   if t is not None):
            return original(self, fn, recurse)
        if recurse:
            for module in self.children():
                module._apply(fn)
        with torch.no_grad():
            for param in self._parameters.values():
                if param is None:
                    continue
                applied = fn(param)
                if applied is not param:
                    param.data = applied
                if param.grad is not None:
                    grad = fn(param.grad)
                    if grad is not param.grad:
                        param.grad = grad
            for key, buffer in self._buffers.items():
                if buffer is not None:
                    self._buffers[key] = fn(buffer)
        return self

    return _apply


def _stacked_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's local multi-tensor L2 norm, without reading data (`torch.tensor(list)`)."""
    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    if not norms:
        return torch.zeros(1, dtype=torch.float), None
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


@dataclass
class FakeExecution:
    """Context manager: run the program under fake tensors (see module docstring)."""

    scalars: ScalarModel = field(default_factory=ScalarModel)
    clock: Optional[CostClock] = None
    """Advanced by every op when given (the recorder's clock); None: no timing."""
    mode: Optional[FakeTensorMode] = field(default=None, repr=False)
    _fake_mode: Optional[_FakeMode] = field(default=None, repr=False)
    _patches: PatchSet = field(default_factory=PatchSet, repr=False)

    @property
    def active(self) -> bool:
        return self.mode is not None

    def activate(self) -> "FakeExecution":
        if self.active:
            return self
        self._patches.patch(torch.nn.Module, "_apply", _apply_in_place(torch.nn.Module._apply))
        for name in _OBJECT_COLLECTIVES:
            if hasattr(dist, name):
                self._patches.patch(dist, name, _unfaked(getattr(dist, name)))
        try:
            from megatron.core.optimizer import clip_grads
        except ImportError:
            clip_grads = None
        if clip_grads is not None and getattr(clip_grads, "l2_norm_impl", None) is not None:
            self._patches.patch(clip_grads, "l2_norm_impl", _stacked_l2_norm)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.mode.__enter__()
        if self.clock is not None:  # the host waits for the device
            self._patches.patch(torch.cuda, "synchronize", self.clock.sync)
            for owner in (torch.cuda.Stream, torch.cuda.Event):
                self._patches.patch(owner, "synchronize", lambda *a, **k: self.clock.sync())
        self._fake_mode = _FakeMode(self.scalars, self.clock)
        self._fake_mode.__enter__()
        return self

    def deactivate(self) -> None:
        if not self.active:
            return
        self._fake_mode.__exit__(None, None, None)
        self.mode.__exit__(None, None, None)
        self.mode = self._fake_mode = None
        self._patches.restore()

    def __enter__(self) -> "FakeExecution":
        return self.activate()

    def __exit__(self, *exc: Any) -> None:
        self.deactivate()
