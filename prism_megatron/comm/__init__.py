"""The `prism` torch.distributed backend: virtual groups, ghost data policies, the comm event log."""

from prism_megatron.comm.backend import BACKEND_NAME, PrismGroup, register_prism_backend
from prism_megatron.comm.events import CommEvent, CommLog
from prism_megatron.comm.ghost import GhostPolicy
from prism_megatron.comm.session import PhysicalWorld, VirtualSession

__all__ = ["BACKEND_NAME", "CommEvent", "CommLog", "GhostPolicy", "PhysicalWorld", "PrismGroup",
           "VirtualSession", "register_prism_backend"]
