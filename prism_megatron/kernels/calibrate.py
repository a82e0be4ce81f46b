"""`prism-megatron calibrate --kernels`: measure kernel durations on this machine's GPU.

Four sweeps, each timed on the device's clock (CUDA events around back-to-back launches, after
warm-up, as nccl-tests and cuBLAS benchmarks time):

1. **GEMMs**: `mm` over a grid of M, N, K (bf16 on a fine grid, fp32 and fp16 on a coarse one) in the
   four operand layouts cuBLAS distinguishes (row-major or transposed A and B); FP8 `_scaled_mm` (e4m3
   x e4m3, and e5m2 x e4m3 as the hybrid recipe's gradients run) on the coarse grid, in the one
   layout it takes (A row-major, B column-major: `NT`), where the GPU has FP8 tensor cores.
2. **Memory-bound families**: time against bytes moved, from 4 KiB to 4 GiB, for an elementwise binary
   op, a dtype conversion, a row reduction, a softmax, a layer norm, an embedding gather and a
   multi-tensor (`_foreach_`) update.
3. **Fused attention** (kernels/attention.py): torch's flash and cuDNN attention, forward and backward,
   over sequence lengths, head shapes and masking, and at the shapes of `--ops FILE`.
4. **Exact ops** (`--ops FILE`, from a fake run's op list): each signature replayed as is on random
   data, so the shapes a model really runs are measured, not interpolated; with each, the scratch
   memory the op borrows from the caching allocator and returns before it ends (a fake run's
   allocator model replays that transient, which can be where the peak is).

Plus two host figures: the host time per eager op (launch overhead) and the shortest kernel.

The result is a versioned JSON (`format: prism-kernels/1`) that `KernelCostModel` loads; the H200's is
shipped in `prism_megatron/kernels/data/`.
"""

from __future__ import annotations

import json
import math
import platform
import time
from typing import Any, Callable, Optional

