"""FP8 GEMMs for megatron-core's local spec: the transformer layers' linears through torch._scaled_mm.

Production jobs train Hopper GPUs in FP8 through Transformer Engine, which our images lack (and which
has no CPU path). Megatron's own `config.fp8` (Megatron-LM's `--fp8-format e4m3|hybrid`) does nothing
without TE. Here, with `config.fp8` set, the linears the local spec builds inside the transformer
layers (attention qkv and projection, MLP and experts' fc1/fc2: `FP8ColumnParallelLinear` and
`FP8RowParallelLinear`, put where megatron's local spec provider looks by runtime/local_specs.py)
run their three GEMMs in FP8 as TE's `Linear` does; the embedding and the output layer stay in the
parameter dtype, as with TE.

- Forward: input and weight quantized to e4m3, `out = _scaled_mm(x8, w8^T)` in the parameter dtype.
- Backward: the output gradient quantized to e5m2 (`hybrid`) or e4m3 (`e4m3`); the input gradient
  `g8 x w8` and the weight gradient `g8^T x x8` in FP8 (TE's default `fp8_wgrad`).
- Per-tensor scales, `scale = fp8_max / amax / 2^fp8_margin`: recipe `tensorwise` (TE's current
  scaling) takes the amax of the tensor being quantized; `delayed` the amax history of the last
  `fp8_amax_history_len` quantizations of that tensor (`fp8_amax_compute_algo`: its maximum, or the most
  recent), the current amax entering the history after use.
- Tensor-parallel communication as megatron's `LinearWithGradAccumulationAndAsyncCommunication`, in
  TE's precision: under sequence parallelism each rank quantizes its part of the input and the parts
  are all-gathered in FP8 (half megatron's bytes), in forward and again in backward; the amax, a
  scalar, is all-reduced over the group first, so every part has the one scale the GEMM dequantizes
  with (TE reduces it too; for the delayed recipe once per step). The input gradient's all-reduce (or
  reduce-scatter) starts before the weight gradient and is waited after it.
- The weight is quantized once per version of it (TE's FP8 weight cache over an iteration's
  micro-batches and recomputations): the FP8 weight and its transpose stay allocated until the
  optimizer's update changes the weight's version.
- Saved for backward: the FP8 input (1 byte an element; under sequence parallelism the local part),
  so activation memory is TE's.

Known differences from TE: amax and cast are separate ops (TE fuses them); a delayed history moves
at each quantization, with its amax reduced over the sequence-parallel group then (TE's moves at the
end of the step, all tensors' amaxes reduced in one collective).
Recipes `mxfp8` and `blockwise` (block scales: Blackwell, TE kernels) are refused by the config.
"""

from __future__ import annotations

import types

import torch
from megatron.core.parallel_state import get_global_memory_buffer
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_tensor_model_parallel_group_if_none

FORMATS = {"e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn), "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2)}
"""megatron's fp8 format -> (dtype of inputs and weights, dtype of gradients)."""


class _Scaling:
    """One tensor's per-tensor scale under the configured recipe (module docstring)."""

    def __init__(self, config) -> None:
        self.delayed = config.fp8_recipe == "delayed"
        self.history_len = max(1, int(config.fp8_amax_history_len))
        self.use_max = config.fp8_amax_compute_algo == "max"
        self.margin = float(2 ** config.fp8_margin)
        self.history: torch.Tensor | None = None

    def scale(self, tensor: torch.Tensor, dtype: torch.dtype, group=None) -> torch.Tensor:
        """The float32 scale that maps `tensor` into `dtype`'s range (and updates the history); with
        `group`, a tensor split over it (sequence parallelism): the amax is the group's maximum, so
        every rank quantizes its part with the scale the others dequantize it with."""
        amax = torch.linalg.vector_norm(tensor.detach(), ord=float("inf")).float()  # max |x|, one kernel
        if group is not None and group.size() > 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
        used = amax
        if self.delayed:
            if self.history is None or self.history.device != amax.device:
                self.history = torch.zeros(self.history_len, dtype=torch.float32, device=amax.device)
            used = self.history.amax() if self.use_max else self.history[0]
            self.history = torch.cat([amax.view(1), self.history[:-1]])
        fp8_max = torch.finfo(dtype).max
        return torch.where(used > 0, fp8_max / used.clamp(min=1e-12), torch.ones_like(used)) / self.margin


