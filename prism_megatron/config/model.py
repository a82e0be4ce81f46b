"""The model section: the GPT's shape and the layer choices megatron-core builds it with.

Each key is a Megatron-LM flag's (the flag in the field's docstring); `examples/pretrain_gpt.py`
passes them to megatron's `TransformerConfig`, `GPTModel` and layer spec, and a Megatron-LM script's
flags are read into them (config/flags.py), so a capture, a sweep and the cost model see the layers
the job builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from prism_megatron.config.base import ConfigError, require_choice, require_fraction
from prism_megatron.config.base import require_positive as _require_positive

DTYPES = ("fp32", "bf16", "fp16")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ATTENTION_BACKENDS = ("local", "unfused", "flash", "fused", "auto")
"""Megatron-LM's `--attention-backend` values. Without Transformer Engine: `local`/`unfused` is
megatron's DotProductAttention (the score matrix built, softmax unfused); `flash` is torch's
scaled_dot_product_attention restricted to its FlashAttention-2 kernel, `fused` to its cuDNN kernel
(what TE's fused attention runs), `auto` torch's own choice (runtime/sdpa_attention.py)."""
SCORE_FUNCTIONS = ("softmax", "sigmoid")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise")
"""megatron's `--fp8-recipe` values with per-tensor scales (runtime/fp8_linear.py); mxfp8, blockwise and
custom need Transformer Engine's kernels."""
FP8_AMAX_ALGOS = ("most_recent", "max")


@dataclass(kw_only=True)
class ModelConfig:
    """GPT model shape (megatron-core GPTModel with its local, non-Transformer-Engine spec)."""

    num_layers: int = 4
    """Transformer layers (--num-layers)."""

    hidden_size: int = 64
    """Hidden size (--hidden-size)."""

    num_attention_heads: int = 4
    """Attention heads (--num-attention-heads)."""

    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (--ffn-hidden-size); None: 4 * hidden_size."""

    num_experts: Optional[int] = None
    """MoE experts per layer (--num-experts); None: dense model."""

    moe_router_topk: int = 2
    """Experts each token is routed to (--moe-router-topk)."""

    moe_ffn_hidden_size: Optional[int] = None
    """Hidden size of each expert MLP (--moe-ffn-hidden-size); None: ffn_hidden_size."""

    moe_expert_capacity_factor: Optional[float] = None
    """Expert capacity as a multiple of the balanced load (--moe-expert-capacity-factor): assignments
    beyond it are dropped (megatron: token drop policy `probs`; DeepSpeed-MoE: the gate's
    `capacity_factor` with `drop_tokens=True`). None: dropless, megatron's default (DeepSpeed:
    `drop_tokens=False`, the capacity follows the most loaded expert of the expert-parallel group)."""

    vocab_size: int = 256
    """Vocabulary size (--vocab-size); padded like Megatron-LM to a multiple of 128 * tp."""

    seq_length: int = 32
    """Sequence length in tokens (--seq-length)."""

    params_dtype: str = "fp32"
    """Parameter/compute dtype: fp32, bf16 (--bf16) or fp16 (--fp16)."""

    num_query_groups: Optional[int] = None
    """Key/value head groups of grouped-query attention (--num-query-groups); None: one per head."""

    swiglu: bool = False
    """Gated linear unit with SiLU in the MLP (--swiglu), as LLaMA and Mixtral use."""

    tie_embeddings: bool = False
    """Input embedding and output layer share weights (GPT-3); False (megatron-core GPTModel's
    default): separate weights (LLaMA 3)."""

    kv_channels: Optional[int] = None
    """Projection size of each attention head (--kv-channels); None: hidden_size / num_attention_heads.
    A tensor-parallel rank's shard is expressed with it: GPT-3 175B under TP8 is hidden 12288 with 12
    heads of 128."""

    position_embedding_type: str = "learned_absolute"
    """learned_absolute (GPT-3), rope (LLaMA, Mixtral) or none (--position-embedding-type)."""

    rotary_base: int = 10000
    """Base of the rotary frequencies (--rotary-base); LLaMA 3 uses 500000."""

    rotary_percent: float = 1.0
    """Fraction of each head's dimensions rotated (--rotary-percent)."""

    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm (--normalization)."""

    norm_epsilon: float = 1e-5
    """Epsilon of the norms (--norm-epsilon)."""

    attention_backend: str = "local"
    """Core attention (--attention-backend): local/unfused (the full score matrix), flash or fused
    (torch's FlashAttention-2 or cuDNN kernel), auto (torch's choice); see ATTENTION_BACKENDS."""

    attention_dropout: float = 0.0
    """Dropout of the attention probabilities (--attention-dropout; Megatron-LM's default is 0.1, ours
    0: most large-model recipes turn it off)."""

    hidden_dropout: float = 0.0
    """Dropout after attention and MLP (--hidden-dropout; Megatron-LM's default 0.1, ours 0)."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """Hidden size of the shared expert every token also passes (--moe-shared-expert-intermediate-size);
    None: no shared expert."""

    moe_router_score_function: str = "softmax"
    """Router scores (--moe-router-score-function): softmax or sigmoid (DeepSeek-V3)."""

    fp8: Optional[str] = None
    """FP8 GEMMs in the transformer layers (--fp8-format): e4m3 (everything e4m3) or hybrid (e4m3
    forward, e5m2 gradients); None: the parameter dtype. Runs through torch._scaled_mm (Hopper GPUs,
    and CPUs), costed as FP8 GEMMs under fake execution; needs params_dtype bf16 or fp16."""

    fp8_recipe: str = "delayed"
    """Per-tensor scaling (--fp8-recipe): delayed (from an amax history) or tensorwise (the current
    tensor's amax)."""

    fp8_amax_history_len: int = 1
    """Quantizations of a tensor whose amax the delayed recipe keeps (--fp8-amax-history-len)."""

    fp8_amax_compute_algo: str = "most_recent"
    """How the delayed recipe reduces its history (--fp8-amax-compute-algo): most_recent or max."""

    fp8_margin: int = 0
    """Scale margin, scale = fp8_max / amax / 2^margin (--fp8-margin)."""

    def parameters(self) -> int:
        """Parameter count of the whole model (biases and norms left out: a fraction of a percent)."""
        h, heads = self.hidden_size, self.num_attention_heads
        head = self.head_dim
        kv = (self.num_query_groups or heads) * head
        attention = 2 * h * heads * head + 2 * h * kv
        ffn = self.ffn_hidden_size or 4 * h
        per_mlp = (3 if self.swiglu else 2) * h
        if self.num_experts:
            mlp = self.num_experts * per_mlp * (self.moe_ffn_hidden_size or ffn) + h * self.num_experts
            mlp += per_mlp * (self.moe_shared_expert_intermediate_size or 0)
        else:
            mlp = per_mlp * ffn
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attention + mlp) + embeddings

    @property
    def head_dim(self) -> int:
        """Dimensions of one attention head: kv_channels, or hidden / heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        _require_positive("model", num_layers=self.num_layers, hidden_size=self.hidden_size,
                          num_attention_heads=self.num_attention_heads,
                          ffn_hidden_size=self.ffn_hidden_size, num_experts=self.num_experts,
                          moe_router_topk=self.moe_router_topk, vocab_size=self.vocab_size,
                          seq_length=self.seq_length, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
                          num_query_groups=self.num_query_groups, kv_channels=self.kv_channels,
                          rotary_base=self.rotary_base, fp8_amax_history_len=self.fp8_amax_history_len,
                          moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size)
        require_choice("model.position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        require_choice("model.normalization", self.normalization, NORMALIZATIONS)
        require_choice("model.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        require_choice("model.moe_router_score_function", self.moe_router_score_function, SCORE_FUNCTIONS)
        require_choice("model.fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        require_choice("model.fp8_amax_compute_algo", self.fp8_amax_compute_algo, FP8_AMAX_ALGOS)
        if self.fp8 is not None:
            require_choice("model.fp8", self.fp8, FP8_FORMATS)
            if self.params_dtype == "fp32":
                raise ConfigError(f"model.fp8={self.fp8} needs 16-bit parameters (as with Transformer "
                                  "Engine); set model.params_dtype=bf16")
        if isinstance(self.fp8_margin, bool) or not isinstance(self.fp8_margin, int) or self.fp8_margin < 0:
            raise ConfigError(f"model.fp8_margin={self.fp8_margin!r}: expected an integer >= 0")
        require_fraction("model.rotary_percent", self.rotary_percent, low_open=True)
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            require_fraction(f"model.{name}", value)
            if value == 1:
                raise ConfigError(f"model.{name}=1 drops everything; expected a rate below 1")
        eps = self.norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1 or not math.isfinite(eps):
            raise ConfigError(f"model.norm_epsilon={eps!r}: expected a small number > 0, e.g. 1e-5")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            raise ConfigError(f"model.moe_expert_capacity_factor={self.moe_expert_capacity_factor}; expected "
                              f"a number > 0 (e.g. 1.25), or null for dropless routing")
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"model.num_attention_heads({self.num_attention_heads}) is not divisible by "
                              f"model.num_query_groups({self.num_query_groups})")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size({self.hidden_size}) is not divisible by "
                f"model.num_attention_heads({self.num_attention_heads}); pick sizes that divide")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ConfigError(f"model.moe_router_topk({self.moe_router_topk}) > "
                              f"model.num_experts({self.num_experts}); lower topk")
        if self.params_dtype not in DTYPES:
            raise ConfigError(f"model.params_dtype={self.params_dtype!r}; expected one of "
                              f"{', '.join(DTYPES)}")
