"""The native per-operation path of the prism backend: why it exists, and how it is built.

Why native. A sandbox pays, for every collective and p2p with ghost members, the host time of the
emulator's own work where a real rank pays NCCL's launch. On an H200 host a Python process group took
about 175 us per operation in a TP2 sandbox (its ghost folding, the recorder's marks and bookkeeping,
the wait hooks) against about 16 us for an NCCL launch; with ~300 operations per iteration the device
idled behind that host time, and the recorder kept the idle as the job's compute. A Python method
call with cold caches costs microseconds; no rewrite of the Python path reaches NCCL's cost.

So the whole per-operation path is C++ (`csrc/`), built against the installed torch:

- `Backend`, a `c10d::Backend` per virtual group: torch.distributed reaches it as it reaches NCCL (the
  dispatcher's c10d ops, no Python frame). The real members exchange data over an inner gloo/NCCL
  backend; the ghosts' part is the ghost policy as ATen calls (`policy.cpp`, the semantics of
  comm/ghost.py); an operation returns a completed `Work` whose first `wait()` is recorded in C++.
- `Trace`: what a recorder needs of each operation (its begin and issue marks, the device-idle probe,
  a memory sample in labelled iterations, its waits) as fixed-size entries in a buffer, on the
  recorder's own clock (CUDA events from a pool made ahead of the iteration, or the host's monotonic
  clock). The recorder reads them at its own next boundary (`Recorder.attach_native`) and builds its
  nodes from them exactly as from live calls: one implementation of the recorder's semantics.
- The holds of realtime emulation and pacing: `HoldBook` on a host clock (also what Python clocks
  use), a one-thread CUDA kernel on a device clock (`holds.cu`), launched from C++.

Python is entered on the per-operation path only where a Python object must answer: listeners of
every event (tests; recorders on a Python clock, such as fake execution's modelled clock), ghost-data
providers (asked for integer data only: MoE token counts, DeepSpeed's capacity exchange), and a CPU
memory tracker's reading in labelled iterations.

The alternative, a shim under NCCL so the program keeps `backend="nccl"`, would pay exactly NCCL's
host path, but would have to answer ghosts below torch (in NCCL's own API, per communicator), with
no access to the recorder's program order; the c10d backend sits where torch's own backends sit.

Build: on first use, `torch.utils.cpp_extension.load` compiles the sources with the machine's C++
compiler (and nvcc for CUDA builds: the CUDA clock and holds) into torch's extension cache, once per
source version (from a copy of the sources in that cache, so every copy of the package shares one
build); a machine without a compiler gets `NativeBuildError` with what to install.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

CSRC = Path(__file__).with_name("csrc")
NAME = "prism_native"
PEER_MARK = "prism: no answer from sandbox rank"
"""How the error of a wait on another sandbox that never answered starts (csrc/backend.cpp
`peer_error`, comm/session.py); `emulate` looks for it in the sandboxes' log."""
PEER_LOST_SIGNS = ("imed out", "imeout", "onnection closed", "onnection reset", "roken pipe")
"""What gloo, NCCL and the store say when the other side of a wait did not answer or went away."""
ENTRY_DTYPE = np.dtype([("kind", "i1"), ("op", "i1"), ("flags", "i1"), ("dtype", "i1"), ("group", "<i4"),
                        ("peer_delta", "<i4"), ("ordinal", "<i4"), ("value", "<i8"), ("mark", "<i8"),
                        ("t", "<f8"), ("mark2", "<i8"), ("t2", "<f8"), ("stream", "<i8"), ("mem", "<i8")])
"""One trace entry (csrc/prism.h `Entry`)."""
BEGIN, ISSUE, WAIT_BEGIN, WAIT_END = range(4)
REAL_PEER, IDLE, HAS_MEM, HAS_MARK, HAS_MARK2, SETUP = 1, 2, 4, 8, 16, 32
NO_PEER_DELTA = -(1 << 31)
POLICY_CODES = {"mirror": 0, "zeros": 1, "random": 2}
REDUCE_NAMES = ("sum", "avg", "max", "min", "product")

_module: Any = None
_lock = threading.Lock()


