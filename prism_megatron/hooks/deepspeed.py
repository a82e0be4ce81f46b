"""DeepSpeed: an unmodified DeepSpeed training script as one rank of a virtual world.

DeepSpeed reaches torch.distributed through `deepspeed.comm`, whose torch backend calls
`torch.distributed.init_process_group` and `new_group`: the hooks of hooks/torch_dist.py already make
those virtual, so ZeRO sees the virtual data-parallel size (1024 ranks: each holds 1/1024 of the
optimizer state, gradients or parameters) and its collectives (ZeRO-3's parameter all-gathers, the
gradient reduce-scatters, the bucketed all-reduces) reach the prism backend, where ghosts take part.
What this module adds, around `deepspeed.initialize` and the engine it returns:

- the VirtualWorld of the job when no megatron `initialize_model_parallel` builds one (ZeRO's data
  parallelism over the whole world; tensor/pipeline/expert sizes from the prism config);
- the engine's `forward` / `backward` / `step` as what megatron's schedule hooks are for megatron:
  the memory tracker's phase (forward allocations are activations), the recorder's spans (one
  forward and one backward per microbatch) and iterations (one per optimizer step over the
  gradient-accumulation boundary), and the `optimizer.step` label;
- memory categories of the engine's model states: parameters (the bit16 flat groups; under ZeRO-3
  each parameter's partition `ds_tensor`), the fp32 master partitions and the optimizer state
  (`optimizer`), and gradients (`grads`) as DeepSpeed allocates them, re-labelled after every step;
- DeepSpeed-MoE layers routed by `moe.imbalance` and logged to `moe.log_path`
  (moe/deepspeed_routing.py), the dropless capacity exchange answered for ghosts from the model;
- DeepSpeed's CPU shared-memory all-reduce is not built under a virtual world: its ranks are not
  processes of one machine (the op would be compiled at startup for nothing).

`model_state_bytes(engine)` reads the same tensors for the per-rank figure DeepSpeed's own
estimators (`estimate_zero2_model_states_mem_needs`, `..._zero3_...`) predict.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable, Optional

import torch

from prism_megatron.runtime.memory import MemCategory


def install_deepspeed(inst: Any, session_of: Callable[[], Any]) -> None:
    """Patch DeepSpeed for installation `inst` (hooks/install.py) now if it is imported, else when the
    script imports it (importing DeepSpeed takes seconds: a megatron job does not pay them)."""
    if "deepspeed" in sys.modules:
        _patch(inst, session_of)
        return
    finder = _OnImport("deepspeed", lambda: _patch(inst, session_of))
    sys.meta_path.insert(0, finder)
    inst._exits.append(finder.remove)


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs `callback` once, right after module `name` has been imported."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        self.remove()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute, callback = spec.loader.exec_module, self.callback

        def exec_module(module):
            execute(module)
            callback()

        spec.loader.exec_module = exec_module
        return spec


def _patch(inst: Any, session_of: Callable[[], Any]) -> None:
    try:
        import deepspeed

        # `from deepspeed.comm import torch` would be the torch package (deepspeed.comm imports it)
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        return
    if inst.virtual:
        inst.patch(ds_torch, "build_shm_op", lambda: None)
        _patch_rank0_checks(inst)
        _patch_param_gather(inst)
        _patch_ghost_shards(inst)
    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        result = original(*args, **kwargs)
        engine = result[0]
        session = session_of()
        if session is not None and session.world is None:
            session.world = _world_of(inst.cfg, session.world_size)
        _EngineHooks(inst, engine).attach()
        if inst.routing is not None or inst.cfg.moe.log_path:
            _deepspeed_moe(inst, engine)
        return result

    inst.patch(deepspeed, "initialize", initialize)


def _deepspeed_moe(inst: Any, engine: Any) -> None:
    """DeepSpeed-MoE layers of an engine's model: routed by the imbalance model (moe.imbalance) and
    logged (moe.log_path); moe/deepspeed_routing.py. A microbatch is a gradient-accumulation step."""
    import torch.distributed as dist

    from prism_megatron.moe import deepspeed_routing as dsr

    gates = []
    microbatches = engine.gradient_accumulation_steps
    if inst.routing is not None:
        if inst.ds_routing is None:
            inst.ds_routing = dsr.DeepSpeedRouting(inst)
        gates = inst.ds_routing.attach(engine.module, dist.get_rank, microbatches)
        inst.routers += gates
    if inst.cfg.moe.log_path:
        inst._handles += dsr.attach_load_log(inst.moe_load_log(microbatches), engine.module, gates)


_CHECK_USERS = ("deepspeed.runtime.zero.utils", "deepspeed.runtime.zero.partition_parameters",
                "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.partitioned_param_coordinator")


def _patch_rank0_checks(inst: Any) -> None:
    """ZeRO-3's consistency checks (`assert_ints_same_as_other_ranks`: the module order it traced in
    the first step, and in safe mode each all-gather's parameters) broadcast rank 0's list and
    compare. A rank sends its list as it is and a non-root's buffer holds placeholders (-1), so a ghost
    rank 0, which by the ghost policy sends what the sandbox holds, would send placeholders and fail
    the check: here every rank fills the buffer with its own list before the same two broadcasts.
    A real rank 0 (a sandbox) still sends its real list, so between sandboxes the check is DeepSpeed's;
    a ghost runs its role's program, which is the same list."""
    import os

    from deepspeed import comm as ds_dist
    from deepspeed.accelerator import get_accelerator

    def assert_ints_same_as_other_ranks(ints):
        device = torch.device(get_accelerator().device_name(os.environ.get("LOCAL_RANK", "0")))
        length = torch.tensor(len(ints), dtype=torch.long, device=device)
        ds_dist.broadcast(length, src=0, async_op=False)
        if int(length.item()) != len(ints):
            raise RuntimeError(f"Detected a disagreement on list length between rank0 and rank"
                               f"{ds_dist.get_rank()}: rank0 {int(length.item())}, here {len(ints)}")
        values = torch.tensor(list(ints), dtype=torch.long, device=device)
        ds_dist.broadcast(values, src=0, async_op=False)
        if values.tolist() != list(ints):
            raise RuntimeError(f"Detected a disagreement on list contents between rank0 and rank"
                               f"{ds_dist.get_rank()}")

    for name in _CHECK_USERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "assert_ints_same_as_other_ranks"):
            inst.patch(module, "assert_ints_same_as_other_ranks", assert_ints_same_as_other_ranks)


