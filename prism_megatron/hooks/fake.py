"""Fake execution in an installation: which execution a run takes, and wiring it in.

`resolve_execution` turns `emulation.execution=auto` into `real` when this device can hold the rank's
model state (parameters, gradients, optimizer state: estimated from the model config, 18 bytes per
parameter for mixed precision with Adam, 16 in fp32) in half its memory and, on a CPU, the iteration's
work (6 FLOPs per parameter and token) stays under `CPU_REAL_FLOPS` (a few minutes of a CPU core);
else `fake`: a CPU can hold a GPU-sized rank but not predict its GPU time by running it. `install_fake`
activates `runtime.fake.FakeExecution` with a `CostClock` of the target GPU and feeds the CPU
runtime's storage tracker into an `AllocatorModel`, whose figures `torch.cuda.memory_*` then report:
the program sees the memory a GPU would report.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from prism_megatron.config import ConfigError
from prism_megatron.config.schema import PrismConfig

__all__ = ["CPU_REAL_FLOPS", "check_execution", "fake_summary", "install_fake", "rank_parameters", "resolve_execution"]

CPU_REAL_FLOPS = 2e13
"""Most work per iteration (FLOPs) that `execution=auto` runs for real on a CPU."""


def rank_parameters(cfg: PrismConfig) -> float:
    """Parameters held by the largest rank (a first or last pipeline stage), from the model config."""
    m, p = cfg.model, cfg.parallel
    h = m.hidden_size
    ffn = m.ffn_hidden_size or 4 * h
    groups = m.num_query_groups or m.num_attention_heads
    kv = 2 * h * groups // m.num_attention_heads
    attention = h * (h + kv) + h * h
    mlp = (3 if m.swiglu else 2) * h * ffn
    if m.num_experts:
        mlp = mlp * m.num_experts / max(1, p.ep) + h * m.num_experts
    per_layer = attention / p.tp + mlp / p.tp + 4 * h
    layers = m.num_layers / p.pp
    embedding = m.vocab_size * h / p.tp
    return per_layer * layers + embedding


def _device_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_execution(cfg: PrismConfig) -> None:
    """What `emulation.execution=fake` refuses from the config alone, checked before any work (`train`
    calls it before it imports megatron): another framework, an unknown target GPU. The device's
    checks follow in `resolve_execution`, the calibration file's content in `install_fake`."""
    from prism_megatron.kernels.model import check_target_gpu

    if cfg.emulation.execution != "fake":
        return
    if cfg.train.framework != "megatron":
        raise ConfigError(f"emulation.execution=fake runs megatron-core only, not train.framework="
                          f"{cfg.train.framework}; use emulation.execution=real for it")
    try:
        check_target_gpu(cfg.emulation.target_gpu)
    except ValueError as err:
        raise ConfigError(f"emulation.target_gpu: {err}") from None


def resolve_execution(cfg: PrismConfig, device: str) -> str:
    execution = cfg.emulation.execution
    if execution == "fake" and device != "cpu":
        raise ConfigError("emulation.execution=fake runs on the CPU runtime; set train.device=cpu (the GPU "
                          "it predicts is emulation.target_gpu)")
    check_execution(cfg)
    if execution != "auto":
        return execution
    if cfg.train.framework != "megatron":
        return "real"
    if cfg.emulation.virtual_world_size is None or device != "cpu":
        return "real"
    per_param = 16 if cfg.model.params_dtype == "fp32" else 18
    params = rank_parameters(cfg)
    if params * per_param > _device_bytes(device) // 2:
        return "fake"
    t, world = cfg.train, cfg.emulation.virtual_world_size
    dp = max(1, world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp))
    tokens = t.global_batch_size // dp * cfg.model.seq_length
    return "real" if 6 * params * tokens <= CPU_REAL_FLOPS else "fake"


def install_fake(inst: Any) -> None:
    from prism_megatron.kernels.model import KernelCostModel
    from prism_megatron.runtime.allocator_model import AllocatorModel
    from prism_megatron.runtime.fake import CostClock, FakeExecution

    if inst.runtime is None:
        raise ConfigError("emulation.execution=fake needs the CPU runtime; set train.device=cpu")
    try:
        model = KernelCostModel.for_gpu(inst.cfg.emulation.target_gpu)
    except ValueError as err:
        raise ConfigError(f"emulation.target_gpu: {err}") from None
    model.attention_backend = "cudnn" if inst.cfg.model.attention_backend == "fused" else "flash"
    allocator = AllocatorModel()
    inst.runtime.tracker.allocator = allocator
    cuda = torch.cuda
    for name, value in {
        "memory_allocated": lambda device=None: allocator.allocated,
        "max_memory_allocated": lambda device=None: allocator.peak_allocated,
        "memory_reserved": lambda device=None: allocator.reserved,
        "max_memory_reserved": lambda device=None: allocator.peak_reserved,
    }.items():
        inst.patch(cuda, name, value)
    if inst.cfg.model.num_experts:
        _route_fake_moe(inst)
    _optimizers_as_on_the_gpu(inst)
    keep_ops = bool(os.environ.get("PRISM_FAKE_OPS"))
    clock = CostClock(model, keep_ops=keep_ops, allocator=allocator)
    inst.fake = FakeExecution(clock=clock).activate()
    _module_host(inst, clock)
    inst._exits.append(lambda: _finish(inst))


