"""Kernel-cost model of one GPU type: the device seconds of an aten op from its signature.

Lookup order, and the `source` each prediction carries:

1. `exact`: the signature was measured as is by `calibrate --kernels --ops` (same op, shapes, dtypes,
   strides and arguments).
2. `gemm-grid`: a GEMM (mm/addmm/bmm/baddbmm) off the exact table takes the efficiency (achieved over
   peak FLOP/s) interpolated in log2(M, N, K) from the calibrated grid of its dtype and operand layout;
   a batched GEMM is costed as `batch` GEMMs' FLOPs at the efficiency of one (M*batch, N, K) GEMM.
   An FP8 GEMM (`_scaled_mm`) takes the grid of its FP8 dtypes; where the calibration has none, the
   `gemm-grid-scaled` source: the bf16 grid's efficiency times FP8_OF_BF16_EFFICIENCY at the FP8 peak.
3. `family`: a memory-bound op takes the calibrated time-against-bytes curve of its family
   (elementwise, convert, reduction, softmax, layer_norm, gather, foreach), log-log interpolated.
4. `exact` / `attention-fit` for fused attention (torch's SDPA kernels, kernels/attention.py): the GPU
   kernel of the configured backend (`attention_backend`: flash or cudnn) measured at that shape, or its
   achieved FLOP/s interpolated over the calibrated shapes of its kind.
5. `roofline`: no calibration (A100, or an op and dtype nothing covers): max(FLOPs / peak,
   bytes / bandwidth) / the spec's achievable fraction, and never below the shortest kernel.

Shipped calibrations (`data/<gpu>-*.json`): the H200's (its GEMM grid, families, the exact ops of the
default and [D] jobs, the host's module table; no fused attention), and the H100's (a coarse GEMM grid,
families, fused attention and the exact ops of the four `benchmarks/model_fidelity.py` shards, against
whose real runs it predicts within 3.5 %; no module table, so its host is the launch figure alone).

GPU specs are documented dense peak figures (NVIDIA data sheets, SXM parts): H200 and H100 989 TFLOP/s
bf16/fp16, 1979 fp8, 67 fp32 (non-tensor), 4.8 and 3.35 TB/s HBM3(e); A100 80GB 312 TFLOP/s
bf16/fp16, 19.5 fp32, 2.039 TB/s (no FP8 tensor cores).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from prism_megatron.kernels.attention import AttentionCosts, attention_shape
from prism_megatron.kernels.signature import (
    GEMM_OPS,
    OpCall,
    gemm_dims,
    key_of,
    spec_tensors,
    tensor_bytes,
)

__all__ = ["GpuSpec", "GPU_SPECS", "KernelCostModel", "shipped_calibration"]

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class GpuSpec:
    """Documented peak figures of one GPU type."""

    name: str
    peak_flops: dict
    """dtype name -> dense peak FLOP/s (tensor cores where the dtype uses them)."""
    memory_bandwidth_Bps: float
    memory_bytes: int
    achievable: float = 0.8
    """Fraction of a peak that real kernels reach (the roofline's discount)."""
    min_kernel_s: float = 2.5e-6
    host_launch_s: float = 6e-6
    """Host time of one eager op (Python, dispatcher, launch): bounds a launch-bound stream."""
    compute_capability: tuple = (9, 0)
    sm_count: int = 132

    def __post_init__(self) -> None:
        if self.memory_bandwidth_Bps <= 0 or not self.peak_flops:
            raise ValueError(f"GpuSpec {self.name}: peak figures must be positive")


_HOPPER_PEAKS = {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float8_e4m3fn": 1979e12,
                 "float8_e5m2": 1979e12}
GPU_SPECS = {
    "h200": GpuSpec("h200", _HOPPER_PEAKS, 4.8e12, int(141e9)),
    "h100": GpuSpec("h100", _HOPPER_PEAKS, 3.35e12, int(80e9)),
    "a100": GpuSpec("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                    2.039e12, int(80e9), compute_capability=(8, 0), sm_count=108),
}

FP8_OF_BF16_EFFICIENCY = 0.87
"""An FP8 GEMM's efficiency (of the FP8 peak) over the bf16 GEMM's of the same shape (of the bf16 peak):
the median of benchmarks/fp8_gemm.py on an H100 (0.83-0.98 over the shards' GEMM shapes, forward and
input gradient), so `gemm-grid-scaled` is expected within about 10 %."""
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")

_FAMILY_OF_OP = {
    "aten._softmax.default": "softmax", "aten._softmax_backward_data.default": "softmax",
    "aten._log_softmax.default": "softmax", "aten._log_softmax_backward_data.default": "softmax",
    "aten.native_layer_norm.default": "layer_norm", "aten.native_layer_norm_backward.default": "layer_norm",
    "prism.fused_rms_norm.default": "layer_norm", "aten._fused_rms_norm_backward.default": "layer_norm",
    "aten.embedding.default": "gather", "aten.embedding_dense_backward.default": "gather",
    "aten.index_select.default": "gather", "aten.gather.default": "gather",
    "aten.sum.dim_IntList": "reduction", "aten.mean.dim": "reduction", "aten.sum.default": "reduction",
    "aten.linalg_vector_norm.default": "reduction", "aten.max.default": "reduction",
    "aten.amax.default": "reduction", "aten._to_copy.default": "convert", "aten.copy_.default": "convert",
}


def _any_scalars_key(sig: dict) -> str:
    """`key_of(sig)` with every float scalar argument set to 0.0 (tensor metadata and ints kept)."""
    def zero(value):
        if isinstance(value, float):
            return 0.0
        if isinstance(value, list):
            return [zero(v) for v in value]
        if isinstance(value, dict) and "T" not in value:
            return {k: zero(v) for k, v in value.items()}
        return value

    return key_of({**sig, "args": zero(sig["args"]), "kwargs": zero(sig.get("kwargs", []))})


def _scratch_events(measured) -> list:
    """Scratch events from a calibration row (older files: one block of N bytes)."""
    if isinstance(measured, (int, float)):
        return [["alloc", 0, int(measured)], ["free", 0]] if measured else []
    events, live = [], set()
    for event in measured:  # only frees of live blocks, and every block freed by the end
        if event[0] == "alloc" and event[1] not in live:
            live.add(event[1])
            events.append(list(event))
        elif event[0] == "free" and event[1] in live:
            live.discard(event[1])
            events.append(list(event))
    return events + [["free", i] for i in sorted(live)]


def _scratch_group(sig: dict) -> tuple:
    """An op and whether each of its tensor arguments is contiguous (what decides a kernel's copies)."""
    contiguous = []
    for t in spec_tensors(sig["args"]):
        expected, stride = 1, []
        for size in reversed(t["T"]):
            stride.append(expected)
            expected *= size
        contiguous.append(all(s == e or n == 1 for s, e, n in zip(t["st"], reversed(stride), t["T"])))
    return sig["op"], tuple(contiguous)


def shipped_calibration(gpu: str) -> Optional[Path]:
    """The newest shipped calibration file of `gpu` (`data/<gpu>-*.json`), or None."""
    files = sorted(DATA_DIR.glob(f"{gpu}-*.json"))
    return files[-1] if files else None


def _interp_loglog(points: np.ndarray, nbytes: float) -> float:
    xs, ys = np.log(points[:, 0]), np.log(points[:, 1])
    x = math.log(max(nbytes, 1.0))
    if x <= xs[0]:
        return float(points[0, 1])
    if x >= xs[-1]:  # beyond the sweep: bandwidth-bound, scale linearly in bytes
        return float(points[-1, 1] * nbytes / points[-1, 0])
    return float(math.exp(np.interp(x, xs, ys)))


@dataclass
class _Grid:
    """Efficiency on a log2 grid of M, N, K, trilinearly interpolated (clamped at the edges)."""

    axes: tuple
    eff: np.ndarray

    def at(self, m: float, n: float, k: float) -> float:
        idx, weights = [], []
        for axis, value in zip(self.axes, (m, n, k)):
            x = math.log2(max(value, 1.0))
            j = min(max(bisect_right(axis, x) - 1, 0), len(axis) - 2)
            w = (x - axis[j]) / (axis[j + 1] - axis[j])
            idx.append(j)
            weights.append(min(max(w, 0.0), 1.0))
        total = 0.0
        for corner in range(8):
            w, pos = 1.0, []
            for d in range(3):
                bit = (corner >> d) & 1
                w *= weights[d] if bit else 1.0 - weights[d]
                pos.append(idx[d] + bit)
            total += w * self.eff[tuple(pos)]
        return total


def check_target_gpu(target: str) -> None:
    """ValueError unless `target` names a GPU that `KernelCostModel.for_gpu` knows (`h200`, `h100`,
    `a100`) or a calibration JSON file that exists; cheap: nothing is loaded."""
    path = Path(target)
    if target.lower() in GPU_SPECS or (path.suffix == ".json" and path.is_file()):
        return
    raise ValueError(f"unknown target GPU {target!r}; expected one of {', '.join(GPU_SPECS)} or a "
                     f"file written by `prism-megatron calibrate --kernels`")


@dataclass
class KernelCostModel:
    """Predicts device seconds per op for one GPU type (see module docstring)."""

    spec: GpuSpec
    exact: dict = field(default_factory=dict)
    grids: dict = field(default_factory=dict)
    families: dict = field(default_factory=dict)
    calibration: Optional[str] = None
    exact_scratch: dict = field(default_factory=dict)
    """signature key -> the scratch allocator events measured with the exact op
    (`[["alloc", i, bytes] | ["free", i], ...]`)."""
    scratch_rule: dict = field(default_factory=dict)
    """(op, contiguity of its tensor arguments) -> (events, largest input bytes) of the largest measured
    instance: signatures not measured as is scale its block sizes by their own largest input (a
    strided input that the kernel copies, for one)."""
    host_launch_s: float = 0.0
    min_kernel_s: float = 0.0
    host_modules: dict = field(default_factory=dict)
    """module class key -> (host seconds per op, per call) that its Python adds on the GPU host beyond
    the launch figure (`kernels/host.py`, `calibrate --host-modules`); {}: not calibrated."""
    exact_any_scalars: dict = field(default_factory=dict)
    """For memory-bound ops: the exact table keyed with every float scalar argument set to 0. An
    elementwise kernel's time does not depend on the values it scales by, and some change every step
    (Adam's bias-corrected step sizes, a `_foreach_addcdiv_` ScalarList), so a later step finds the
    kernel measured with another step's values."""

    attention: AttentionCosts = field(default_factory=AttentionCosts)
    """Measured fused-attention kernels (kernels/attention.py)."""
    attention_backend: str = "flash"
    """The GPU kernel a fused attention op is priced as: flash or cudnn (the job's
    model.attention_backend: flash -> flash, fused -> cudnn)."""

    def __post_init__(self) -> None:
        self.host_launch_s = self.host_launch_s or self.spec.host_launch_s
        self.min_kernel_s = self.min_kernel_s or self.spec.min_kernel_s
        if self.exact and not self.exact_any_scalars:
            for key, seconds in self.exact.items():
                sig = json.loads(key)
                if sig["op"] not in GEMM_OPS:
                    self.exact_any_scalars.setdefault(_any_scalars_key(sig), seconds)

    @classmethod
    def for_gpu(cls, target: str) -> "KernelCostModel":
        """`h200` / `h100` / `a100` (the shipped calibration where one exists), or a calibration file."""
        check_target_gpu(target)
        if target.lower() in GPU_SPECS:
            spec = GPU_SPECS[target.lower()]
            shipped = shipped_calibration(spec.name)
            return cls.from_file(shipped, spec) if shipped else cls(spec)
        path = Path(target)
        with open(path) as f:
            gpu = json.load(f).get("gpu", "")
        name = next((n for n in GPU_SPECS if n in gpu.lower()), "h200")
        return cls.from_file(path, GPU_SPECS[name])

    @classmethod
    def from_file(cls, path: Path, spec: GpuSpec) -> "KernelCostModel":
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != "prism-kernels/1":
            raise ValueError(f"{path}: not a kernel calibration (format {data.get('format')!r}); "
                             f"write one with `prism-megatron calibrate --kernels`")
        exact = {row["key"]: row["s"] for row in data.get("exact", []) if "s" in row}
        exact_scratch, scratch_rule = {}, {}
        for row in data.get("exact", []):
            if "scratch" not in row:
                continue
            events = _scratch_events(row["scratch"])
            if events:
                exact_scratch[row["key"]] = events
            sig = json.loads(row["key"])
            largest = max((tensor_bytes(t) for t in spec_tensors(sig["args"])), default=0)
            group = _scratch_group(sig)
            if largest and largest >= scratch_rule.get(group, ([], 0))[1]:
                scratch_rule[group] = (events, largest)
        grids: dict = {}
        by_group: dict = {}
        for row in data.get("gemm", []):
            by_group.setdefault((row["dtype"], row["layout"]), []).append(row)
        for group, rows in by_group.items():
            peak = spec.peak_flops.get(group[0])
            if not peak:
                continue
            axes = tuple(sorted({math.log2(r[d]) for r in rows}) for d in "mnk")
            eff = np.full(tuple(len(a) for a in axes), np.nan)
            for r in rows:
                pos = tuple(a.index(math.log2(r[d])) for a, d in zip(axes, "mnk"))
                eff[pos] = 2.0 * r["m"] * r["n"] * r["k"] / (r["s"] * peak)
            if np.isnan(eff).any():
                continue  # an incomplete grid is not interpolated
            grids[group] = _Grid(axes, eff)
        families = {}
        for name, points in data.get("families", {}).items():
            by_bytes = dict(reversed(points))  # one point per size (the first measured)
            families[name] = np.asarray(sorted(by_bytes.items()), dtype="f8")
        host = data.get("host_figures", {})
        modules = {key: (row["per_op_s"], row["per_call_s"])
                   for key, row in data.get("host_modules", {}).get("modules", {}).items()
                   if row["per_op_s"] or row["per_call_s"]}
        return cls(spec, exact=exact, grids=grids, families=families, calibration=str(path), host_modules=modules,
                   host_launch_s=host.get("host_launch_s", 0.0), min_kernel_s=host.get("min_kernel_s", 0.0),
                   exact_scratch=exact_scratch, scratch_rule=scratch_rule,
                   attention=AttentionCosts(data.get("attention", [])))

    @property
    def source(self) -> str:
        return f"calibrated ({Path(self.calibration).name})" if self.calibration else "roofline"

    def predict(self, call: OpCall) -> tuple[float, str]:
        """(device seconds, source) of one op; `free` and `comm` ops cost nothing here."""
        if call.kind in ("free", "comm"):
            return 0.0, "free"
        shape = attention_shape(call.sig)
        if shape is not None:
            found = self.attention.predict(shape, self.attention_backend)
            if found is not None:
                return max(found[0], self.min_kernel_s), found[1]
            call.flops = shape.flops
            return self._roofline(call), "roofline"
        if self.exact:
            seconds = self.exact.get(key_of(call.sig))
            if seconds is None and call.kind != "gemm":
                seconds = self.exact_any_scalars.get(_any_scalars_key(call.sig))
            if seconds is not None:
                return seconds, "exact"
        if call.kind == "gemm":
            return self._gemm(call)
        return self._memory(call)

    def scratch_events(self, call: OpCall) -> list:
        """Allocator events of the memory the op borrows and returns before it ends (measured; [] when
        nothing was measured for it)."""
        if call.kind in ("free", "comm") or not self.scratch_rule:
            return []
        key = key_of(call.sig)
        if key in self.exact_scratch or key in self.exact:
            return self.exact_scratch.get(key, [])
        events, largest_ref = self.scratch_rule.get(_scratch_group(call.sig), ([], 0))
        if not events:
            return []
        largest = max((tensor_bytes(t) for t in spec_tensors(call.sig["args"])), default=0)
        scale = largest / largest_ref
        return [[e[0], e[1], int(e[2] * scale)] if e[0] == "alloc" else e for e in events]

    def _gemm(self, call: OpCall) -> tuple[float, str]:
        batch, m, n, k, dtype, layout = gemm_dims(call.sig)
        grid = self.grids.get((dtype, layout)) or self.grids.get((dtype, "NN"))
        peak = self.spec.peak_flops.get(dtype)
        scale, source = 1.0, "gemm-grid"
        if grid is None and dtype in FP8_DTYPES:
            grid = self.grids.get(("bfloat16", layout)) or self.grids.get(("bfloat16", "NN"))
            scale, source = FP8_OF_BF16_EFFICIENCY, "gemm-grid-scaled"
        if grid is not None and peak:
            eff = grid.at(m * batch, n, k) * scale
            if eff > 0:
                return max(call.flops / (eff * peak), self.min_kernel_s), source
        return self._roofline(call), "roofline"

    def _memory(self, call: OpCall) -> tuple[float, str]:
        family = _FAMILY_OF_OP.get(call.sig["op"])
        if family is None and call.sig["op"].startswith("aten._foreach_"):
            family = "foreach"
        points = self.families.get(family or "elementwise")
        if points is not None and len(points) >= 2:
            return max(_interp_loglog(points, call.bytes), self.min_kernel_s), "family"
        return self._roofline(call), "roofline"

    def _roofline(self, call: OpCall) -> float:
        dtype = next((t for t in (*FP8_DTYPES, "bfloat16", "float16", "float32") if t in json.dumps(call.sig)),
                     "float32")
        peak = self.spec.peak_flops.get(dtype, min(self.spec.peak_flops.values()))
        seconds = max(call.flops / peak, call.bytes / self.spec.memory_bandwidth_Bps) / self.spec.achievable
        return max(seconds, self.min_kernel_s)