def _patch_param_gather(inst: Any) -> None:
    """ZeRO-3 gathers a parameter into a fresh flat buffer whose own slot already holds this rank's
    partition (in place). Under the mirror policy a ghost's slot of an in-place gather keeps what it
    held (right for megatron's persistent parameter buffer, which starts as the full model), but a
    fresh buffer holds nothing yet (uninitialised memory: the loss was NaN). So DeepSpeed's one
    gather function marks its calls (`session.fresh_gathers`), and the backend gives the ghost slots
    copies of this rank's partition inside the operation, where a recorder counts the copy as the
    collective's own local part (the replay replaces it by the modelled transfer), not as compute."""
    try:
        module = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
    except ImportError:
        return
    original = getattr(module, "_dist_allgather_fn", None)
    if original is None:
        return

    @functools.wraps(original)
    def _dist_allgather_fn(input_tensor, output_tensor, group=None):
        session = inst.session
        if session is None:
            return original(input_tensor, output_tensor, group)
        session.fresh_gathers += 1
        try:
            return original(input_tensor, output_tensor, group)
        finally:
            session.fresh_gathers -= 1

    inst.patch(module, "_dist_allgather_fn", _dist_allgather_fn)


SMALL_SHARD = 4096
"""Elements per rank below which a ZeRO-3 shard cannot stand for its whole parameter (module docstring of
`_patch_ghost_shards`)."""


