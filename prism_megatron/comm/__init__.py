"""The `prism` torch.distributed backend (virtual groups, ghost data policies, the comm event log)
and the collective cost model (`comm.cost`, pure: importing it does not load torch.distributed)."""

import importlib

_LAZY = {"BACKEND_NAME": "backend", "register_prism_backend": "backend",
         "CommEvent": "events", "CommLog": "events", "GhostPolicy": "ghost",
         "PhysicalWorld": "session", "VirtualSession": "session"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"prism_megatron.comm.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'prism_megatron.comm' has no attribute {name!r}")
