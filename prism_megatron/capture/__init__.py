"""Slicing capture: run each role of the virtual world as a slice and merge the full-scale graph."""

from prism_megatron.capture.plan import RoleClass, plan_classes
from prism_megatron.capture.run import Capture, CaptureFailed, CaptureResult

__all__ = ["Capture", "CaptureFailed", "CaptureResult", "RoleClass", "plan_classes"]