def _patch_ghost_shards(inst: Any) -> None:
    """ZeRO-3 at a large data-parallel size cuts a small parameter into shards of a few elements
    (a LayerNorm weight of 64 at DP 1024: one element per rank, the other ranks holding padding).
    The mirror fill of a fresh gather (`_patch_param_gather`) gives every ghost's slot a copy of this
    rank's shard, so such a parameter comes back as one value repeated: with every weight of a small
    model so, the logits are uniform and the loss is ln(vocabulary) at every iteration.

    So the ghosts' shards of such a parameter, those smaller than `SMALL_SHARD` elements per rank,
    are kept as they were when DeepSpeed first partitioned it (the initial values, where the full
    parameter still exists), and after each gather of it the ghost-owned elements take them back.
    This rank's shard, and those of other sandboxes in the group, stay as gathered. A ghost does not
    train, so its shard as initialised is the last value it is known to have had; the model stays the
    one the script built. Larger shards keep the mirror fill (a shard of 4096 or more values is
    already a sample of its parameter). What is kept is outside the rank's memory figures: untracked
    on CPU, and on GPU left out of the allocated bytes (`Installation.own_device_bytes`). Fake
    execution has no values to keep."""
    try:
        module = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
    except ImportError:
        return
    import math

    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (initial values, ghost mask)
    status = module.ZeroParamStatus
    partition = module.Init._partition_param

    @functools.wraps(partition)
    def _partition_param(self, param, *args, **kwargs):
        session = inst.session
        if (session is not None and inst.fake is None and id(param) not in kept
                and param.ds_status is status.AVAILABLE and getattr(param, "ds_tensor", None) is None):
            n = self._partition_world_size(param)
            if n > 1 and math.ceil(param.ds_numel / n) < SMALL_SHARD:
                members = dist.get_process_group_ranks(self.get_partition_dp_group(param))
                ghost = torch.tensor([session.physical.physical_of(int(m)) is None for m in members])
                with _disable_current_modes():
                    owner = torch.arange(param.ds_numel) // math.ceil(param.ds_numel / n)
                    mask = ghost[owner].to(param.device)
                    initial = param.data.detach().reshape(-1).clone()
                kept[id(param)] = (initial, mask)
                if initial.device.type == "cuda":
                    inst.ghost_shard_bytes += initial.nbytes + mask.nbytes
        return partition(self, param, *args, **kwargs)

    def restore(params) -> None:
        with _disable_current_modes():
            for param in params:
                entry = kept.get(id(param))
                if entry is None or param.ds_status is not status.AVAILABLE:
                    continue
                flat = param.data.view(-1)
                torch.where(entry[1], entry[0].to(flat.dtype), flat, out=flat)

    inst.patch(module.Init, "_partition_param", _partition_param)
    gather = module.Init._all_gather  # `param.all_gather`: persistent parameters after each step

    @functools.wraps(gather)
    def _all_gather(self, param_list, *args, **kwargs):
        out = gather(self, param_list, *args, **kwargs)
        restore(param_list)
        return out

    inst.patch(module.Init, "_all_gather", _all_gather)
    for cls, attr in ((module.AllGatherHandle, "_AllGatherHandle__param"),
                      (module.AllGatherCoalescedHandle, "params")):
        wait = cls.wait

        @functools.wraps(wait)
        def waited(handle, *args, _wait=wait, _attr=attr, **kwargs):
            out = _wait(handle, *args, **kwargs)
            params = getattr(handle, _attr, None)
            restore(params if isinstance(params, list) else [params] if params is not None else [])
            return out

        inst.patch(cls, "wait", waited)


def _world_of(cfg: Any, world_size: int):
    from prism_megatron.world import VirtualWorld

    p = cfg.parallel
    return VirtualWorld(world_size=world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp,
                        order=p.order, gpus_per_node=cfg.emulation.gpus_per_node)


class _EngineHooks:
    """The engine's forward/backward/step wrapped on the instance (see the module docstring)."""

    def __init__(self, inst: Any, engine: Any) -> None:
        self.inst, self.engine = inst, engine
        self.tracker, self.recorder = inst.tracker, inst.recorder
        self.microbatch = 0
        self._forward_of: dict[int, int] = {}  # id(loss) -> microbatch

    def attach(self) -> None:
        engine = self.engine
        self.inst.models.append(engine)
        self.inst.optimizers.append(engine.optimizer)
        names = ["forward", "backward", "step"]
        if hasattr(engine, "train_batch"):  # PipelineEngine: its schedule calls these
            from prism_megatron.hooks.deepspeed_pipe import PipeHooks

            pipe = PipeHooks(self)
            for name in pipe.wrapped:
                setattr(engine, name, getattr(pipe, name)(getattr(engine, name)))
                self.inst._exits.append(functools.partial(_restore, engine, name))
            pipe.install_instructions()
            self.inst._exits.append(functools.partial(_restore, engine, "_INSTRUCTION_MAP"))
            names = []
        for name in names:
            original = getattr(engine, name)
            wrapped = getattr(self, f"_{name}")(original)
            setattr(engine, name, wrapped)
            self.inst._exits.append(functools.partial(_restore, engine, name))
        if self.recorder is not None:
            from prism_megatron.trace.attach import label_modules

            self.inst._handles += label_modules(self.recorder, engine.module, 0)
        inner = getattr(engine.optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):  # the update itself: every model state is alive
            self.inst._handles.append(inner.register_step_pre_hook(self._at_update))
        free = getattr(engine.optimizer, "free_grad_in_param_list", None)
        if free is not None:  # ZeRO-1/2: the fp32 gradient partition exists, the 16-bit one not yet freed
            @functools.wraps(free)
            def free_grad_in_param_list(*args, **kwargs):
                self._at_update(None, args, kwargs)
                return free(*args, **kwargs)

            engine.optimizer.free_grad_in_param_list = free_grad_in_param_list
            self.inst._exits.append(functools.partial(_restore, engine.optimizer, "free_grad_in_param_list"))
        self.classify()

    def _at_update(self, optimizer, args, kwargs) -> None:
        """Model-state bytes while the inner optimizer runs (gradients, master weights and moments
        all alive): the per-category maximum over the run, `model_state_peak_bytes`."""
        self.classify()
        peak = self.engine.__dict__.setdefault("prism_model_state_peak_bytes", {})
        for category, nbytes in model_state_bytes(self.engine).items():
            peak[category] = max(peak.get(category, 0), nbytes)

    def classify(self) -> None:
        """Label the engine's model states in the memory tracker (after init and every step)."""
        if self.tracker is None:
            return
        for term, tensors in model_state_tensors(self.engine).items():
            self.tracker.classify(tensors, _CATEGORY[term])

    def _phase(self, phase: Optional[str]):
        if self.tracker is not None:
            previous = self.tracker.phase
            self.tracker.set_phase(phase)
            return previous
        return None

    def _forward(self, original):
        @functools.wraps(original)
        def forward(*args, **kwargs):
            if self.microbatch == 0 and self.inst.iterations is not None:
                self.inst.iterations.begin()
            if self.microbatch == 0 and self.recorder is not None:
                self.recorder.begin_iteration()
            previous = self._phase("forward")
            if self.recorder is not None:
                self.recorder.span_begin("forward", self.microbatch, 0)
            try:
                out = original(*args, **kwargs)
            finally:
                if self.recorder is not None:
                    self.recorder.span_end()
                self._phase(previous)
            loss = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(loss, torch.Tensor):
                self._forward_of[id(loss)] = self.microbatch
            self.microbatch += 1
            return out

        return forward

    def _backward(self, original):
        @functools.wraps(original)
        def backward(loss, *args, **kwargs):
            microbatch = self._forward_of.pop(id(loss), max(0, self.microbatch - 1))
            previous = self._phase("backward")
            if self.recorder is not None:
                self.recorder.span_begin("backward", microbatch, 0)
            try:
                return original(loss, *args, **kwargs)
            finally:
                if self.recorder is not None:
                    self.recorder.span_end()
                self._phase(previous)

        return backward

    def _step(self, original):
        @functools.wraps(original)
        def step(*args, **kwargs):
            boundary = self.engine.is_gradient_accumulation_boundary()
            if self.recorder is not None and boundary:
                self.recorder.enter("optimizer.step")
            try:
                return original(*args, **kwargs)
            finally:
                if self.recorder is not None and boundary:
                    self.recorder.exit()
                if boundary:
                    self.microbatch = 0
                    self._forward_of.clear()
                    self.classify()

        return step


