"""Exact accounting of live CPU tensor storage: the CPU stand-in for CUDA's memory statistics.

On GPU a sandbox rank reads ``torch.cuda.memory_allocated`` / ``max_memory_allocated``; on CPU
:class:`StorageTracker` counts storages itself. A ``TorchDispatchMode`` sees the outputs of every aten
op of the thread that started it (factories, op outputs, autograd backward, ``.to``, ``out=`` ops),
records each new CPU storage with its exact ``nbytes()`` (views share it and count once) and observes
its release through a weak reference. ``allocated_bytes`` is the live total, ``peak_allocated_bytes``
its maximum, and every byte carries a :class:`MemCategory` (the categories of
``torch.distributed._tools.mem_tracker``).

Labels: a new storage gets the category of the phase (``set_phase("forward")`` -> ACT, else TEMP).
``classify`` re-labels storages; ``register_model`` / ``register_optimizer`` do it for parameters,
buffers, gradients (``.grad``, megatron's ``.main_grad``) and optimizer state, and again after every
gradient accumulation and optimizer step while active. A label says what a storage *is*: one learned
later (optimizer state made by the first step, often where the peak is) also re-labels the storage's
share of ``peak_by_category`` if it was live, unresized, at the peak.

A storage is identified by ``untyped_storage()._cdata`` (its ``StorageImpl`` address): shared by all
views and stable across resizes, unlike ``data_ptr()``. Torch keeps one Python object per live
storage, so a weak reference to it dies exactly when the storage is freed, on whichever thread.

Known limitations
-----------------
- Only storages coming out of aten ops on the thread that called ``start()`` are seen (dispatch
  modes are thread-local); those from other threads, ``torch.from_numpy``, ``torch.UntypedStorage(n)``
  or C++ extensions bypassing the dispatcher are invisible unless adopted (``track_existing``,
  ``classify``). Frees and resizes of tracked storages are seen from any thread.
- Storages that existed before ``start()`` are not counted until adopted. An op whose output aliases
  its input without saying so in its schema (e.g. ``aten::_unsafe_view``) adopts that input's storage
  if it was untracked.
- Scratch memory that a kernel allocates and frees inside one op is never visible, so the peak is
  the maximum over op boundaries (CUDA's allocator would see that scratch space).
- Resizes are seen through aten ops that write a tensor (``resize_``, ``set_``, ``out=``) and through
  ``UntypedStorage.resize_`` (wrapped while a tracker is active, as megatron frees buffers with
  ``storage().resize_(0)``); a resize done in C++ directly on a storage is seen only when that storage
  next comes out of a writing op.
- CUDA (and every non-CPU) tensor is ignored: on GPU use the caching allocator's statistics. Sparse
  tensors and wrapper subclasses without a storage of their own are ignored too.
- A storage is labelled as a whole: one ``classify`` on a view labels the full flat buffer (e.g.
  megatron's contiguous grad buffer, including its padding), which is what the memory really is.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from enum import StrEnum
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from prism_megatron.runtime.storage_resize import unwatch_resizes, watch_resizes

__all__ = ["MemCategory", "StorageTracker"]


class MemCategory(StrEnum):
    """What a storage holds; the values are the keys of ``snapshot()["by_category"]``."""

    PARAM = "params"
    BUFFER = "buffers"
    GRAD = "grads"
    OPT = "optimizer_state"
    ACT = "activations"
    TEMP = "temporary"


_CATEGORIES: tuple[MemCategory, ...] = tuple(MemCategory)
_INDEX = {category: index for index, category in enumerate(_CATEGORIES)}
_ALL_INDICES = frozenset(_INDEX.values())
_PARAM_LIKE = frozenset((_INDEX[MemCategory.PARAM], _INDEX[MemCategory.BUFFER]))
_TEMP, _ACT = _INDEX[MemCategory.TEMP], _INDEX[MemCategory.ACT]
_PHASE_INDEX: dict[str | None, int] = {"forward": _ACT, "backward": _TEMP, "optimizer": _TEMP, None: _TEMP}

# How an op's return relates to its inputs (from the schema's alias annotations).
_FRESH, _VIEW, _WRITTEN = 0, 1, 2
_SKIP = ((), ())  # plan of an op that returns only views: nothing to look at


def _plan_for(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Per-op plan: the kind of each return, and ``out=`` arguments that are written but not returned."""
    schema = func._schema
    kinds = tuple(_FRESH if ret.alias_info is None else _WRITTEN if ret.alias_info.is_write else _VIEW
                  for ret in schema.returns)
    out_names: tuple[str, ...] = ()
    if _WRITTEN not in kinds:
        out_names = tuple(arg.name for arg in schema.arguments
                          if arg.is_out and arg.alias_info is not None and arg.alias_info.is_write)
    if _FRESH not in kinds and _WRITTEN not in kinds and not out_names:
        return _SKIP
    return kinds, out_names