class NativeBuildError(RuntimeError):
    """The native backend could not be built or loaded on this machine."""


def build_dir() -> Path:
    """Where the compiled extension is cached (torch's extension directory)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(NAME, verbose=False))


def _with_cuda() -> bool:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def load() -> Any:
    """The compiled extension, built on first use (torch's JIT extension cache; a file lock keeps
    several processes from building at once)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        _module = _build()
        if _module.ENTRY_SIZE != ENTRY_DTYPE.itemsize:
            raise NativeBuildError(f"prism's native trace entries are {_module.ENTRY_SIZE} bytes, the "
                                   f"reader expects {ENTRY_DTYPE.itemsize}: remove {build_dir()} and rebuild")
        return _module


def _staged_sources() -> Path:
    """The sources, copied into the build cache (`src/`) and rewritten there only when their content
    changes: the build then names the same files wherever the package lies (a checkout, an installed
    copy, another checkout), so they share one compiled backend instead of each rebuilding it in turn."""
    staged = build_dir() / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for source in CSRC.iterdir():
        if source.suffix not in (".h", ".cpp", ".cu"):
            continue
        target, data = staged / source.name, source.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_name(f".{target.name}.{os.getpid()}")  # several processes may stage at once
            tmp.write_bytes(data)
            os.replace(tmp, target)
    return staged


def _build() -> Any:
    import torch  # noqa: F401 - the extension links against it
    from torch.utils.cpp_extension import load as build

    cuda = _with_cuda()
    try:
        csrc = _staged_sources()
    except OSError as err:
        raise NativeBuildError(f"prism's native backend could not copy its sources into {build_dir()} ({err}); "
                               "set TORCH_EXTENSIONS_DIR to a writable folder") from None
    sources = [csrc / f for f in ("bindings.cpp", "session.cpp", "policy.cpp", "trace.cpp", "backend.cpp")]
    if cuda:
        sources += [csrc / "holds_cuda.cpp", csrc / "holds.cu", csrc / "fold_cuda.cpp", csrc / "fold.cu"]
    flags = (["-O0", "-g"] if os.environ.get("PRISM_NATIVE_DEBUG") else ["-O2"]) + ["-Wno-attributes"] + (
        ["-DPRISM_CUDA"] if cuda else [])
    try:
        directory = build_dir()
        fresh = not any(directory.glob("*.so"))
    except Exception:  # noqa: BLE001 - only for the message
        fresh = True
    if fresh:
        print("prism: building the native backend (first use on this machine: about a minute)...",
              file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        module = build(NAME, [str(s) for s in sources], extra_cflags=flags, extra_cuda_cflags=["-O2"],
                       with_cuda=cuda, verbose=bool(os.environ.get("PRISM_NATIVE_VERBOSE")))
    except (RuntimeError, OSError, ImportError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        first = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else repr(err))
        raise NativeBuildError(
            f"prism's native backend could not be built ({first}): "
            "it needs a C++ compiler (g++), ninja (pip install ninja) and, for CUDA, nvcc from the CUDA "
            f"toolkit (CUDA_HOME); PRISM_NATIVE_VERBOSE=1 shows the compiler's output; cache: {build_dir()}") from None
    if fresh:
        print(f"prism: native backend built in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return module


def cuda_built() -> bool:
    """Whether the native backend has its CUDA part (the device clock's events and holds)."""
    return bool(load().CUDA)


def dtype_names() -> dict[int, str]:
    """torch dtype names (`float32`, ...) by the ScalarType code the native trace records."""
    import torch

    native = load()
    names = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
                  *[getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]):
        names[native.scalar_type(torch.empty(0, dtype=dtype))] = str(dtype).replace("torch.", "")
    names[-1] = "none"
    return names


def hold_rows(holds) -> list:
    """emulate/holds.py `Hold`s (or None) as the native rows: (self_s, terms, at_wait, transfer_s)."""
    return [None if h is None else (float(h.self_s), tuple((int(a), float(g)) for a, g in h.terms),
                                    bool(h.at_wait), None if h.transfer_s is None else float(h.transfer_s))
            for h in holds]