def _restore(engine: Any, name: str) -> None:
    engine.__dict__.pop(name, None)  # the instance attribute shadowed the class's method


_CATEGORY = {"params_16bit": MemCategory.PARAM, "params_fp32": MemCategory.OPT,
             "optimizer_moments": MemCategory.OPT, "grads_16bit": MemCategory.GRAD,
             "grads_fp32": MemCategory.GRAD}
"""DeepSpeed's terms (its estimators' comments name them) -> the tracker's category."""


def model_state_tensors(engine: Any) -> dict[str, list[torch.Tensor]]:
    """This rank's model states as DeepSpeed holds them, by the terms of DeepSpeed's estimators:
    16-bit parameters (ZeRO-1/2: the full flat groups; ZeRO-3: each parameter's partition), fp32
    master partition, optimizer moments, 16-bit gradients (what is alive of them), fp32 gradient
    partition. Without ZeRO: the module's parameters and gradients, and the optimizer's state."""
    opt = engine.optimizer
    out: dict[str, list[torch.Tensor]] = {k: [] for k in _CATEGORY}
    module_params = list(engine.module.parameters())
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        out["params_16bit"] += [p.ds_tensor for p in module_params
                                if getattr(p, "ds_tensor", None) is not None]
        out["params_fp32"] += list(opt.fp32_partitioned_groups_flat)
        buffer = getattr(opt, "grad_partitions_flat_buffer", None)
        if buffer is not None:
            out["grads_16bit"].append(buffer)
        out["grads_fp32"] += [t.grad for t in opt.fp32_partitioned_groups_flat if t.grad is not None]
    elif hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        out["params_16bit"] += list(getattr(opt, "bit16_groups_flat", []))
        out["params_fp32"] += list(opt.single_partition_of_fp32_groups)
        out["grads_fp32"] += [t.grad for t in opt.single_partition_of_fp32_groups if t.grad is not None]
        out["grads_16bit"] += [p.grad for p in module_params if p.grad is not None]
        for buffers in (getattr(opt, "averaged_gradients", {}) or {}).values():
            out["grads_16bit"] += [g for g in (buffers or []) if isinstance(g, torch.Tensor)]
    else:
        out["params_16bit"] += module_params
        out["grads_16bit"] += [p.grad for p in module_params if p.grad is not None]
    inner = getattr(opt, "optimizer", opt)
    for state in getattr(inner, "state", {}).values():
        out["optimizer_moments"] += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def model_state_bytes(engine: Any) -> dict[str, int]:
    """Bytes of this rank's model states by DeepSpeed's terms (`model_state_tensors`; a storage
    counts once per term, views share it)."""
    out = {}
    for term, tensors in model_state_tensors(engine).items():
        seen: dict[int, int] = {}
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        out[term] = sum(seen.values())
    return out
