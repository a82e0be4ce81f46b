"""The CPU runtime: lets megatron-core's GPT (dense and MoE) train on CPU with gloo.

megatron-core assumes CUDA in a few places; `CpuRuntime.activate()` redirects exactly those:

- `device="cuda"` / `device=0` / `.cuda()` / `.to("cuda")` in megatron code (pipeline schedules, DDP
  buffers, optimizers) become CPU, through one `TorchFunctionMode` that rewrites device arguments and
  drops `pin_memory` (pinning needs CUDA); `tensor.type()` answers the CUDA type string
  ('torch.cuda.FloatTensor'), by which megatron's optimizers sort parameters;
- `torch.cuda.is_available()` answers True and `device_count()` 1 (Megatron-LM's `initialize_megatron`
  asserts the one and builds its parallel groups only when the other is positive), so a script sees
  one device, which every redirection above maps to the CPU; our own code asks `Installation.device`;
- `torch.cuda.get_device_properties/capability/name` describe the target GPU (`DeviceProperties`);
- `torch.cuda.current_device/set_device/synchronize/empty_cache/nvtx`, streams and events (a CPU
  event measures host time with perf_counter, which on CPU is the device's own clock);
- `Work.wait()` yields briefly after completing, so gloo's worker frees a finished operation's
  buffers at the same point in every run and the exact tracker's peak is reproducible;
- `torch.distributed.all_gather` into shards of unequal length (megatron's MoE dispatcher over TP,
  NCCL's all-gather-v) pads, gathers and trims, since gloo needs equal sizes;
- the CUDA RNG used by megatron's RNG tracker maps to the CPU generator, which is what dropout on CPU
  tensors draws from, so `get_cuda_rng_tracker().fork()` keeps its meaning;
- `torch.cuda.memory_allocated/max_memory_allocated/memory_reserved/memory_stats` read the exact
  storage tracker (`runtime.memory.StorageTracker`); reserved equals allocated on CPU;
- Megatron-LM's `megatron.legacy.fused_kernels.load` (which only asks nvcc its version) does nothing;
- the MoE all-to-all dispatcher's split sizes reach torch as numpy arrays, as they do after the
  device-to-host copy on GPU.

Active only when no GPU is used: `activate()` refuses to run if CUDA is available, since redirecting
CUDA calls on a GPU machine would silently move the job to the CPU.

The gaps of megatron-core without Transformer Engine (sequence-parallel norm, context-parallel
attention, `te_general_gemm`) are closed on every device by runtime/local_specs.py.

Known limits: CUDA graphs, Transformer Engine, apex fused kernels, FP8 and `torch.cuda.MemPool` are not
emulated (use megatron's local specs); streams are serial (no compute/communication overlap on CPU);
the device rewrite applies on the thread that activated the runtime (and autograd's backward,
which runs CPU work on the calling thread).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from prism_megatron.runtime.memory import StorageTracker
from prism_megatron.runtime.patching import PatchSet

_CPU = torch.device("cpu")


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, int) and not isinstance(value, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch function and tensor method."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers sort params by the legacy type string ('torch.cuda.FloatTensor').
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


class CpuEvent:
    """torch.cuda.Event on CPU: host perf_counter at record(); elapsed_time in milliseconds."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_: Any) -> None:
        self.enable_timing = enable_timing
        self.time_s: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self.time_s = time.perf_counter()

    def elapsed_time(self, end: "CpuEvent") -> float:
        if self.time_s is None or end.time_s is None:
            raise RuntimeError("CpuEvent.elapsed_time: both events must be recorded first")
        return (end.time_s - self.time_s) * 1e3

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


