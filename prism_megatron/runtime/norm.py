"""A torch LayerNorm/RMSNorm that megatron-core accepts under sequence parallelism, for CPU runs.

megatron-core's `WrappedTorchNorm` (the fallback without apex/Transformer Engine) refuses
`sequence_parallel`. Under sequence parallelism each tensor-parallel rank normalizes its own slice of
the sequence, so the norm itself is unchanged; what differs is that its weight gradients are partial and
must be summed over the tensor-parallel group. Megatron does that in `finalize_model_grads` for every
parameter carrying `sequence_parallel = True`, which is the attribute apex's FusedLayerNorm sets; this
norm sets the same attribute and is otherwise plain torch.

RMSNorm on a CPU: torch runs one fused kernel on a GPU (`aten._fused_rms_norm` and its backward) but
composes the norm from elementwise ops on a CPU, so a CPU run (and fake execution, which prices the
ops it sees as the GPU's) would see six ops forward and a dozen backward where the GPU runs two.
`CpuFusedRMSNorm` runs the forward as one op, `prism::fused_rms_norm` (torch's fused op, which torch
composes from elementwise ops on a CPU; under fake tensors only its outputs are made), and the backward
as the GPU's `aten._fused_rms_norm_backward` under fake tensors (torch has its meta kernel, no CPU
kernel) or the same formula in torch ops on real CPU tensors: the kernels, outputs and saved tensors a
GPU has.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from prism_megatron.kernels.ops import fused_rms_norm



class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        if len(shape) != 1:
            raise ValueError(f"RMSNorm over {shape}: only the last dimension is normalized here")
        y, rstd = fused_rms_norm(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape = shape
        return y

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        if is_fake(grad):  # the GPU's backward kernel (torch has no CPU kernel of it, only its meta)
            dx, dw = torch.ops.aten._fused_rms_norm_backward(
                grad, x, ctx.shape, rstd, weight, [ctx.needs_input_grad[0], ctx.needs_input_grad[1]])
            return dx, dw, None, None
        normalized = x.float() * rstd
        scaled = grad.float() * (weight.float() if weight is not None else 1.0)
        dims = tuple(range(-len(ctx.shape), 0))
        dx = (rstd * (scaled - normalized * (scaled * normalized).mean(dims, keepdim=True))).to(x.dtype)
        dw = None
        if weight is not None:
            dw = (grad.float() * normalized).sum(tuple(range(x.dim() - len(ctx.shape)))).to(weight.dtype)
        return dx, dw, None, None


class CpuFusedRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm computed by the fused kernel a GPU runs (module docstring)."""

    def forward(self, x):
        if x.device.type == "cuda":
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _FusedRMSNorm.apply(x, self.weight, list(self.normalized_shape), eps)


_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": CpuFusedRMSNorm}


class SequenceParallelTorchNorm:
    """Factory with WrappedTorchNorm's signature; returns a torch norm module."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        kind = config.normalization
        if kind not in _NORMS or config.layernorm_zero_centered_gamma:
            raise ValueError(f"normalization {kind!r} (zero-centered gamma: "
                             f"{config.layernorm_zero_centered_gamma}) is not available on CPU; "
                             "use LayerNorm or RMSNorm without zero-centered gamma")
        norm = _NORMS[kind](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