def _quantize(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fp8_max = torch.finfo(dtype).max
    return (tensor * scale).clamp_(-fp8_max, fp8_max).to(dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """`t` with the same shape laid out column-major, as `_scaled_mm` takes its second operand."""
    return t.t().contiguous().t()


def _gather_fp8(tensor: torch.Tensor, tp_group, async_op: bool = False):
    """All-gather along dim 0 into megatron's shared buffer, as bytes (collectives take no FP8 type)."""
    size = list(tensor.size())
    size[0] *= tp_group.size()
    out = get_global_memory_buffer().get_tensor(size, torch.uint8, "mpu")
    handle = torch.distributed.all_gather_into_tensor(out, tensor.view(torch.uint8), group=tp_group,
                                                      async_op=async_op)
    return out.view(tensor.dtype), handle


def _cached_weight(module, weight: torch.Tensor, dtype: torch.dtype):
    """(FP8 weight, the same column-major for the input gradient, its scale), quantized again only when
    the weight changed (its version counter moves with every in-place update)."""
    key = (id(weight), weight._version)
    cached = getattr(module, "_prism_fp8_weight", None)
    if cached is None or cached[0] != key:
        scale = module._prism_fp8_scaling["weight"].scale(weight, dtype)
        w8 = _quantize(weight.detach(), scale, dtype)
        cached = module._prism_fp8_weight = (key, w8, _column_major(w8), scale)
    return cached[1:]


class _FP8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with FP8 GEMMs and megatron's tensor-parallel communication."""

    @staticmethod
    def forward(ctx, input, weight, bias, module, allreduce_dgrad, sequence_parallel, tp_group):
        forward_dtype, grad_dtype = FORMATS[module.config.fp8]
        local2d = input.reshape(-1, input.shape[-1])
        x_scale = module._prism_fp8_scaling["input"].scale(local2d, forward_dtype,
                                                           tp_group if sequence_parallel else None)
        x8 = _quantize(local2d, x_scale, forward_dtype)  # SP: the local part, gathered in FP8
        total8 = _gather_fp8(x8, tp_group)[0] if sequence_parallel else x8
        w8, w8_columns, w_scale = _cached_weight(module, weight, forward_dtype)
        out = torch._scaled_mm(total8, w8.t(), scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal(),
                               bias=bias, out_dtype=input.dtype)
        ctx.save_for_backward(x8, w8_columns, x_scale, w_scale)
        ctx.module, ctx.use_bias, ctx.grad_dtype = module, bias is not None, grad_dtype
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        ctx.out_dtype, ctx.input_shape = input.dtype, input.shape
        rows = total8.shape[0] // local2d.shape[0]
        return out.view(input.shape[0] * rows, *input.shape[1:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        x8, w8_columns, x_scale, w_scale = ctx.saved_tensors
        handle = None
        if ctx.sequence_parallel:  # the FP8 input gathered again, overlapping the input gradient
            x8, handle = _gather_fp8(x8, ctx.tp_group, async_op=True)
        g2d = grad_output.reshape(-1, grad_output.shape[-1])
        g_scale = ctx.module._prism_fp8_scaling["grad"].scale(g2d, ctx.grad_dtype)
        g8 = _quantize(g2d, g_scale, ctx.grad_dtype)
        grad_input = torch._scaled_mm(g8, w8_columns, scale_a=g_scale.reciprocal(),
                                      scale_b=w_scale.reciprocal(), out_dtype=ctx.out_dtype)
        grad_input = grad_input.view(*grad_output.shape[:-1], grad_input.shape[-1])
        if ctx.sequence_parallel:
            handle.wait()
            sub = torch.empty(ctx.input_shape, dtype=ctx.out_dtype, device=grad_input.device)
            handle = torch.distributed.reduce_scatter_tensor(sub, grad_input, group=ctx.tp_group,
                                                             async_op=True)
        elif ctx.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_weight = torch._scaled_mm(g8.t().contiguous(), _column_major(x8), scale_a=g_scale.reciprocal(),
                                       scale_b=x_scale.reciprocal(), out_dtype=ctx.out_dtype)
        grad_bias = g2d.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        if ctx.sequence_parallel:
            grad_input = sub
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _fp8_forward_impl(module, input, weight, **kwargs):
    """megatron's `_forward_impl` (the keywords its forward passes): the FP8 path where it applies,
    megatron's own for a frozen weight, fused gradient accumulation or deferred weight gradients."""
    if (not weight.requires_grad or kwargs.get("gradient_accumulation_fusion")
            or kwargs.get("grad_output_buffer") is not None):
        return type(module)._forward_impl(module, input, weight, **kwargs)
    tp_group = get_tensor_model_parallel_group_if_none(kwargs.get("tp_group"))
    return _FP8Linear.apply(input, weight, kwargs.get("bias"), module, bool(kwargs.get("allreduce_dgrad")),
                            bool(kwargs.get("sequence_parallel")), tp_group)


def _with_fp8(module, config):
    if config.fp8:
        if config.fp8 not in FORMATS:
            raise ValueError(f"fp8={config.fp8!r}: the local FP8 linear takes e4m3 or hybrid")
        module._prism_fp8_scaling = {name: _Scaling(config) for name in ("input", "weight", "grad")}
        module._forward_impl = types.MethodType(_fp8_forward_impl, module)
    return module


class FP8ColumnParallelLinear:
    """Factory with ColumnParallelLinear's signature: megatron's module, its GEMMs in FP8 when
    `config.fp8` is set (module docstring). The module stays megatron's class, so everything keyed
    by it (the host-cost table, checkpoints) sees the same module."""

    def __new__(cls, *args, config, **kwargs):
        return _with_fp8(ColumnParallelLinear(*args, config=config, **kwargs), config)


class FP8RowParallelLinear:
    """Factory with RowParallelLinear's signature (see FP8ColumnParallelLinear)."""

    def __new__(cls, *args, config, **kwargs):
        return _with_fp8(RowParallelLinear(*args, config=config, **kwargs), config)
