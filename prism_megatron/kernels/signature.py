"""Aten ops as data: a JSON-able signature of one call, its kind, FLOPs and bytes moved.

A signature is what the kernel-cost model is keyed on and what `calibrate --kernels` replays on a GPU:
the op's name (`aten.mm.default`) and its arguments with every tensor replaced by its metadata
(`{"T": shape, "dt": dtype, "st": stride}`); Python scalars, lists, dtypes and devices stay as they
are (dtypes and devices as strings); keyword arguments are a sorted list of [name, value] pairs.
It is built from fake and real tensors alike, so a fake run on a
CPU and a real run on a GPU name the same kernel the same way.

Kinds: `view` (returns an alias of an input: no kernel), `comm` (c10d: costed by the network model),
`gemm` (mm, addmm, bmm, baddbmm: FLOPs from the shapes), `memory` (everything else: bound by the bytes
it reads and writes).
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterator

import torch

__all__ = ["GEMM_OPS", "OpCall", "signature", "op_kind", "gemm_dims", "tensor_bytes", "spec_tensors"]

GEMM_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
                      "aten._scaled_mm.default"})
_FREE = {"aten.detach.default", "aten.lift_fresh.default", "aten._local_scalar_dense.default",
         "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
         "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset",
         "aten.resize_.default", "aten.record_stream.default", "aten.is_same_size.default",
         "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default"}
_KINDS: dict[Any, str] = {}


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    if returns and not any("Tensor" in str(r.type) for r in returns):
        return True  # returns only metadata (a device, a size, a bool): no kernel
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns)


def op_kind(func: Any) -> str:
    """`view`, `free`, `comm`, `gemm` or `memory` for an `OpOverload` (cached)."""
    kind = _KINDS.get(func)
    if kind is None:
        name = str(func)
        if name.startswith(("c10d.", "_c10d_functional.", "c10d_functional.")):
            kind = "comm"
        elif name in GEMM_OPS:
            kind = "gemm"
        elif name in _FREE or name.startswith(("profiler.", "prim.")) or _is_view(func):
            kind = "free"
        else:
            kind = "memory"
        _KINDS[func] = kind
    return kind


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"T": list(value.shape), "dt": str(value.dtype).removeprefix("torch."),
                "st": list(value.stride())}
    if isinstance(value, (list, tuple)):
        return [_spec(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": value.type}
    return {"other": type(value).__name__}  # generators, memory formats, layouts: not part of the cost


def signature(func: Any, args: tuple, kwargs: dict | None) -> dict:
    """The JSON-able signature of one call (see module docstring)."""
    return {"op": str(func), "args": _spec(list(args)),
            "kwargs": [[k, _spec(v)] for k, v in sorted((kwargs or {}).items())]}


def key_of(sig: dict) -> str:
    """A compact exact key: the signature as canonical JSON."""
    return json.dumps(sig, separators=(",", ":"), sort_keys=True)


def spec_tensors(spec: Any) -> Iterator[dict]:
    """Every tensor spec inside a signature's arguments."""
    if isinstance(spec, dict):
        if "T" in spec:
            yield spec
        else:
            for v in spec.values():
                yield from spec_tensors(v)
    elif isinstance(spec, list):
        for v in spec:
            yield from spec_tensors(v)


_ITEM_SIZE: dict[str, int] = {}


def item_size(dtype: str) -> int:
    size = _ITEM_SIZE.get(dtype)
    if size is None:
        size = _ITEM_SIZE[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return size


def tensor_bytes(spec: dict) -> int:
    return math.prod(spec["T"]) * item_size(spec["dt"])


def gemm_dims(sig: dict) -> tuple[int, int, int, int, str, str]:
    """(batch, M, N, K, dtype, layout) of a GEMM signature; layout is `NN`, `NT`, `TN` or `TT`: whether
    each operand is read row-major (N) or transposed (T), as cuBLAS sees it."""
    args = sig["args"]
    op = sig["op"]
    a, b = (args[1], args[2]) if op in ("aten.addmm.default", "aten.baddbmm.default") else (args[0], args[1])
    batch = a["T"][0] if len(a["T"]) == 3 else 1
    m, k = a["T"][-2], a["T"][-1]
    n = b["T"][-1]

    def layout(t: dict) -> str:
        rows, cols = t["T"][-2], t["T"][-1]
        return "N" if t["st"][-1] == 1 or cols == 1 else ("T" if t["st"][-2] == 1 or rows == 1 else "N")

    return batch, m, n, k, a["dt"], layout(a) + layout(b)


class OpCall:
    """One dispatched op, summarized for costing: signature, kind, FLOPs and bytes."""

    __slots__ = ("sig", "kind", "flops", "bytes")

    def __init__(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        self.kind = op_kind(func)
        self.sig = signature(func, args, kwargs)
        self.flops = 0.0
        if self.kind == "gemm":
            batch, m, n, k, _, _ = gemm_dims(self.sig)
            self.flops = 2.0 * batch * m * n * k
        moved = sum(tensor_bytes(t) for t in spec_tensors(self.sig["args"]))
        moved += sum(tensor_bytes(t) for t in spec_tensors(self.sig["kwargs"]))
        moved += sum(tensor_bytes(t) for t in spec_tensors(_spec(out)))
        self.bytes = float(moved)
