"""Fused attention kernels: their shapes, FLOPs, calibration on a GPU and cost.

Fake execution on a CPU runs torch's CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`
and its backward) wherever the job's core attention is torch's scaled_dot_product_attention
(runtime/sdpa_attention.py). A GPU runs FlashAttention-2 or cuDNN's fused attention instead, whose
speed depends on the shapes in its own way (tiles, causal skipping, GQA), so those ops are priced from
a calibration of the GPU kernel itself, not replayed op by op:

- `sweep_attention` (`calibrate --kernels`) times `scaled_dot_product_attention` forward and backward on
  the GPU for each backend (flash, cudnn), causal and not, head dims 64 and 128, MHA and GQA (8 KV
  heads), sequences 1k-32k (CUDA events around back-to-back calls, as the other sweeps);
- `AttentionCosts.predict` takes the measured row of the same shape where there is one (`exact`), else
  the achieved FLOP/s interpolated in log(FLOPs) over the rows of the same backend, direction, dtype,
  head dim, masking and GQA-ness (`attention-fit`), else a roofline at the spec's discount.

FLOPs are the two (forward) or five (backward: recomputed scores, dV, dP, dS, dQ and dK counted as
the kernel does) GEMMs of attention, 2*b*hq*sq*sk*d each, halved under a causal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

__all__ = ["ATTENTION_OPS", "AttentionShape", "AttentionCosts", "attention_shape", "sweep_attention"]

ATTENTION_OPS = {
    # op -> (direction, index of is_causal among the positional arguments, index of q)
    "aten._scaled_dot_product_flash_attention_for_cpu.default": ("fwd", 4, 0),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": ("bwd", 7, 1),
    "aten._scaled_dot_product_flash_attention.default": ("fwd", 4, 0),
    "aten._scaled_dot_product_flash_attention_backward.default": ("bwd", 11, 1),
    "aten._scaled_dot_product_cudnn_attention.default": ("fwd", 6, 0),
    "aten._scaled_dot_product_efficient_attention.default": ("fwd", 6, 0),
}
BACKENDS = ("flash", "cudnn")
"""Calibrated backends: torch's SDPBackend FLASH_ATTENTION and CUDNN_ATTENTION."""
SWEEP_SEQ = (1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_HEADS = ((32, 8, 128), (32, 32, 128), (16, 16, 64), (12, 12, 128))
"""(query heads, key/value heads, head dim) of the sweep: LLaMA-3 8B's GQA, MHA at 128 and 64, and a
GPT-3 175B tensor-parallel shard (96 heads / TP8)."""
SWEEP_TOKENS = 16384
"""Tokens per sweep point (batch = SWEEP_TOKENS / seq, at least 1): short sequences are timed at a
realistic load, not as a few tiles."""


@dataclass(frozen=True)
class AttentionShape:
    direction: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    causal: bool

    @property
    def flops(self) -> float:
        pairs = self.q_len * self.kv_len * (0.5 if self.causal and self.q_len == self.kv_len else 1.0)
        gemms = 2 if self.direction == "fwd" else 5
        return 2.0 * gemms * self.batch * self.q_heads * pairs * self.head_dim

    @property
    def group(self) -> tuple:
        """What the interpolation keeps fixed."""
        return (self.direction, self.dtype, self.head_dim, self.causal, self.kv_heads != self.q_heads)

    def key(self) -> tuple:
        return (self.direction, self.batch, self.q_heads, self.kv_heads, self.q_len, self.kv_len,
                self.head_dim, self.dtype, self.causal)


def attention_shape(sig: dict) -> Optional[AttentionShape]:
    """The attention shape of an op signature (kernels/signature.py), or None for other ops."""
    known = ATTENTION_OPS.get(sig["op"])
    if known is None:
        return None
    direction, causal_at, q_at = known
    args = sig["args"]
    q, k = args[q_at], args[q_at + 1]
    causal = bool(args[causal_at]) if len(args) > causal_at and isinstance(args[causal_at], bool) else False
    b, hq, sq, d = q["T"]
    return AttentionShape(direction, b, hq, k["T"][1], sq, k["T"][2], d, q["dt"], causal)


@dataclass
class AttentionCosts:
    """Measured attention rows of one GPU, by backend (module docstring)."""

    rows: list = field(default_factory=list)
    _exact: dict = field(default_factory=dict, init=False, repr=False)
    _fits: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        groups: dict = {}
        for row in self.rows:
            shape = AttentionShape(row["direction"], row["batch"], row["q_heads"], row["kv_heads"],
                                   row["q_len"], row["kv_len"], row["head_dim"], row["dtype"], row["causal"])
            self._exact[(row["backend"], *shape.key())] = row["s"]
            groups.setdefault((row["backend"], *shape.group), []).append((shape.flops, shape.flops / row["s"]))
        for group, points in groups.items():
            points.sort()
            self._fits[group] = (np.log([p[0] for p in points]), np.asarray([p[1] for p in points]))

    def predict(self, shape: AttentionShape, backend: str) -> Optional[tuple[float, str]]:
        """(seconds, source) from the calibration, or None where it has nothing of this kind."""
        seconds = self._exact.get((backend, *shape.key()))
        if seconds is not None:
            return seconds, "exact"
        fit = self._fits.get((backend, *shape.group))
        if fit is None:  # the same kind, MHA for GQA or the reverse
            d, dt, hd, causal, gqa = shape.group
            fit = self._fits.get((backend, d, dt, hd, causal, not gqa))
        if fit is None:
            return None
        log_flops, rates = fit
        rate = float(np.interp(math.log(shape.flops), log_flops, rates))  # clamped at the ends
        return shape.flops / rate, "attention-fit"


def sweep_attention(torch, time_it: Callable[[Callable[[], Any]], float], log: Callable[[str], None],
                    dtype_name: str = "bfloat16", seqs=SWEEP_SEQ) -> list[dict]:
    """Time SDPA forward and backward on this GPU (module docstring); a shape a backend refuses is
    logged and skipped."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    dtype = getattr(torch, dtype_name)
    rows = []
    for backend in BACKENDS:
        choice = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.CUDNN_ATTENTION
        for hq, hkv, d in SWEEP_HEADS:
            for seq in seqs:
                batch = max(1, SWEEP_TOKENS // seq)
                for causal in (True, False):
                    q, k, v = (torch.randn(batch, h, seq, d, device="cuda", dtype=dtype, requires_grad=True)
                               for h in (hq, hkv, hkv))
                    gqa = hq != hkv
                    try:
                        with sdpa_kernel([choice]):
                            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                            grad = torch.randn_like(out)
                            fwd = time_it(lambda: F.scaled_dot_product_attention(
                                q, k, v, is_causal=causal, enable_gqa=gqa))
                            both = time_it(lambda: torch.autograd.grad(
                                F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
                                (q, k, v), grad))
                    except RuntimeError as err:
                        log(f"  attention {backend} hq={hq} hkv={hkv} d={d} s={seq} causal={causal}: "
                            f"refused ({str(err).splitlines()[0][:100]})")
                        continue
                    finally:
                        del q, k, v
                    for direction, seconds in (("fwd", fwd), ("bwd", max(both - fwd, 1e-6))):
                        rows.append({"backend": backend, "direction": direction, "batch": batch,
                                     "q_heads": hq, "kv_heads": hkv, "q_len": seq, "kv_len": seq,
                                     "head_dim": d, "dtype": dtype_name, "causal": causal, "s": seconds})
                log(f"  attention {backend} hq={hq} hkv={hkv} d={d} s={seq}: done")
    return rows


def time_shapes(torch, time_it: Callable[[Callable[[], Any]], float], shapes: list[AttentionShape],
                log: Callable[[str], None]) -> list[dict]:
    """Rows for the exact shapes a fake run met (`calibrate --kernels --ops`), on each backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    rows, seen = [], set()
    for shape in shapes:
        pair = (shape.batch, shape.q_heads, shape.kv_heads, shape.q_len, shape.kv_len, shape.head_dim,
                shape.dtype, shape.causal)
        if pair in seen:
            continue
        seen.add(pair)
        dtype = getattr(torch, shape.dtype)
        for backend in BACKENDS:
            choice = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.CUDNN_ATTENTION
            q = torch.randn(shape.batch, shape.q_heads, shape.q_len, shape.head_dim, device="cuda",
                            dtype=dtype, requires_grad=True)
            k, v = (torch.randn(shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim, device="cuda",
                                dtype=dtype, requires_grad=True) for _ in range(2))
            gqa = shape.q_heads != shape.kv_heads

            def run():
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)
            try:
                with sdpa_kernel([choice]):
                    grad = torch.randn_like(run())
                    fwd = time_it(run)
                    both = time_it(lambda: torch.autograd.grad(run(), (q, k, v), grad))
            except RuntimeError as err:
                log(f"  attention {backend} {pair}: refused ({str(err).splitlines()[0][:100]})")
                continue
            for direction, seconds in (("fwd", fwd), ("bwd", max(both - fwd, 1e-6))):
                rows.append({"backend": backend, "direction": direction, "batch": shape.batch,
                             "q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "q_len": shape.q_len,
                             "kv_len": shape.kv_len, "head_dim": shape.head_dim, "dtype": shape.dtype,
                             "causal": shape.causal, "s": seconds})
    log(f"attention shapes of the ops file: {len(seen)} timed")
    return rows
