"""`install(cfg)`: the one call that turns an unmodified megatron-core script into one virtual rank.

It wraps, and `Installation.uninstall()` restores:

- torch.distributed `init_process_group`, `new_group`, `broadcast_object_list` (hooks/torch_dist.py),
  when `emulation.virtual_world_size` is set;
- megatron-core `initialize_model_parallel` (hooks/megatron.py), which builds the VirtualWorld;
- megatron-core's pipeline `forward_step`/`backward_step`/`get_forward_backward_func`
  (hooks/schedules.py): the memory tracker's phase, the recorder's spans and iterations;
- megatron-core's `DistributedDataParallel.__init__` and `get_megatron_optimizer`, so that the memory
  tracker knows parameters, gradients and optimizer state without a line in the training script,
  and the recorder labels the model's module-level ops;
- with `trace.path` set, the recorder (trace/): framework labels, the backend's trace of every
  operation and of its waits; the role graph is written at `dist.destroy_process_group()` or
  `uninstall()`, whichever comes first. A plain run with a trace path is recorded as a virtual world of its own size (no ghosts: the same
  data and memory, as tests/test_training.py checks);
- megatron-core's local specs without Transformer Engine (runtime/local_specs.py), on any device;
- on CPU, the CPU runtime (runtime/cpu.py);
- DeepSpeed's `initialize` and its engine, when DeepSpeed is importable (hooks/deepspeed.py).

Without a virtual world size, only the runtime pieces and the phase markers are installed: the
script runs as launched, which is the plain baseline the emulation is compared with.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from prism_megatron.comm.backend import register_prism_backend
from prism_megatron.comm.session import VirtualSession
from prism_megatron.config.schema import ConfigError, PrismConfig
from prism_megatron.hooks.deepspeed import install_deepspeed
from prism_megatron.hooks.fake import fake_summary, install_fake, resolve_execution
from prism_megatron.hooks.iterations import IterationCounter
from prism_megatron.hooks.megatron import make_initialize_model_parallel, make_setup_embeddings
from prism_megatron.hooks.megatron_lm import install_megatron_lm
from prism_megatron.hooks.schedules import ScheduleHooks
from prism_megatron.hooks.torch_dist import (
    make_broadcast_object_list,
    make_init_process_group,
    make_new_group,
)
from prism_megatron.kernels.host import ENV as MODULE_HOST_ENV
from prism_megatron.kernels.model import GPU_SPECS
from prism_megatron.runtime.cpu import CpuRuntime, DeviceProperties
from prism_megatron.runtime.local_specs import activate_local_specs
from prism_megatron.runtime.memory import StorageTracker
from prism_megatron.runtime.patching import PatchSet
from prism_megatron.trace.attach import (
    AtenLabels,
    connect_comm,
    label_modules,
    optimizer_step_hooks,
    patch_cuda_sync,
    patch_framework,
)
from prism_megatron.trace.clock import CpuClock, CudaClock
from prism_megatron.trace.recorder import Recorder


def resolve_device(cfg: PrismConfig) -> str:
    """`cuda` or `cpu` for `train.device` (auto: cuda when a GPU is present)."""
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


def _device_properties(target_gpu: str) -> DeviceProperties:
    """The CPU runtime's answer to `get_device_properties`: the target GPU where it is a known type
    (a calibration file's path: the H200 defaults)."""
    spec = GPU_SPECS.get(target_gpu)
    if spec is None:
        return DeviceProperties()
    major, minor = spec.compute_capability
    return DeviceProperties(name=f"NVIDIA {spec.name.upper()}", major=major, minor=minor,
                            total_memory=spec.memory_bytes, multi_processor_count=spec.sm_count)


@dataclass
class Installation:
    """What `install` changed; the session appears once init_process_group has run."""

    cfg: PrismConfig
    device: str
    session: Optional[VirtualSession] = None
    runtime: Optional[CpuRuntime] = None
    recorder: Optional[Recorder] = None
    models: list = field(default_factory=list, repr=False)
    optimizers: list = field(default_factory=list, repr=False)
    trace_written: Optional[str] = None
    """Path of the role graph once written."""
    summary_written: Optional[str] = None
    """Path of the rank's summary once written."""
    schedules: Optional[ScheduleHooks] = None
    iterations: Optional[IterationCounter] = None
    """The script's training iterations as the hooks see them; ends it after emulation.stop_after."""
    routers: list = field(default_factory=list)
    """The ModelledTopk of every MoE router when moe.imbalance routes the tokens."""
    moe_log: Optional[Any] = None
    """The MoeLoadLog when moe.log_path is set."""
    routing: Optional[Any] = None
    """The RoutingState of this process's routers (moe.imbalance), whose provider fills ghosts'
    token counts."""
    execution: str = "real"
    """`real` or `fake` (emulation.execution resolved; see runtime/fake.py)."""
    fake: Optional[Any] = None
    """The FakeExecution (its CostClock and the allocator model) when execution is fake."""
    faults: Optional[Any] = None
    """The ComputeFaults (faults/inject.py) when faults.inject slows this process's compute."""
    ds_routing: Optional[Any] = None
    """DeepSpeed-MoE's steered gates (moe/deepspeed_routing.py), made with the first engine that has
    MoE layers when moe.imbalance routes the tokens."""
    ghost_shard_bytes: int = 0
    """GPU bytes of the ghosts' ZeRO-3 shards of small parameters kept by prism
    (hooks/deepspeed.py `_patch_ghost_shards`), not the rank's."""
    _patches: PatchSet = field(default_factory=PatchSet, repr=False)
    _handles: list = field(default_factory=list, repr=False)
    _exits: list = field(default_factory=list, repr=False)
    _uninstalled: bool = field(default=False, repr=False)

    @property
    def virtual(self) -> bool:
        return self.cfg.emulation.virtual_world_size is not None

    @property
    def tracker(self) -> Optional[StorageTracker]:
        return self.runtime.tracker if self.runtime is not None else None

    def peak_memory_bytes(self) -> int:
        """Peak allocated bytes of this rank: exact tracker on CPU, CUDA allocator on GPU (less the
        emulator's own buffers there, `own_device_bytes`)."""
        if self.fake is not None:
            return self.runtime.tracker.allocator.peak_allocated
        if self.runtime is not None:
            return self.runtime.tracker.peak_allocated_bytes
        return int(torch.cuda.max_memory_allocated()) - self.own_device_bytes()

    def own_device_bytes(self) -> int:
        """The CUDA allocator's bytes that prism itself holds in this process (the realtime and paced
        holds' plan, csrc/holds_cuda.h), allocated at the install and kept to the end: a real rank
        has none of them, so the rank's allocated figures leave them out. Reserved bytes keep them
        (they share the allocator's small segments with the rank's tensors)."""
        clock = self.recorder.clock if self.recorder is not None else None
        return int(getattr(clock, "own_device_bytes", 0)) + self.ghost_shard_bytes

    def write_summary(self, summary: dict, path: Optional[str]) -> bool:
        """Complete a training script's per-rank summary with this rank's peak memory (exact tracker
        on CPU: `peak_tracked_bytes` and the category snapshot; GPU: `peak_allocated_bytes`) and its
        communication counts, and write it atomically to `path` (`{rank}`: the virtual rank) if given.
        Returns whether every recorded loss and grad norm is finite."""
        import math

        from prism_megatron.util import atomic_write_text, per_rank_path

        key = "peak_tracked_bytes" if self.tracker is not None else "peak_allocated_bytes"
        summary[key] = int(self.peak_memory_bytes())
        if self.tracker is not None:
            summary["memory"] = self.tracker.snapshot()
        if self.fake is not None:
            summary["execution"] = fake_summary(self)
        if self.session is not None:
            summary["comm"] = self.session.log.rows()
        # realtime or paced on a device clock: the holds as measured (a modelled clock of fake
        # execution has no measurement of them, and counts none)
        report = getattr(self.recorder.clock, "delay_report", None) if self.recorder is not None else None
        waits = report() if report is not None else None
        if waits and waits["count"]:
            summary["injected_waits"] = waits
        if path:
            self.summary_written = per_rank_path(path, summary["virtual_rank"])
            atomic_write_text(self.summary_written, json.dumps(summary, indent=1))
        values = [x for x in summary.get("losses", []) + summary.get("grad_norms", []) if x is not None]
        return all(math.isfinite(x) for x in values)

    def moe_load_log(self, microbatches: Optional[Any] = None) -> Any:
        """This rank's MoE load log (moe.log_path), made on first use, closed at uninstall;
        `microbatches` per iteration (a count, or a callable giving it): megatron's by default."""
        return _moe_log(self, microbatches)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.patch(owner, name, value)

    def write_trace(self) -> Optional[str]:
        """Write the recorded role graph to `trace.path` (once); returns the path."""
        if self.recorder is None or self.trace_written is not None:
            return self.trace_written
        from prism_megatron.trace.output import write_role_graph

        self.trace_written = write_role_graph(self)
        return self.trace_written

    def uninstall(self, complete: bool = True) -> None:
        """Restore everything; with `complete` (the script ended without an error) write the role
        graph first, if it has not been written yet."""
        if self._uninstalled:  # a launched script's own uninstall, then the launcher's
            return
        self._uninstalled = True
        try:
            if complete:
                self.write_trace()
        finally:
            for exit_ in reversed(self._exits):
                exit_()
            self._exits.clear()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._patches.restore()
            if self.runtime is not None:
                self.runtime.deactivate()


_LAUNCHED: list[Installation] = []  # the one installation `prism-megatron launch` made, if any


def set_launched(inst: Optional[Installation]) -> None:
    """`prism-megatron launch` installed `inst` for the script it runs (None: the script ended)."""
    _LAUNCHED.clear()
    if inst is not None:
        _LAUNCHED.append(inst)


def install(cfg: PrismConfig, *, recorder: Optional[Recorder] = None) -> Installation:
    """Install the hooks for `cfg`; call before `torch.distributed.init_process_group`.

    `recorder`: with `trace.path` set, record into this Recorder instead of a default one (a
    subclass can watch every boundary, e.g. to place profiler markers). Under `prism-megatron
    launch` the hooks are already installed from the launch's arguments: that installation is
    returned (the script's own config reads the same arguments, prism_megatron/launch.py)."""
    if _LAUNCHED:
        return _LAUNCHED[0]
    device = resolve_device(cfg)
    if cfg.trace.path and cfg.emulation.virtual_world_size is None:
        cfg.emulation.virtual_world_size = int(os.environ.get("WORLD_SIZE", "1"))
    inst = Installation(cfg=cfg, device=device)
    if cfg.moe.imbalance != "none":
        from prism_megatron.moe.routing import RoutingState

        inst.routing = RoutingState(cfg.moe.model(), cfg.model.moe_expert_capacity_factor)
    if device == "cpu":
        # DeepSpeed picks its accelerator once, on first use: on a CPU run it is its CPU one (its CUDA
        # one would allocate ZeRO's buckets on a device that is not there)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        inst.runtime = CpuRuntime(device=_device_properties(cfg.emulation.target_gpu)).activate()
    inst.execution = resolve_execution(cfg, device)
    if inst.execution == "fake":
        install_fake(inst)
    elif os.environ.get(MODULE_HOST_ENV):
        _time_modules(inst, os.environ[MODULE_HOST_ENV])
    activate_local_specs(inst._patches)
    if cfg.trace.path:
        _install_recorder(inst, recorder)
    inst.faults = _compute_faults(cfg)
    inst.iterations = IterationCounter(
        cfg.emulation.stop_after,
        backend_host_s=lambda: inst.session.log.host_s if inst.session is not None else None,
        synchronize=torch.cuda.synchronize if device == "cuda" else None)
    inst.schedules = ScheduleHooks(inst.tracker, inst.recorder, inst.faults, inst.iterations)
    inst.schedules.install(inst._patches)
    _install_model_hooks(inst)
    install_deepspeed(inst, lambda: inst.session)
    if not inst.virtual:
        return inst
    register_prism_backend()

    def on_session(session: VirtualSession) -> None:
        inst.session = session
        session.log.cpu_timed = inst.execution == "fake"  # its clock takes the backend's CPU time off
        if inst.runtime is not None:  # gloo's settle after a wait that blocked (runtime/cpu.py)
            session.native.settle_after_wait_s = inst.runtime.settle_after_wait_s
        if inst.routing is not None:
            session.ghost_data.append(inst.routing.provide)
            inst.routing.offer = session.native.offer_row
        if inst.recorder is not None:
            connect_comm(inst.recorder, session)
            if cfg.emulation.clock == "realtime":
                inst.recorder.inject_holds(_holds_of(cfg.emulation.delay_plan, session.virtual_rank))

    def session_of() -> Optional[VirtualSession]:
        return inst.session

    inst.patch(dist, "init_process_group",
               make_init_process_group(dist.init_process_group, cfg.emulation, on_session,
                                       "cpu" if inst.runtime is not None else None))
    inst.patch(dist, "new_group", make_new_group(dist.new_group, session_of))
    inst.patch(dist, "broadcast_object_list",
               make_broadcast_object_list(dist.broadcast_object_list, session_of))
    if inst.recorder is not None:
        destroy = dist.destroy_process_group

        @functools.wraps(destroy)
        def destroy_process_group(*args, **kwargs):
            if not args and not kwargs.get("group"):  # the whole job ends: its graph is complete
                inst.write_trace()
            return destroy(*args, **kwargs)

        inst.patch(dist, "destroy_process_group", destroy_process_group)
    try:
        from megatron.core import parallel_state
    except ImportError:
        return inst
    inst.patch(parallel_state, "initialize_model_parallel", make_initialize_model_parallel(
        parallel_state.initialize_model_parallel, session_of, cfg.emulation.gpus_per_node))
    from megatron.core.models.common.language_module.language_module import LanguageModule

    inst.patch(LanguageModule, "setup_embeddings_and_output_layer", make_setup_embeddings(
        LanguageModule.setup_embeddings_and_output_layer, session_of, lambda: cfg.train.seed))
    install_megatron_lm(inst._patches, session_of)
    return inst


def _time_modules(inst: Installation, path: str) -> None:
    """A real run's exclusive host time per module call, written to `path` at the end (for
    `calibrate --host-modules`, kernels/host.py)."""
    from prism_megatron.kernels import host

    stack = host.ModuleStack(timed=True, hook_s=host.hook_overhead_s(),
                             window_root=int(os.environ.get(host.WINDOW_ENV, "0"))).install()
    inst._handles.append(stack)
    inst._exits.append(lambda: host.write_figures(path, host.real_figures(stack), execution="real",
                                                  device=inst.device, hook_s=stack.hook_s,
                                                  root_s=stack.root_s))


def _install_recorder(inst: Installation, recorder: Optional[Recorder]) -> None:
    two_pass = inst.cfg.trace.timing == "two-pass"
    if recorder is None and inst.fake is not None:
        allocator = inst.tracker.allocator
        recorder = Recorder(inst.fake.clock, lambda: allocator.allocated, two_pass=two_pass)
    elif recorder is None and inst.device == "cuda":
        clock, allocated = CudaClock(), _cuda_allocated_bytes()
        recorder = Recorder(clock, lambda: allocated() - clock.own_device_bytes,
                            memory_at_module_boundaries=False, two_pass=two_pass)
    elif recorder is None:
        tracker = inst.tracker
        recorder = Recorder(CpuClock(), lambda: tracker.allocated_bytes, two_pass=two_pass)
    inst.recorder = recorder
    if inst.device == "cuda" and hasattr(recorder.clock, "name_of"):
        patch_cuda_sync(inst._patches, recorder, recorder.clock)
    inst._handles += optimizer_step_hooks(recorder)
    try:
        patch_framework(inst._patches, recorder)
    except ImportError:
        pass
    if inst.cfg.trace.granularity == "aten":
        mode = AtenLabels(recorder)
        mode.__enter__()
        inst._exits.append(lambda: mode.__exit__(None, None, None))


def _moe_log(inst: Installation, microbatches=None):
    """This rank's MoE load log (moe.log_path), made on the first model chunk, closed at uninstall;
    `microbatches` per iteration: megatron's by default."""
    if inst.moe_log is None:
        from prism_megatron.moe.loadlog import MoeLoadLog, memory_reader

        inst.moe_log = MoeLoadLog(inst.cfg.moe.log_path, dist.get_rank,
                                  microbatches or _microbatches(inst.cfg), memory_reader(inst.tracker))
        inst._exits.append(inst.moe_log.close)
    return inst.moe_log


def _route_by_model(inst: Installation, model: torch.nn.Module) -> None:
    """Every MoE router of `model` routes by the configured imbalance model (moe/routing.py)."""
    from prism_megatron.moe.routing import attach

    inst.routers += attach(model, inst.routing, dist.get_rank, _microbatches(inst.cfg))


def _compute_faults(cfg: PrismConfig):
    """This process's injected compute faults (faults.inject naming its virtual rank), or None."""
    if not cfg.faults.inject:
        return None
    from prism_megatron.faults.inject import ComputeFaults

    return ComputeFaults(cfg.faults.inject, cfg.emulation.gpus_per_node, dist.get_rank, dist.get_world_size)


def _microbatches(cfg: PrismConfig):
    """Microbatches per iteration, read when first needed (megatron's DP size is known by then)."""
    def count() -> int:
        from megatron.core import parallel_state

        t = cfg.train
        return t.global_batch_size // (t.micro_batch_size * parallel_state.get_data_parallel_world_size())

    return count


def _holds_of(path: Optional[str], rank: int) -> list:
    """This rank's holds per communication operation of an iteration, from a delay plan file
    (trace/holdplan.py, written by emulate/holds.py)."""
    from prism_megatron.trace.holdplan import read_plan

    try:
        return read_plan(str(path), rank)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise ConfigError(f"emulation.delay_plan={path}: no holds for virtual rank {rank} ({err}); "
                          "write the plan with `prism-megatron emulate --clock realtime`") from None


def _cuda_allocated_bytes():
    """A reader of the CUDA allocator's current allocated bytes for the recorder, which samples it at
    every boundary: `torch.cuda.memory_allocated` builds, flattens and sorts every allocator statistic
    on each call (~0.1 ms, thousands of times per iteration: measured +60% iteration time on an H200
    run with module-level boundaries), so this reads the one counter from the nested statistics."""
    nested = getattr(torch._C, "_cuda_memoryStats", None)
    if nested is None:
        return torch.cuda.memory_allocated
    current = torch.cuda.current_device  # the process may select its GPU after install()

    def read() -> int:
        return int(nested(current())["allocated_bytes"]["all"]["current"])

    return read


def _install_model_hooks(inst: Installation) -> None:
    """DDP construction and optimizer creation: memory categories and module labels."""
    try:
        from megatron.core import optimizer as moptimizer
        from megatron.core.distributed import distributed_data_parallel as ddp_mod
    except ImportError:
        return
    ddp_cls = ddp_mod.DistributedDataParallel
    ddp_init = ddp_cls.__init__

    @functools.wraps(ddp_init)
    def init(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        chunk = len(inst.models)
        inst.models.append(self)
        if inst.tracker is not None:
            inst.tracker.register_model(self)
        if inst.recorder is not None:
            inst._handles += label_modules(inst.recorder, self, chunk)
        if inst.cfg.moe.imbalance != "none":
            _route_by_model(inst, self)
        if inst.cfg.moe.log_path:
            inst._handles += _moe_log(inst).attach(self)

    inst.patch(ddp_cls, "__init__", init)
    make_optimizer = moptimizer.get_megatron_optimizer

    @functools.wraps(make_optimizer)
    def get_megatron_optimizer(*args, **kwargs):
        optimizer = make_optimizer(*args, **kwargs)
        inst.optimizers.append(optimizer)
        if inst.tracker is not None:
            inst.tracker.register_optimizer(optimizer)
        if inst.faults is not None:
            inst.faults.stretch_step(optimizer)
        return optimizer

    inst.patch(moptimizer, "get_megatron_optimizer", get_megatron_optimizer)
