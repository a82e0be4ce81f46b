"""Small shared helpers: atomic file writes, per-rank paths, a free port, a process's launch
environment, and pausing the garbage collector."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from pathlib import Path
from typing import Iterator


LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")


def job_env(cpu: bool, **extra: str) -> dict[str, str]:
    """The environment of a job this tool starts (a capture slice, a sandbox, a calibration job).

    It is this process's, without a launcher's rank variables (the job is a world of its own), with
    one OpenMP thread on CPU unless one is set, and with `extra`. When prism_megatron runs from a
    source checkout, that checkout goes first on the job's path: the job then runs the code of the
    tool that started it, even where an editable install of another checkout would answer the import.
    A package installed in a `site-packages` or `dist-packages` folder adds nothing, so a PYTHONPATH
    the user set keeps its precedence there (an install into another folder, as `pip --target`
    makes, goes first like a checkout)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", **extra)
    for key in LAUNCHER_KEYS:
        env.pop(key, None)
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    root = Path(__file__).resolve().parents[1]
    if root.name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never half."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never half.

    Where the file system can (Linux `O_TMPFILE`), the data is written to a file with no name, which
    is named only once whole: a process killed while writing leaves nothing behind."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if _write_unnamed(directory, path, data):
        return
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_unnamed(directory: str, path: str, data: bytes) -> bool:
    """`data` to `path` through an `O_TMPFILE` file linked in once written; False where that is not
    available (then nothing was written)."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        return False
    try:
        fd = os.open(directory, flag | os.O_WRONLY, 0o666)  # the umask applies, as for open()
    except OSError:
        return False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        tmp = os.path.join(directory, f".tmp-{os.getpid()}-{os.urandom(4).hex()}")
        try:  # linkat(AT_SYMLINK_FOLLOW), which os.link uses only given a directory fd
            fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.link(str(fd), tmp, src_dir_fd=fds, follow_symlinks=True)
            finally:
                os.close(fds)
        except OSError:
            return False
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return True
    finally:
        os.close(fd)


PHYSICAL_RANK_ENV = "PRISM_PHYSICAL_RANK"
PHYSICAL_WORLD_SIZE_ENV = "PRISM_PHYSICAL_WORLD_SIZE"
"""Set by `prism-megatron launch`, which gives the script the *virtual* RANK and WORLD_SIZE (as
torchrun would give them in the real job): the physical processes' own rank and count live here."""


def physical_world_size() -> int:
    """How many processes were launched on the machines (not the virtual world)."""
    return int(os.environ.get(PHYSICAL_WORLD_SIZE_ENV) or os.environ.get("WORLD_SIZE", "1"))


def per_rank_path(path: str, virtual_rank: int) -> str:
    """`{rank}` in `path` becomes the virtual rank; with several processes and no `{rank}`,
    `.rank<r>` goes before the extension, so that processes never write one file."""
    if "{rank}" in path:
        return path.replace("{rank}", str(virtual_rank))
    if physical_world_size() > 1:
        stem, ext = os.path.splitext(path)
        return f"{stem}.rank{virtual_rank}{ext}"
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_process(device: str) -> None:
    """Before `init_process_group` in a training script: run under plain `python` (not torchrun), the
    process is a world of one (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set); on cuda it takes
    the GPU of its LOCAL_RANK."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    if device == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Cyclic garbage collection off for a block that builds millions of small acyclic objects (a
    replay and its causes), where each collection would walk every live object: it matters for large
    heaps, not small replays."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