def _module_host(inst: Any, clock: Any) -> None:
    """The module stack that tells the clock which module class's host figure applies (the kernel
    model's module table), and that counts each class's ops for `calibrate --host-modules` when
    PRISM_MODULE_HOST names a file."""
    from prism_megatron.kernels import host

    table, path = clock.model.host_modules, os.environ.get(host.ENV)
    if not table and not path:
        return

    def on_change(key: Optional[str], entered: bool) -> None:
        per_op_s, per_call_s = table.get(key if key is not None else host.OUTSIDE, (0.0, 0.0))
        clock.enter_module(key, per_op_s, per_call_s if entered else 0.0)

    def on_window() -> None:  # counting starts with the first measured iteration's first forward
        clock.by_module = {}

    on_change(None, False)
    stack = host.ModuleStack(on_change, window_root=int(os.environ.get(host.WINDOW_ENV, "0")),
                             on_window=on_window if path else None).install()
    inst._handles.append(stack)
    if path:
        def write() -> None:
            rows = {key if key is not None else host.OUTSIDE:
                    {"calls": stack.calls.get(key, 0), "kernels": k, "views": v}
                    for key, (k, v) in (clock.by_module or {}).items()}
            host.write_figures(path, rows, execution="fake", launch_s=clock.model.host_launch_s)

        inst._exits.append(write)


def _optimizers_as_on_the_gpu(inst: Any) -> None:
    """torch's optimizers pick their implementation as they would for the target GPU's tensors.

    `torch.optim` runs the multi-tensor (`foreach`) implementation by default only for plain tensors
    on a CUDA-like device; a fake tensor is a subclass, so Adam ran its per-parameter loop here. The
    two differ in memory, not only in time: the loop frees each parameter's temporaries at once,
    the multi-tensor step holds one per parameter of the group until its end (an H200 trace of a TP2
    rank: 32 of 32-128 MiB live together), which sets the caching allocator's reserved peak."""
    import importlib
    import pkgutil

    import torch.optim as optim
    from torch.optim import optimizer as base

    from prism_megatron.runtime.fake import is_fake

    original = base._default_to_fused_or_foreach

    def default_to_fused_or_foreach(params, differentiable, use_fused=False):
        present = [p for p in params if p is not None]
        if not present or differentiable or not all(is_fake(p) for p in present):
            return original(params, differentiable, use_fused)
        fused = bool(use_fused) and all(torch.is_floating_point(p) for p in present)
        return fused, not fused

    modules = [importlib.import_module(f"torch.optim.{m.name}") for m in pkgutil.iter_modules(optim.__path__)
               if not m.name.startswith("_")]
    for module in modules:  # each optimizer module holds its own reference to the function
        if getattr(module, "_default_to_fused_or_foreach", None) is original:
            inst.patch(module, "_default_to_fused_or_foreach", default_to_fused_or_foreach)


def _route_fake_moe(inst: Any) -> None:
    """MoE under fake execution: which tokens go where is data, so it comes from the routing model.

    The router's top-k comes from `moe.imbalance` (moe/routing.py, as with real tensors); its routing
    map is then made a real bool tensor from those indices, so the dispatcher's token counts, split
    sizes and permutation indices are real and every expert computes on the modelled number of tokens
    (hidden states and probabilities stay fake)."""
    if inst.cfg.moe.imbalance == "none":
        raise ConfigError("fake execution of an MoE model needs a routing model (which tokens go where is "
                          "data); set moe.imbalance, e.g. moe.imbalance=uniform or zipf(1.2)")
    if inst.cfg.model.moe_expert_capacity_factor is not None:
        raise ConfigError("fake execution does not support model.moe_expert_capacity_factor yet (token "
                          "dropping reads the router's probabilities); run it with emulation.execution=real")
    from megatron.core.transformer.moe import router

    from prism_megatron.moe.routing import ModelledTopk
    from prism_megatron.runtime.fake import is_fake

    original = router.topk_routing_with_score_function

    def routing(logits, topk, *args, **kwargs):
        probs, routing_map = original(logits, topk, *args, **kwargs)
        replay = kwargs.get("router_replay")
        if is_fake(routing_map) and isinstance(replay, ModelledTopk) and replay.last_indices is not None:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                real = torch.zeros(routing_map.shape, dtype=torch.bool)
                real.scatter_(1, replay.last_indices, True)
            routing_map = real
        return probs, routing_map

    inst.patch(router, "topk_routing_with_score_function", routing)


def _finish(inst: Any) -> None:
    path = os.environ.get("PRISM_FAKE_OPS")
    clock = inst.fake.clock
    if path and clock.ops is not None:
        import json

        from prism_megatron.util import atomic_write_text

        ops = sorted(clock.ops.values(), key=lambda e: -e["s"] * e["calls"])
        atomic_write_text(path, json.dumps({"ops": [e["sig"] for e in ops],
                                            "calls": [e["calls"] for e in ops]}))
    inst.fake.deactivate()


def fake_summary(inst: Any) -> dict:
    clock, allocator = inst.fake.clock, inst.runtime.tracker.allocator
    return {"mode": "fake", "target_gpu": inst.cfg.emulation.target_gpu, "kernel_model": clock.model.source,
            "host_model": "launch per op + module table" if clock.model.host_modules else "launch per op",
            "peak_allocated_bytes": allocator.peak_allocated, "peak_reserved_bytes": allocator.peak_reserved,
            "device_s": clock.device_s,
            "ops_by_source": {k: {"ops": v[0], "device_s": v[1]} for k, v in clock.by_source.items()}}
