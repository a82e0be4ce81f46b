"""Attaching a Recorder to a running megatron-core job, with no change to the training script.

What is observed, and through which hook:

- modules: forward pre/post hooks on the module-level ops of every model chunk that megatron's
  `DistributedDataParallel` wraps (embedding, each transformer layer and its norms, attention, MLP or
  MoE layer with router and experts, final norm, output layer); their backward through a pre-hook on
  the autograd node that produced the module's output (it runs when the backward reaches the module);
- the loss (`LanguageModule.compute_language_model_loss`), megatron's optimizer `step` with its
  gradient norm and clipping, the inner torch optimizer's step (global optimizer hooks), DDP's
  grad sync and `finalize_model_grads`;
- communication: the prism backend records every collective and p2p, the Work it returned and that
  Work's wait (which operation a stream waits for) in the native trace of the recorder's clock
  (comm/native.py), or, on a Python clock, through its log's listeners;
- cross-stream waits on GPU: `torch.cuda.Event.record`/`wait` and `Stream.wait_event`/`wait_stream`
  (a side stream's work, e.g. overlapped parameter all-gather, joins the compute stream);
- pipeline spans and iterations: hooks/schedules.py calls `span_begin`/`span_end` and
  `begin_iteration`;
- MoE: the tokens-per-expert argument of each experts module, per layer and microbatch;
- `granularity="aten"` adds one label per aten op (a dispatch mode), for finer graphs on request.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prism_megatron.runtime.patching import PatchSet
from prism_megatron.trace.recorder import Recorder

_SKIP = ("IdentityOp", "IdentityFuncOp")


def labelled(recorder: Recorder, label: str, fn: Callable) -> Callable:
    """`fn` wrapped so that its time is a node named `label`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        recorder.enter(label)
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.exit()

    return wrapper


def connect_comm(recorder: Recorder, session: Any) -> None:
    """Record every operation of the session's prism backend: natively where the recorder's clock has
    a native trace (CPU and CUDA clocks), else live through the log's listeners (a Python clock, such
    as fake execution's modelled one)."""
    trace = getattr(recorder.clock, "trace", None)
    if trace is not None:
        from prism_megatron.comm.native import dtype_names

        session.native.attach_trace(trace)
        recorder.attach_native(trace, lambda index: session.groups[index][:2], dtype_names())
        return
    session.log.listeners.append(recorder.comm_event)
    session.log.issue_listeners.append(recorder.comm_issued)
    session.log.wait_listeners.append(recorder.wait_event)


def patch_cuda_sync(patches: PatchSet, recorder: Recorder, clock: Any) -> None:
    """Cross-stream waits on GPU: `Event.record`/`Event.wait`, `Stream.wait_event`/`wait_stream`."""
    cuda = torch.cuda
    event_record, event_wait = cuda.Event.record, cuda.Event.wait
    stream_wait_event, stream_wait_stream = cuda.Stream.wait_event, cuda.Stream.wait_stream

    def current(stream):
        return clock.name_of(stream if stream is not None else cuda.current_stream())

    def record(self, stream=None):
        event_record(self, stream)
        recorder.event_recorded(self, current(stream))

    def wait(self, stream=None):
        recorder.event_waited(self, current(stream))
        return event_wait(self, stream)

    def wait_event(self, event):
        recorder.event_waited(event, clock.name_of(self))
        return stream_wait_event(self, event)

    def wait_stream(self, stream):
        recorder.stream_waited(clock.name_of(self), clock.name_of(stream))
        return stream_wait_stream(self, stream)

    patches.patch(cuda.Event, "record", record)
    patches.patch(cuda.Event, "wait", wait)
    patches.patch(cuda.Stream, "wait_event", wait_event)
    patches.patch(cuda.Stream, "wait_stream", wait_stream)


def _module_path(name: str) -> str:
    while name.startswith("module."):  # DDP / Float16Module wrappers
        name = name[len("module."):]
    return name


