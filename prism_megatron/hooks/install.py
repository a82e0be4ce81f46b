"""`install(cfg)`: the one call that turns an unmodified megatron-core script into one virtual rank.

It wraps, and `Installation.uninstall()` restores:

- torch.distributed `init_process_group`, `new_group`, `broadcast_object_list` (hooks/torch_dist.py),
  when `emulation.virtual_world_size` is set;
- megatron-core `initialize_model_parallel` (hooks/megatron.py), which builds the VirtualWorld;
- megatron-core's pipeline `forward_step`/`backward_step`, only to tell the memory tracker which phase
  allocates (activations vs temporaries);
- megatron-core's local specs without Transformer Engine (runtime/local_specs.py), on any device;
- on CPU, the CPU runtime (runtime/cpu.py).

Without a virtual world size, only the runtime pieces and the phase markers are installed: the
script runs as launched, which is the plain baseline the emulation is compared with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from prism_megatron.comm.backend import register_prism_backend
from prism_megatron.comm.session import VirtualSession
from prism_megatron.config.schema import PrismConfig
from prism_megatron.hooks.megatron import make_initialize_model_parallel
from prism_megatron.hooks.torch_dist import (
    make_broadcast_object_list,
    make_init_process_group,
    make_new_group,
)
from prism_megatron.runtime.cpu import CpuRuntime
from prism_megatron.runtime.local_specs import activate_local_specs
from prism_megatron.runtime.memory import StorageTracker
from prism_megatron.runtime.patching import PatchSet


def resolve_device(cfg: PrismConfig) -> str:
    """`cuda` or `cpu` for `train.device` (auto: cuda when a GPU is present)."""
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


@dataclass
class Installation:
    """What `install` changed; the session appears once init_process_group has run."""

    cfg: PrismConfig
    device: str
    session: Optional[VirtualSession] = None
    runtime: Optional[CpuRuntime] = None
    _patches: PatchSet = field(default_factory=PatchSet, repr=False)

    @property
    def virtual(self) -> bool:
        return self.cfg.emulation.virtual_world_size is not None

    @property
    def tracker(self) -> Optional[StorageTracker]:
        return self.runtime.tracker if self.runtime is not None else None

    def peak_memory_bytes(self) -> int:
        """Peak allocated bytes of this rank: exact tracker on CPU, CUDA allocator on GPU."""
        if self.runtime is not None:
            return self.runtime.tracker.peak_allocated_bytes
        return int(torch.cuda.max_memory_allocated())

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.patch(owner, name, value)

    def uninstall(self) -> None:
        self._patches.restore()
        if self.runtime is not None:
            self.runtime.deactivate()


def install(cfg: PrismConfig) -> Installation:
    """Install the hooks for `cfg`; call before `torch.distributed.init_process_group`."""
    device = resolve_device(cfg)
    inst = Installation(cfg=cfg, device=device)
    if device == "cpu":
        inst.runtime = CpuRuntime().activate()
    activate_local_specs(inst._patches)
    _install_phase_markers(inst)
    if not inst.virtual:
        return inst
    register_prism_backend()

    def on_session(session: VirtualSession) -> None:
        inst.session = session

    def session_of() -> Optional[VirtualSession]:
        return inst.session

    inst.patch(dist, "init_process_group",
               make_init_process_group(dist.init_process_group, cfg.emulation, on_session))
    inst.patch(dist, "new_group", make_new_group(dist.new_group, session_of))
    inst.patch(dist, "broadcast_object_list",
               make_broadcast_object_list(dist.broadcast_object_list, session_of))
    try:
        from megatron.core import parallel_state
    except ImportError:
        return inst
    inst.patch(parallel_state, "initialize_model_parallel", make_initialize_model_parallel(
        parallel_state.initialize_model_parallel, session_of, cfg.emulation.gpus_per_node))
    return inst


def _install_phase_markers(inst: Installation) -> None:
    if inst.runtime is None:
        return
    try:
        from megatron.core.pipeline_parallel import schedules
    except ImportError:
        return
    tracker = inst.runtime.tracker
    for name, phase in (("forward_step", "forward"), ("backward_step", "backward")):
        original = getattr(schedules, name)

        @functools.wraps(original)
        def wrapper(*args, __original=original, __phase=phase, **kwargs):
            previous = tracker.phase
            tracker.set_phase(__phase)
            try:
                return __original(*args, **kwargs)
            finally:
                tracker.set_phase(previous)

        inst.patch(schedules, name, wrapper)
