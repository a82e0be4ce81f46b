"""Ops of our own that a job's modules call and the kernel-cost model prices by name.

`prism::fused_rms_norm`: torch's fused RMSNorm (`aten._fused_rms_norm`) as one op on every device. A GPU
runs it as one kernel; on a CPU torch composes it from elementwise ops, so the recorder and the cost
model would see those instead. runtime/norm.py calls it; `calibrate --ops` replays it on the GPU.
"""

from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("prism::fused_rms_norm", mutates_args=())
def fused_rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused RMSNorm over the last dimension: (output, fp32 reciprocal RMS [..., 1])."""
    y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    return y, rstd.float()


@fused_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