class ModuleLabels:
    """The module-level hooks of one model chunk. They are attached while the recorder labels
    (every iteration, or the labelled ones of two-pass recording) and detached in timed iterations,
    where even an idle Python hook is host time a launch-bound GPU run pays; `remove` ends them."""

    def __init__(self, recorder: Recorder, model: torch.nn.Module, chunk: int) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self.recorder = recorder
        self.targets: list[tuple[torch.nn.Module, str]] = []
        self._handles: list[Any] = []
        self._always: list[Any] = []
        prefix = f"c{chunk}/" if chunk else ""
        parents: dict[int, torch.nn.Module] = {}
        for _, module in model.named_modules():
            for child in module.children():
                parents.setdefault(id(child), module)
        megatron = any(isinstance(m, TransformerBlock) for m in model.modules())
        # any other model (a DeepSpeed user's): its direct children, each element of a ModuleList
        # (the layers) and that element's children, as megatron's layers and their parts
        layers = {id(m) for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml}
        for name, module in model.named_modules():
            parent = parents.get(id(module))
            if parent is None or type(module).__name__ in _SKIP or isinstance(module, TransformerBlock):
                continue
            if not megatron:
                wanted = not isinstance(module, torch.nn.ModuleList) and (
                    parent is model or id(module) in layers or id(parent) in layers)
                if wanted:
                    self.targets.append((module, prefix + _module_path(name)))
                continue
            parent_is_model = type(parent).__name__.endswith("Model") and hasattr(parent, "decoder")
            wanted = (isinstance(module, TransformerLayer) or isinstance(parent, (TransformerLayer, MoELayer))
                      or parent_is_model or (isinstance(parent, TransformerBlock)
                                             and not isinstance(module, torch.nn.ModuleList)))
            if wanted:
                self.targets.append((module, prefix + _module_path(name)))
            if isinstance(module, MoELayer):
                self._always.append(module.experts.register_forward_pre_hook(_moe_counter(recorder, module)))
        recorder.mode_listeners.append(self.set_active)
        self.set_active(recorder.labelling)

    def set_active(self, on: bool) -> None:
        if on and not self._handles:
            for module, label in self.targets:
                self._handles += _hook_module(self.recorder, module, label)
        elif not on:
            remove_handles(self._handles)
            self._handles = []

    def remove(self) -> None:
        self.set_active(False)
        remove_handles(self._always)
        self._always = []
        if self.set_active in self.recorder.mode_listeners:
            self.recorder.mode_listeners.remove(self.set_active)


def label_modules(recorder: Recorder, model: torch.nn.Module, chunk: int) -> list[Any]:
    """Hook the module-level ops of one model chunk; returns a handle (`.remove()`) for them."""
    return [ModuleLabels(recorder, model, chunk)]


def _hook_module(recorder: Recorder, module: torch.nn.Module, label: str) -> list[Any]:
    backward = label + ".backward"

    def on_backward(grad_outputs):
        recorder.backward_at(backward)

    def pre(mod, args):
        recorder.enter(label)

    def post(mod, args, output):
        recorder.exit()
        if torch.is_grad_enabled():
            nodes = {t.grad_fn for t in _tensors(output) if t.grad_fn is not None}
            for node in nodes:
                node.register_prehook(on_backward)

    return [module.register_forward_pre_hook(pre),
            module.register_forward_hook(post, always_call=True)]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _moe_counter(recorder: Recorder, moe_layer: torch.nn.Module) -> Callable:
    def count(mod, args):
        tokens = args[1] if len(args) > 1 else None
        if isinstance(tokens, torch.Tensor):
            recorder.moe_tokens(int(getattr(moe_layer, "layer_number", -1) or -1),
                                [int(x) for x in tokens.tolist()])

    return count


def patch_framework(patches: PatchSet, recorder: Recorder) -> None:
    """Labels for the loss, the optimizer and gradient synchronization (megatron-core)."""
    from megatron.core import distributed as mdist
    from megatron.core.distributed import distributed_data_parallel as ddp_mod
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import distrib_optimizer, optimizer

    patches.patch(LanguageModule, "compute_language_model_loss",
                  labelled(recorder, "loss", LanguageModule.compute_language_model_loss))
    for cls in (*[c for c in vars(optimizer).values() if isinstance(c, type)],
                distrib_optimizer.DistributedOptimizer):
        if issubclass(cls, optimizer.MegatronOptimizer) and "step" in vars(cls):
            patches.patch(cls, "step", labelled(recorder, "optimizer.step", vars(cls)["step"]))
    for name, label in (("get_grad_norm_fp32", "optimizer.grad_norm"),
                        ("clip_grad_by_total_norm_fp32", "optimizer.clip_grads")):
        patches.patch(optimizer, name, labelled(recorder, label, getattr(optimizer, name)))
    for name in ("start_grad_sync", "finish_grad_sync", "start_param_sync"):
        cls = ddp_mod.DistributedDataParallel
        patches.patch(cls, name, labelled(recorder, f"ddp.{name}", vars(cls)[name]))
    fmg_mod = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package
    finalize = labelled(recorder, "finalize_model_grads", fmg_mod.finalize_model_grads)  # shadows it
    patches.patch(fmg_mod, "finalize_model_grads", finalize)
    patches.patch(mdist, "finalize_model_grads", finalize)


def optimizer_step_hooks(recorder: Recorder) -> list[Any]:
    """The inner torch optimizer's step (Adam, SGD, ...) as `optimizer.<class>`; returns handles."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    return [register_optimizer_step_pre_hook(
                lambda opt, args, kwargs: recorder.enter(f"optimizer.{type(opt).__name__.lower()}")),
            register_optimizer_step_post_hook(lambda opt, args, kwargs: recorder.exit())]


class AtenLabels(TorchDispatchMode):
    """granularity=aten: every aten op is its own node, named `<module label>/<op>`."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":  # communication is the backend's to record
            return func(*args, **(kwargs or {}))
        self.recorder.enter(f"{self.recorder.label}/aten.{func.overloadpacket.__name__}")
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.recorder.exit()


def remove_handles(handles: Optional[list[Any]]) -> None:
    for handle in handles or ():
        handle.remove()
