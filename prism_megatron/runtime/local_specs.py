"""megatron-core without Transformer Engine or apex (our CPU machines and the GPU image alike).

megatron-core's local (non-TE) layer specs leave three gaps that block configurations we must run;
`activate_local_specs()` closes them, on any device, only where megatron fell back to the local
implementations:

- `WrappedTorchNorm` refuses sequence parallelism: the specs get `SequenceParallelTorchNorm`
  (runtime/norm.py), a torch norm whose weights carry `sequence_parallel` so their gradients are
  summed over tensor-parallel ranks, as apex's FusedLayerNorm does;
- the local `DotProductAttention` refuses context parallelism and is the only core attention: the
  local spec provider returns `LocalCoreAttention` (runtime/sdpa_attention.py), which builds torch's
  fused scaled_dot_product_attention for `--attention-backend flash|fused` and otherwise
  `ContextParallelDotProductAttention` (runtime/cp_attention.py, TE's all-gather CP pattern);
- FP8 (`config.fp8`) is TE-only: the provider's linears become `FP8ColumnParallelLinear` and
  `FP8RowParallelLinear` (runtime/fp8_linear.py), megatron's modules whose GEMMs run through
  torch._scaled_mm when `config.fp8` is set and as before otherwise; and full recomputation under
  FP8 calls `te_checkpoint`, which becomes megatron's own `tensor_parallel.checkpoint`;
- megatron-core 0.16.1's MoE router names `te_general_gemm`, defined only when TE imports: it is
  defined as None so the router uses torch.
"""

from __future__ import annotations

import warnings

from prism_megatron.runtime.patching import PatchSet


def activate_local_specs(patches: PatchSet) -> None:
    """Apply the fallbacks above into `patches` (restored with it); a no-op without megatron-core."""
    # The condition handled here; megatron warns about it once per module at import.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed",
                            category=UserWarning)
    try:
        from megatron.core.models import backends
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.transformer import transformer_block
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from prism_megatron.runtime.fp8_linear import FP8ColumnParallelLinear, FP8RowParallelLinear
    from prism_megatron.runtime.norm import SequenceParallelTorchNorm
    from prism_megatron.runtime.sdpa_attention import LocalCoreAttention

    if not hasattr(moe_utils, "te_general_gemm"):
        patches.patch(moe_utils, "te_general_gemm", None)
    # LocalSpecProvider.core_attention() returns this module-level name.
    if getattr(backends, "DotProductAttention", None) is DotProductAttention:
        patches.patch(backends, "DotProductAttention", LocalCoreAttention)
    for name, local, fp8 in (("ColumnParallelLinear", ColumnParallelLinear, FP8ColumnParallelLinear),
                             ("RowParallelLinear", RowParallelLinear, FP8RowParallelLinear)):
        if getattr(backends, name, None) is local:  # LocalSpecProvider's linears are these names
            patches.patch(backends, name, fp8)
    if getattr(transformer_block, "te_checkpoint", None) is None:
        patches.patch(transformer_block, "te_checkpoint",
                      lambda function, distribute, _rng_tracker, _tp_group, *args:
                      tensor_parallel.checkpoint(function, distribute, *args))
    # the provider's RMSNorm path sets and returns backends.WrappedTorchNorm itself
    for owner, name in ((gpt_layer_specs, "LNImpl"), (backends, "LNImpl"), (backends, "WrappedTorchNorm"),
                        (transformer_block, "LayerNormImpl")):
        if getattr(getattr(owner, name, None), "__name__", "") == "WrappedTorchNorm":
            patches.patch(owner, name, SequenceParallelTorchNorm)
