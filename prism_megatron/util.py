"""Small shared helpers: atomic file writes."""

from __future__ import annotations

import os
import tempfile


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never half."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never half."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
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


def per_rank_path(path: str, virtual_rank: int) -> str:
    """`{rank}` in `path` becomes the virtual rank; with several processes (WORLD_SIZE > 1) and no
    `{rank}`, `.rank<r>` goes before the extension, so that processes never write one file."""
    if "{rank}" in path:
        return path.replace("{rank}", str(virtual_rank))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        stem, ext = os.path.splitext(path)
        return f"{stem}.rank{virtual_rank}{ext}"
    return path