FORMAT = "prism-kernels/1"
BF16_SIZES = (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
COARSE_SIZES = (128, 512, 1024, 2048, 4096, 8192)
LAYOUTS = ("NN", "NT", "TN", "TT")
FAMILY_BYTES = tuple(4096 * 4 ** i for i in range(11))  # 4 KiB .. 4 GiB


def _timer(torch, budget_s: float = 0.02, max_reps: int = 50) -> Callable[[Callable[[], Any]], float]:
    """Median-free simple timing: warm-up, then `reps` launches between two events (seconds per call)."""
    cuda = torch.cuda

    def time_it(fn: Callable[[], Any]) -> float:
        fn()
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        once = max(start.elapsed_time(end) * 1e-3, 1e-6)
        reps = int(min(max_reps, max(3, budget_s / once)))
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / reps

    return time_it


def _operand(torch, rows: int, cols: int, transposed: bool, dtype):
    if transposed:
        return torch.randn(cols, rows, device="cuda", dtype=dtype).t()
    return torch.randn(rows, cols, device="cuda", dtype=dtype)


def sweep_gemms(torch, time_it, log: Callable[[str], None], bf16_sizes=BF16_SIZES) -> list[dict]:
    rows = []
    plans = [("bfloat16", bf16_sizes), ("float32", COARSE_SIZES), ("float16", COARSE_SIZES)]
    for dtype_name, sizes in plans:
        dtype = getattr(torch, dtype_name)
        t0 = time.perf_counter()
        for layout in LAYOUTS:
            for m in sizes:
                for k in sizes:
                    a = _operand(torch, m, k, layout[0] == "T", dtype)
                    for n in sizes:
                        b = _operand(torch, k, n, layout[1] == "T", dtype)
                        rows.append({"dtype": dtype_name, "layout": layout, "m": m, "n": n, "k": k,
                                     "s": time_it(lambda a=a, b=b: torch.mm(a, b))})
        log(f"gemm {dtype_name}: {len(sizes) ** 3 * 4} shapes in {time.perf_counter() - t0:.1f} s")
    if torch.cuda.get_device_capability() >= (8, 9):
        rows += _sweep_fp8_gemms(torch, time_it, log)
    return rows


def _sweep_fp8_gemms(torch, time_it, log: Callable[[str], None]) -> list[dict]:
    rows, one = [], torch.ones((), device="cuda")
    for a_name, b_name in (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e4m3fn")):
        t0 = time.perf_counter()
        for m in COARSE_SIZES:
            for k in COARSE_SIZES:
                a = torch.randn(m, k, device="cuda").to(getattr(torch, a_name))
                for n in COARSE_SIZES:
                    b = torch.randn(n, k, device="cuda").to(getattr(torch, b_name)).t()
                    rows.append({"dtype": a_name, "layout": "NT", "m": m, "n": n, "k": k, "s": time_it(
                        lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                          out_dtype=torch.bfloat16))})
        log(f"gemm {a_name} x {b_name}: {len(COARSE_SIZES) ** 3} shapes in {time.perf_counter() - t0:.1f} s")
    return rows


def _families(torch) -> dict[str, Callable[[int], Callable[[], Any]]]:
    """family -> maker(bytes moved) -> op; each op moves about that many bytes."""
    f32, bf16 = torch.float32, torch.bfloat16

    def binary(nbytes):  # a + b -> c in bf16: 3 tensors
        n = max(1, nbytes // 6)
        a, b = torch.randn(n, device="cuda", dtype=bf16), torch.randn(n, device="cuda", dtype=bf16)
        return lambda: torch.add(a, b)

    def convert(nbytes):  # bf16 -> fp32: 6 bytes per element
        a = torch.randn(max(1, nbytes // 6), device="cuda", dtype=bf16)
        return lambda: a.float()

    def reduction(nbytes):  # row sums of a [rows, 4096] fp32 matrix
        n = max(4096, nbytes // 4)
        a = torch.randn(n // 4096, 4096, device="cuda", dtype=f32)
        return lambda: a.sum(dim=-1)

    def softmax(nbytes):  # fp32 [rows, 2048]: read + write
        n = max(2048, nbytes // 8)
        a = torch.randn(n // 2048, 2048, device="cuda", dtype=f32)
        return lambda: torch.softmax(a, dim=-1)

    def layer_norm(nbytes):  # bf16 [rows, 4096]
        n = max(4096, nbytes // 4)
        a = torch.randn(n // 4096, 4096, device="cuda", dtype=bf16)
        w = torch.ones(4096, device="cuda", dtype=bf16)
        return lambda: torch.nn.functional.layer_norm(a, (4096,), w, w)

    def gather(nbytes):  # embedding rows of 4096 bf16 (read + write)
        rows = max(1, nbytes // (4096 * 4))
        table = torch.randn(32000, 4096, device="cuda", dtype=bf16)
        idx = torch.randint(0, 32000, (rows,), device="cuda")
        return lambda: torch.nn.functional.embedding(idx, table)

    def foreach(nbytes):  # Adam-like multi-tensor update: 64 fp32 tensors, x += y
        n = max(64, nbytes // 12)
        xs = [torch.randn(n // 64, device="cuda") for _ in range(64)]
        ys = [torch.randn(n // 64, device="cuda") for _ in range(64)]
        return lambda: torch._foreach_add_(xs, ys)

    return {"elementwise": binary, "convert": convert, "reduction": reduction, "softmax": softmax,
            "layer_norm": layer_norm, "gather": gather, "foreach": foreach}


def sweep_families(torch, time_it, log: Callable[[str], None]) -> dict[str, list[list[float]]]:
    curves = {}
    for family, maker in _families(torch).items():
        points = []
        for nbytes in FAMILY_BYTES:
            if family == "gather" and nbytes > (1 << 30):
                continue
            op = maker(nbytes)
            points.append([float(nbytes), time_it(op)])
            del op
            torch.cuda.empty_cache()
        curves[family] = points
        log(f"family {family}: {len(points)} sizes")
    return curves


def host_figures(torch) -> dict[str, float]:
    """Host seconds per small eager op and the shortest kernel on the device."""
    a = torch.ones(16, device="cuda")
    reps = 2000
    host = float("inf")
    for _ in range(4):  # the first pass loads the kernel (lazy module loading): not a launch's cost
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.add(a, a)
        host = min(host, (time.perf_counter() - t0) / reps)
    torch.cuda.synchronize()
    # the device side: many tiny kernels queued behind a long one so the host never starves it
    torch.cuda._sleep(int(2e8))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.add(a, a)
    end.record()
    end.synchronize()
    return {"host_launch_s": host, "min_kernel_s": start.elapsed_time(end) * 1e-3 / reps}


def _build(torch, spec: Any, device: str = "cuda") -> Any:
    if isinstance(spec, list):
        return [_build(torch, s, device) for s in spec]
    if isinstance(spec, dict):
        if "T" in spec:
            dtype = getattr(torch, spec["dt"])
            shape, stride = spec["T"], spec["st"]
            if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no random kernels of its own
                return torch.empty_strided(shape, stride, dtype=torch.bfloat16, device=device).normal_().to(dtype)
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            if dtype.is_floating_point:
                t.normal_()
            else:
                t.zero_()
            return t
        if "dtype" in spec:
            return getattr(torch, spec["dtype"])
        if "device" in spec:
            return torch.device(device)
        if "other" in spec:
            return None
        return {k: _build(torch, v, device) for k, v in spec.items()}
    return spec


# Ops whose time depends on the values of an index tensor: op -> (position of the indexed tensor,
# position of its dim argument or None for dim 0, position of the index). Zero-filled indices send
# every element to one row: a scatter_add_ of megatron's MoE unpermute then took 9.3 ms of atomics on
# one row where the real run's indices (a permutation) spread them; `_valid_indices` draws them.
_INDEXED = {op: (0, 1, 2) for op in (
    "aten.scatter_add_.default", "aten.scatter_add.default", "aten.scatter.src", "aten.scatter.value",
    "aten.scatter_.src", "aten.scatter_.value", "aten.scatter_reduce.two", "aten.scatter_reduce_.two",
    "aten.gather.default", "aten.index_add.default", "aten.index_add_.default", "aten.index_select.default",
    "aten.index_copy.default", "aten.index_copy_.default")}
_INDEXED["aten.embedding.default"] = (0, None, 1)
_INDEX_LISTS = ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default",
                "aten._unsafe_index_put.default", "aten._index_put_impl_.default")


def _valid_indices(torch, op: str, args: list) -> None:
    """Fill the integer index tensors of an indexing op with uniform random valid indices (in place;
    expanded indices share their values along the expanded dims, as megatron's are)."""
    def fill(index, bound):
        if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32) or bound < 1:
            return
        flat = index.new_empty(0).set_(index.untyped_storage(), 0,
                                       (index.untyped_storage().nbytes() // index.element_size(),))
        flat.random_(0, int(bound))

    if op in _INDEXED:
        source, dim, index = _INDEXED[op]
        d = args[dim] if dim is not None else 0
        fill(args[index], args[source].shape[d] if args[source].dim() else 1)
    elif op == "aten.embedding_dense_backward.default":  # (grad, indices, num_weights, ...)
        fill(args[1], args[2])
    elif op in _INDEX_LISTS:
        for i, index in enumerate(args[1]):
            if index is not None and i < args[0].dim():
                fill(index, args[0].shape[i])


def _scratch(torch, func, args, kwargs) -> list:
    """The allocator events an op makes for memory it gives back before it returns (workspace,
    contiguous copies of strided inputs), from the caching allocator's own trace of the call:
    `[["alloc", i, bytes] | ["free", i], ...]` in order, `i` numbering the scratch blocks."""
    memory = torch.cuda.memory
    torch.cuda.synchronize()
    memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=100_000)
    try:
        out = func(*args, **kwargs)
        torch.cuda.synchronize()
        trace = memory._snapshot()["device_traces"][0]
    finally:
        memory._record_memory_history(enabled=None)
    del out
    allocs = [e for e in trace if e["action"] == "alloc"]
    freed = {e["addr"] for e in trace if e["action"] == "free_requested"}
    live, events, blocks = {}, [], 0
    for e in trace:  # an address is reused after its free: each allocation is its own block
        if e["action"] == "alloc" and e["addr"] in freed:
            live[e["addr"]] = blocks
            events.append(["alloc", blocks, int(e["size"])])
            blocks += 1
        elif e["action"] == "free_requested" and e["addr"] in live:
            events.append(["free", live.pop(e["addr"])])
    return events if allocs else []


def replay_ops(torch, time_it, signatures: list[dict], log: Callable[[str], None],
               device: str = "cuda") -> list[dict]:
    """Each signature run as is on random data; failures are listed, not fatal."""
    from prism_megatron.kernels.signature import key_of

    rows, failed = [], 0
    for sig in signatures:
        try:
            namespace, name, overload = sig["op"].split(".")
            func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
            args = _build(torch, sig["args"], device)
            kwargs = {k: _build(torch, v, device) for k, v in sig["kwargs"]}
            _valid_indices(torch, sig["op"], args)
            seconds = time_it(lambda: func(*args, **kwargs))
            rows.append({"key": key_of(sig), "s": seconds, "scratch": _scratch(torch, func, args, kwargs)
                         if device == "cuda" else []})
        except Exception as err:  # noqa: BLE001 - an op that cannot be replayed is reported, not fatal
            failed += 1
            rows.append({"key": key_of(sig), "error": f"{type(err).__name__}: {str(err)[:120]}"})
        if device == "cuda":
            torch.cuda.empty_cache()
    log(f"exact ops: {len(rows) - failed} timed, {failed} failed")
    return rows


def calibrate_kernels(out_path: str, ops_path: Optional[str] = None, quick: bool = False,
                      log: Callable[[str], None] = print, grid: bool = True) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("calibrate --kernels measures a GPU and none is visible here; run it on the "
                           "GPU machine (the result is a file to copy back)")
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default: fp32 GEMMs are fp32
    time_it = _timer(torch)
    props = torch.cuda.get_device_properties(0)
    data: dict[str, Any] = {
        "format": FORMAT, "gpu": props.name, "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory, "torch": torch.__version__,
        "cuda": torch.version.cuda, "host": platform.node(),
        "date": time.strftime("%Y-%m-%d"), "host_figures": host_figures(torch),
    }
    from prism_megatron.kernels import attention
    import prism_megatron.kernels.ops  # noqa: F401 - registers prism::fused_rms_norm, which --ops files name

    data["exact"], shapes = [], []
    if ops_path:
        with open(ops_path) as f:
            signatures = json.load(f)["ops"]
        shapes = [s for s in map(attention.attention_shape, signatures) if s is not None]
        data["exact"] = replay_ops(torch, time_it, [s for s in signatures if attention.attention_shape(s) is None],
                                   log)
    data["attention"] = attention.time_shapes(torch, time_it, shapes, log)
    data["attention"] += attention.sweep_attention(torch, time_it, log, seqs=attention.SWEEP_SEQ[::2]
                                                   if quick else attention.SWEEP_SEQ)
    data["families"] = sweep_families(torch, time_it, log) if grid else {}
    data["gemm"] = sweep_gemms(torch, time_it, log, COARSE_SIZES if quick else BF16_SIZES) if grid else []
    from prism_megatron.util import atomic_write_text

    atomic_write_text(out_path, json.dumps(data))
    log(f"kernel calibration of {props.name}: {len(data['gemm'])} GEMMs, "
        f"{sum(len(v) for v in data['families'].values())} family points, {len(data['exact'])} exact ops "
        f"-> {out_path}")
    return data


def gemm_efficiency(row: dict, peak_flops: float) -> float:
    return 2.0 * row["m"] * row["n"] * row["k"] / (row["s"] * peak_flops) if row["s"] > 0 else math.nan