class CpuStream:
    """torch.cuda.Stream on CPU: work is serial, so every wait is already satisfied."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.priority = priority
        self.device = _CPU

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Optional[CpuEvent] = None) -> CpuEvent:
        event = event or CpuEvent()
        event.record()
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0


_DEFAULT_STREAM = CpuStream()


@dataclass(frozen=True)
class DeviceProperties:
    """What `torch.cuda.get_device_properties` answers on CPU: the GPU the job stands for
    (`emulation.target_gpu`), since scripts pick kernels and checks by its architecture."""

    name: str = "NVIDIA H200"
    major: int = 9
    minor: int = 0
    total_memory: int = int(141e9)
    multi_processor_count: int = 132


@dataclass
class CpuRuntime:
    """Activates the CPU stand-ins for megatron-core's CUDA assumptions (see module docstring)."""

    tracker: StorageTracker = field(default_factory=StorageTracker)
    device: DeviceProperties = field(default_factory=DeviceProperties)
    settle_after_wait_s: float = 0.0005
    """After a communication `wait()`, yield this long so gloo's worker drops the finished work's
    buffers now (see `_settling_wait`); 0 turns it off. The prism backend's works settle the same
    way in its native wait (comm/native.py)."""
    _patches: PatchSet = field(default_factory=PatchSet, repr=False)
    _mode: Optional[_CudaToCpuMode] = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self._mode is not None

    def activate(self) -> "CpuRuntime":
        if self.active:
            return self
        if torch.cuda.is_available():
            raise RuntimeError("the CPU runtime redirects CUDA calls and is for machines without a "
                               "GPU; train.device=cuda (or auto) uses the GPU instead")
        cuda = torch.cuda
        tracker = self.tracker
        table: dict[str, Callable] = {
            # A one-device machine, as far as CUDA-only code asks: Megatron-LM asserts
            # is_available() and sets up model parallelism only when device_count() > 0.
            "is_available": lambda: True,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "device_count": lambda: 1,
            "get_device_properties": lambda device=None: self.device,
            "get_device_capability": lambda device=None: (self.device.major, self.device.minor),
            "get_device_name": lambda device=None: self.device.name,
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: None,
            "Event": CpuEvent,
            "Stream": CpuStream,
            "current_stream": lambda device=None: _DEFAULT_STREAM,
            "default_stream": lambda device=None: _DEFAULT_STREAM,
            "stream": lambda s=None: contextlib.nullcontext(),
            "set_stream": lambda s: None,
            # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, i.e. back into this table.
            "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
            "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
            "get_rng_state": lambda device="cuda": torch.get_rng_state(),
            "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
            "memory_allocated": lambda device=None: tracker.allocated_bytes,
            "max_memory_allocated": lambda device=None: tracker.peak_allocated_bytes,
            "memory_reserved": lambda device=None: tracker.allocated_bytes,
            "max_memory_reserved": lambda device=None: tracker.peak_allocated_bytes,
            "reset_peak_memory_stats": lambda device=None: tracker.reset_peak(),
            "memory_stats": lambda device=None: _memory_stats(tracker),
        }
        for name, value in table.items():
            self._patch(cuda, name, value)
        self._patch(cuda.random, "get_rng_state", table["get_rng_state"])
        self._patch(cuda.random, "set_rng_state", table["set_rng_state"])
        self._patch(cuda.nvtx, "range_push", lambda msg: None)
        self._patch(cuda.nvtx, "range_pop", lambda: None)
        self._patch(torch.distributed, "all_gather", _uneven_all_gather(torch.distributed.all_gather))
        work = torch._C._distributed_c10d.Work
        self._patch(work, "wait", _settling_wait(work.wait, self))
        self._patch_megatron()
        self._mode = _CudaToCpuMode()
        self._mode.__enter__()
        tracker.start()
        return self

    def deactivate(self) -> None:
        if not self.active:
            return
        self.tracker.stop()
        self._mode.__exit__(None, None, None)
        self._mode = None
        self._patches.restore()

    def __enter__(self) -> "CpuRuntime":
        return self.activate()

    def __exit__(self, *exc: Any) -> None:
        self.deactivate()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.patch(owner, name, value)

    def _patch_megatron(self) -> None:
        try:
            from megatron.core.tensor_parallel import random as mrandom
            from megatron.core.transformer.moe import moe_utils
        except ImportError:  # megatron-core absent: plain torch code still runs
            return
        self._patch(mrandom, "_get_cuda_rng_state",
                    lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
        self._patch(mrandom, "_set_cuda_rng_state",
                    lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
        from megatron.core.transformer.moe import token_dispatcher

        try:  # Megatron-LM's training code, where it is importable (prism-megatron launch)
            from megatron.legacy import fused_kernels
        except ImportError:
            fused_kernels = None
        if fused_kernels is not None:
            # core_v0.16.1's loader compiles nothing: it asks nvcc for its version (CUDA_HOME,
            # None under a CPU torch) and makes a build folder.
            self._patch(fused_kernels, "load", lambda args=None: None)

        # On GPU the all-to-all split sizes become numpy arrays on their way to the host, which is
        # what torch's all_to_all_single binding accepts; on CPU they would stay tensors.
        for owner in (moe_utils, token_dispatcher):
            if hasattr(owner, "maybe_move_tensor_to_cpu"):
                self._patch(owner, "maybe_move_tensor_to_cpu", _splits_to_host)


def _settling_wait(original: Callable, runtime: "CpuRuntime") -> Callable:
    """`Work.wait` that lets gloo's worker thread finish releasing the operation's tensors.

    gloo's worker drops its references to a finished operation's buffers just after `wait()`
    returns, and needs the GIL to free them; when that happens relative to the caller's next
    allocation is up to the scheduler, so the exact tracker's peak varied between identical runs
    (by 0.2 KB to 68 KB per rank here). A short sleep hands the GIL over, and the frees land at the
    same point in every run: 3 of 3 plain MoE runs gave identical peaks, against 3 different before.
    """
    def wait(self, *args, **kwargs):
        # Finished before we waited (a prism result, or an async op waited on later): the worker
        # let go of it long ago, and sleeping would only slow every call down.
        if runtime.settle_after_wait_s <= 0 or self.is_completed():
            return original(self, *args, **kwargs)
        result = original(self, *args, **kwargs)
        time.sleep(runtime.settle_after_wait_s)
        return result

    return wait


def _uneven_all_gather(original: Callable) -> Callable:
    """all_gather into tensors of different lengths (NCCL's all-gather-v), which gloo refuses.

    megatron's MoE dispatcher gathers token shards of unequal length over tensor-parallel ranks.
    Here each shard is padded to the longest along dim 0, gathered, and trimmed into place.
    """

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list}
        if len(shapes) <= 1:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded_input = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded_input[: tensor.shape[0]].copy_(tensor)
        gathered = [tensor.new_empty((rows, *tensor.shape[1:])) for _ in tensor_list]
        original(gathered, padded_input, group=group)
        for out, got in zip(tensor_list, gathered):
            out.copy_(got[: out.shape[0]])
        return _completed_work() if async_op else None

    return all_gather


def _completed_work():
    """A Work that is already over (the padded all-gather waited for its parts)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _splits_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _memory_stats(tracker: StorageTracker) -> dict[str, int]:
    allocated, peak = tracker.allocated_bytes, tracker.peak_allocated_bytes
    return {"allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": allocated, "reserved_bytes.all.peak": peak}
