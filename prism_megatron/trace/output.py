"""Turning an installation's recording into a one-role graph file (a slice of the capture).

Memory: on CPU the exact tracker gives the run's peak and its breakdown at the peak. On GPU the CUDA
caching allocator gives peak allocated and reserved bytes; the breakdown is then by size: parameters,
gradients (megatron's grad buffers or `.grad`) and optimizer state (its state tensors and fp32 master
copies) as they are at the end, and the rest of the peak as activations (and temporaries).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

from prism_megatron.graph.io import save_graph
from prism_megatron.graph.model import ExecutionGraph, StringTable
from prism_megatron.runtime.memory import _torch_optimizers
from prism_megatron.trace.iterations import durations_path, write_durations
from prism_megatron.util import per_rank_path


def _storage_bytes(tensors: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def cuda_breakdown(models: list, optimizers: list, peak_bytes: int) -> dict[str, int]:
    """params / grads / optimizer_state by size, and the rest of the peak as activations."""
    seen: set[int] = set()
    params = [p for m in models for p in torch.nn.Module.parameters(m)]
    out = {"params": _storage_bytes(params, seen),
           "buffers": _storage_bytes((b for m in models for b in torch.nn.Module.buffers(m)), seen)}
    grads = [getattr(p, "main_grad", None) for p in params] + [p.grad for p in params]
    out["grads"] = _storage_bytes(grads, seen)
    state: list[Any] = []
    for opt in optimizers:
        for inner in _torch_optimizers(opt):
            state += [t for s in inner.state.values() for t in s.values()]
            state += [p for group in inner.param_groups for p in group["params"]]
    out["optimizer_state"] = _storage_bytes(state, seen)
    out["activations"] = max(0, peak_bytes - sum(out.values()))
    out["temporary"] = 0
    return out


def memory_figures(inst: Any) -> dict[str, Any]:
    """Keyword arguments of RoleGraphBuilder.build for this rank's memory."""
    if inst.fake is not None:  # the CUDA caching allocator's figures, modelled; categories: exact bytes
        allocator = inst.tracker.allocator
        return {"peak_bytes": allocator.peak_allocated, "peak_reserved_bytes": allocator.peak_reserved,
                "peak_by_category": inst.tracker.snapshot()["peak_by_category"],
                "memory_source": "allocator-model"}
    if inst.tracker is not None:
        snap = inst.tracker.snapshot()
        return {"peak_bytes": snap["peak_allocated_bytes"], "peak_by_category": snap["peak_by_category"],
                "peak_reserved_bytes": snap["peak_allocated_bytes"], "memory_source": "tracker"}
    peak = inst.peak_memory_bytes()  # the allocator's, less prism's own buffers
    return {"peak_bytes": peak, "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "peak_by_category": cuda_breakdown(inst.models, inst.optimizers, peak),
            "memory_source": "cuda-allocator"}


def write_role_graph(inst: Any) -> str:
    """Build the recorded iteration's graph for this rank's role and save it to `trace.path`."""
    from prism_megatron.config.loader import to_yaml

    cfg, session = inst.cfg, inst.session
    if session is None or session.world is None:
        raise RuntimeError("nothing to write: the recorder needs torch.distributed and megatron-core's "
                           "initialize_model_parallel to have run under prism_megatron.install")
    rank = session.virtual_rank
    role = session.world.role(rank)
    path = per_rank_path(cfg.trace.path, rank)
    strings = StringTable()
    selection = cfg.trace.selection
    if selection == "node-median" and cfg.moe.routing_varies:  # iterations differ in their work: pick one
        selection = "median"
    median = inst.recorder.median_iteration() if selection != "last" else None
    pool = inst.recorder.steady_iterations() if selection == "node-median" and median is not None else ()
    if cfg.trace.iteration > 0:
        iteration = cfg.trace.iteration - 1
    elif median is not None:
        iteration = median
    else:  # the last full period: an iteration runs to the next one's start (zero_grad included)
        iteration = -2 if len(inst.recorder.iterations) >= 2 else -1
    if cfg.trace.iteration > 0:
        pool = ()
    graph = inst.recorder.build(role, rank, strings, iteration=iteration, pool=pool, **memory_figures(inst))
    device = f"fake:{cfg.emulation.target_gpu}" if inst.fake is not None else inst.device
    meta = {"config": to_yaml(cfg), "captured_rank": rank, "device": device, "execution": inst.execution,
            "clock": inst.recorder.clock.kind, "granularity": cfg.trace.granularity,
            "iterations_run": len(inst.recorder.iterations), **inst.recorder.built,
            "iteration_origin_s": inst.recorder.origin_s(inst.recorder.built["timed_iteration"] - 1)}
    save_graph(ExecutionGraph(world=session.world, roles={role: graph}, strings=strings.strings,
                              meta=meta), path)
    if cfg.trace.keep_iterations:  # each iteration the durations came from, as it ran
        write_durations(path, *inst.recorder.iteration_durations)
    else:  # none from an earlier run beside this graph
        Path(durations_path(path)).unlink(missing_ok=True)
    return path