def _category_index(category: MemCategory | str) -> int:
    try:
        return _INDEX[MemCategory(category)]
    except ValueError:
        valid = ", ".join(repr(c.value) for c in _CATEGORIES)
        raise ValueError(f"unknown memory category {category!r}; expected one of {valid}") from None


def _iter_tensors(tensors: torch.Tensor | Iterable[torch.Tensor | None] | None) -> Iterator[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or tensors is None:
        tensors = (tensors,)
    for tensor in tensors:
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected tensors or None, got {type(tensor).__name__}; "
                            "pass an iterable of tensors")
        yield tensor


def _cpu_storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    if not tensor.is_cpu:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


class _StorageRecord(weakref.ref):
    """A weak reference to one tracked storage that also carries its accounting."""

    # key: _cdata; index: position of its MemCategory in _CATEGORIES; seq: the accounting event
    # that last set nbytes (tells whether the storage was live with these bytes at the peak)
    __slots__ = ("key", "nbytes", "index", "seq", "modelled")


class _OutputObserver(TorchDispatchMode):
    """Runs every aten op of its thread and hands storage-producing outputs to the tracker."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self._observe = tracker._observe
        self._plans: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}

    # TorchDispatchMode wraps this method in torch._disable_dynamo (about 0.9 us per op). Kept: without
    # it, torch.compile'd code run under the tracker (megatron's jit_fuser) traces into this method.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        plan = self._plans.get(func)
        if plan is None:
            plan = self._plans[func] = _plan_for(func)
        if plan is not _SKIP:
            self._observe(plan, out, kwargs)
        return out


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer``: itself, ``.optimizer`` or ``.chained_optimizers``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for part in chained for inner in _torch_optimizers(part)]
    if hasattr(optimizer, "optimizer"):
        inner = optimizer.optimizer  # megatron leaves it None on ranks without parameters
        return [] if inner is None else _torch_optimizers(inner)
    raise TypeError(
        f"register_optimizer expects a torch.optim.Optimizer or a wrapper with .optimizer or "
        f".chained_optimizers (as megatron's optimizers have), got {type(optimizer).__name__}"
    )


class StorageTracker:
    """Counts live CPU tensor storage exactly, by :class:`MemCategory`.

    Use ``with StorageTracker() as tracker:`` or ``start()`` / ``stop()`` on the same thread. The
    tracker holds only weak references to storages, modules and optimizers; counters are guarded by a
    lock, and frees reported from other threads (gloo's callbacks) are queued and folded in by the next
    op or query, so a weak-reference callback never waits for a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._freed: deque[_StorageRecord] = deque()
        self._on_free = self._freed.append  # weakref callback: queue only, no lock, no tracker ref
        self._live: dict[int, _StorageRecord] = {}
        self._counts = [0] * len(_CATEGORIES)
        self._allocated_bytes = 0
        self._peak_bytes = 0
        self._peak_counts = [0] * len(_CATEGORIES)
        self._peak_seq = 0
        self._seq = 0
        self._phase: str | None = None
        self._default_index = _PHASE_INDEX[None]
        self._observer = _OutputObserver(self)
        self._active = False
        self._models: list[weakref.ref[torch.nn.Module]] = []
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._hook_handles: list[Any] = []
        self.allocator: Any = None
        """Optional `AllocatorModel` fed every allocation, resize and free of tracked fake storages
        (fake execution: they stand for GPU memory; real CPU tensors then are host memory, as a GPU
        program's CPU tensors are)."""

    def start(self) -> StorageTracker:
        """Begin observing ops of the calling thread; hooks of registered objects are installed."""
        if self._active:
            raise RuntimeError("StorageTracker.start(): already active; call stop() before starting again")
        self._observer.__enter__()
        self._active = True
        watch_resizes(self._on_storage_resized)
        for ref in self._models:
            if (module := ref()) is not None:
                self._hook_model(module)
        for ref in self._optimizers:
            if (optimizer := ref()) is not None:
                self._hook_optimizer(optimizer)
        return self

    def stop(self) -> None:
        """Stop observing; counts stay readable and frees of tracked storages are still seen."""
        if not self._active:
            raise RuntimeError("StorageTracker.stop(): not active; call start() first")
        if _get_current_dispatch_mode() is not self._observer:
            raise RuntimeError(
                "StorageTracker.stop(): another TorchDispatchMode entered after start() is still "
                "active on this thread (or stop() runs on another thread); exit it first"
            )
        self._observer.__exit__(None, None, None)
        self._active = False
        unwatch_resizes(self._on_storage_resized)
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def __enter__(self) -> StorageTracker:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()

    @property
    def phase(self) -> str | None:
        """The current phase: "forward", "backward", "optimizer" or None."""
        return self._phase

    def set_phase(self, phase: str | None) -> None:
        """Set the phase; new storages become ACT in "forward" and TEMP otherwise."""
        if phase not in _PHASE_INDEX:
            raise ValueError(f"unknown phase {phase!r}; expected 'forward', 'backward', 'optimizer' or None")
        self._phase = phase
        self._default_index = _PHASE_INDEX[phase]

    def classify(self, tensors: torch.Tensor | Iterable[torch.Tensor | None] | None,
                 category: MemCategory | str) -> None:
        """Label the storages of ``tensors`` (None entries skipped); untracked ones are adopted."""
        self._label(tensors, _category_index(category), frozenset())

    def track_existing(self, tensors: torch.Tensor | Iterable[torch.Tensor | None] | None,
                       category: MemCategory | str) -> None:
        """Adopt storages created before ``start()`` with ``category``; tracked ones keep their label."""
        self._label(tensors, _category_index(category), _ALL_INDICES)

    def register_model(self, module: torch.nn.Module) -> None:
        """Label parameters, buffers and gradients of ``module`` (after wrapping it, e.g. in DDP).

        While the tracker is active, each new ``.grad`` is labelled GRAD when it is accumulated.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"register_model expects a torch.nn.Module, got {type(module).__name__}")
        params = list(torch.nn.Module.parameters(module))  # unbound: megatron's DDP shadows .buffers
        self.classify(params, MemCategory.PARAM)
        self.classify(torch.nn.Module.buffers(module), MemCategory.BUFFER)
        self.classify(self._grads_of(params), MemCategory.GRAD)
        if any(ref() is module for ref in self._models):
            return
        self._models.append(weakref.ref(module))
        if self._active:
            self._hook_model(module)

    def register_optimizer(self, optimizer: Any) -> None:
        """Label the state of a torch optimizer, or of those inside megatron-style wrappers.

        State tensors become OPT; the optimizer's parameters that are not labelled PARAM/BUFFER are
        its own master copies (megatron's fp32 main params) and become OPT too, so register the model
        first; their gradients become GRAD. While active, this is redone after every ``step()``.
        """
        for inner in _torch_optimizers(optimizer):
            self._classify_optimizer(inner)
            if any(ref() is inner for ref in self._optimizers):
                continue
            self._optimizers.append(weakref.ref(inner))
            if self._active:
                self._hook_optimizer(inner)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of live tracked storage now."""
        with self._lock:
            self._drain_freed()
            return self._allocated_bytes

    @property
    def peak_allocated_bytes(self) -> int:
        """Maximum of ``allocated_bytes`` since construction or the last ``reset_peak()``."""
        with self._lock:
            self._drain_freed()
            return self._peak_bytes

    def snapshot(self) -> dict[str, Any]:
        """Current and peak totals with their breakdown by category (all categories present)."""
        with self._lock:
            self._drain_freed()
            return {
                "allocated_bytes": self._allocated_bytes,
                "peak_allocated_bytes": self._peak_bytes,
                "by_category": dict(zip(_CATEGORIES, self._counts)),
                "peak_by_category": dict(zip(_CATEGORIES, self._peak_counts)),
            }

    def reset_peak(self) -> None:
        """Make the current allocation the peak (like ``torch.cuda.reset_peak_memory_stats``)."""
        with self._lock:
            self._drain_freed()
            self._peak_bytes = self._allocated_bytes
            self._peak_counts = self._counts.copy()
            self._peak_seq = self._seq

    def _observe(self, plan: tuple[tuple[int, ...], tuple[str, ...]], out: Any,
                 kwargs: dict[str, Any] | None) -> None:
        """Account the outputs of one op (called by the dispatch mode: the hot path)."""
        kinds, out_names = plan
        lock = self._lock
        lock.acquire()  # acquire/release: half the cost of a with-statement
        try:
            if self._freed:
                self._drain_freed()
            if len(kinds) == 1:
                if isinstance(out, torch.Tensor):
                    self._account(out, kinds[0])
                else:
                    self._visit(out, kinds[0])
            elif kinds:
                for value, kind in zip(out, kinds):
                    self._visit(value, kind)
            for name in out_names:
                self._visit(kwargs.get(name), _WRITTEN)  # type: ignore[union-attr]
            if self._freed:  # a garbage collection inside the op may have freed something
                self._drain_freed()
            if self._allocated_bytes > self._peak_bytes:
                self._raise_peak()
        finally:
            lock.release()

    def _visit(self, value: Any, kind: int) -> None:
        if isinstance(value, torch.Tensor):
            self._account(value, kind)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    self._account(item, kind)

    def _account(self, tensor: torch.Tensor, kind: int) -> None:
        try:  # the storage's device, not tensor.is_cpu: a fake tensor answers that by a dispatch
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        device = storage.device.type
        if device != "cpu" and (device != "meta" or self.allocator is None):
            return
        key = storage._cdata
        record = self._live.get(key)
        if record is not None and record() is storage:
            nbytes = storage.nbytes()
            if nbytes != record.nbytes:
                self._resize(record, nbytes)
        elif kind == _FRESH:  # written/view outputs with an untracked storage existed before start()
            self._add(storage, key, self._default_index)

    def _add(self, storage: torch.UntypedStorage, key: int, index: int) -> None:
        """Start tracking ``storage``; caller holds the lock and has drained frees."""
        record = _StorageRecord(storage, self._on_free)
        nbytes = storage.nbytes()
        self._seq += 1
        record.key, record.nbytes, record.index, record.seq = key, nbytes, index, self._seq
        record.modelled = False
        self._live[key] = record
        self._counts[index] += nbytes
        self._allocated_bytes += nbytes
        if self.allocator is not None and nbytes and storage.device.type == "meta":
            self.allocator.malloc(id(record), nbytes)
            record.modelled = True

    def _resize(self, record: _StorageRecord, nbytes: int) -> None:
        delta = nbytes - record.nbytes
        if record.modelled:  # a resized storage gets a new block; the old one is freed
            if record.nbytes:
                self.allocator.free(id(record))
            if nbytes:
                self.allocator.malloc(id(record), nbytes)
        self._seq += 1
        record.nbytes, record.seq = nbytes, self._seq
        self._counts[record.index] += delta
        self._allocated_bytes += delta

    def _raise_peak(self) -> None:
        self._peak_bytes = self._allocated_bytes
        self._peak_counts = self._counts.copy()
        self._peak_seq = self._seq

    def _drain_freed(self) -> None:
        """Fold queued frees into the counters; caller holds the lock."""
        freed, live, counts = self._freed, self._live, self._counts
        while freed:
            record = freed.popleft()
            if live.get(record.key) is record:
                del live[record.key]
            counts[record.index] -= record.nbytes
            self._allocated_bytes -= record.nbytes
            if record.modelled and record.nbytes:
                self.allocator.free(id(record))

    def _label(self, tensors: torch.Tensor | Iterable[torch.Tensor | None] | None, index: int,
               keep: frozenset[int]) -> None:
        """Give storages of ``tensors`` the label ``index`` unless their label is in ``keep``."""
        with self._lock:
            self._drain_freed()
            for tensor in _iter_tensors(tensors):
                storage = _cpu_storage(tensor)
                if storage is None:
                    continue
                key = storage._cdata
                record = self._live.get(key)
                if record is None or record() is not storage:
                    self._add(storage, key, index)
                    continue
                if storage.nbytes() != record.nbytes:
                    self._resize(record, storage.nbytes())
                if record.index != index and record.index not in keep:
                    self._relabel(record, index)
            if self._allocated_bytes > self._peak_bytes:
                self._raise_peak()

    def _relabel(self, record: _StorageRecord, index: int) -> None:
        nbytes = record.nbytes
        self._counts[record.index] -= nbytes
        self._counts[index] += nbytes
        if record.seq <= self._peak_seq:  # live with these bytes at the peak: it was this, too
            self._peak_counts[record.index] -= nbytes
            self._peak_counts[index] += nbytes
        record.index = index

    def _on_storage_resized(self, storage: torch.UntypedStorage) -> None:
        with self._lock:
            self._drain_freed()
            record = self._live.get(storage._cdata)
            if record is not None and record() is storage and storage.nbytes() != record.nbytes:
                self._resize(record, storage.nbytes())
                if self._allocated_bytes > self._peak_bytes:
                    self._raise_peak()

    @staticmethod
    def _grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor | None]:
        return [g for p in params for g in (p.grad, getattr(p, "main_grad", None))]

    def _classify_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.classify(state, MemCategory.OPT)
        self._label(params, _INDEX[MemCategory.OPT], _PARAM_LIKE)
        self.classify(self._grads_of(params), MemCategory.GRAD)

    def _hook_model(self, module: torch.nn.Module) -> None:
        for param in torch.nn.Module.parameters(module):
            if param.requires_grad:
                self._hook_handles.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, param: torch.Tensor) -> None:  # post-accumulate-grad hook
        self.classify(param.grad, MemCategory.GRAD)

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._hook_handles.append(optimizer.register_step_post_hook(self._on_step))

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._classify_optimizer(optimizer)
