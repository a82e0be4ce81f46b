"""Seeing `UntypedStorage.resize_`, which never reaches the dispatcher.

Megatron frees and regrows buffers with ``tensor.untyped_storage().resize_(n)``; no dispatch mode sees
that call. While any watcher is registered, `UntypedStorage.resize_` is wrapped to call each watcher
with the storage after the resize (the exact memory tracker re-reads its size). The wrapper is
process-wide and guarded by a lock; it is removed with the last watcher, unless someone wrapped
`resize_` after us, in which case ours stays as a pass-through.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

__all__ = ["unwatch_resizes", "watch_resizes"]

_LOCK = threading.Lock()
_WATCHERS: list[Callable[[torch.UntypedStorage], None]] = []
_SAVED: list[Any] = [None]  # UntypedStorage's own resize_ before ours (None: inherited)


def _resize_and_report(storage: torch.UntypedStorage, size: int) -> Any:
    # Call the C implementation itself, not a saved attribute, so wrappers can never recurse.
    result = torch._C.StorageBase.resize_(storage, size)
    for watcher in tuple(_WATCHERS):
        watcher(storage)
    return result


def watch_resizes(watcher: Callable[[torch.UntypedStorage], None]) -> None:
    """Call `watcher(storage)` after every `UntypedStorage.resize_` until `unwatch_resizes`."""
    with _LOCK:
        if not _WATCHERS:
            _SAVED[0] = torch.UntypedStorage.__dict__.get("resize_")
            torch.UntypedStorage.resize_ = _resize_and_report  # type: ignore[method-assign]
        _WATCHERS.append(watcher)


def unwatch_resizes(watcher: Callable[[torch.UntypedStorage], None]) -> None:
    """Stop calling `watcher`; the last one out restores `resize_`."""
    with _LOCK:
        _WATCHERS.remove(watcher)
        if not _WATCHERS and torch.UntypedStorage.__dict__.get("resize_") is _resize_and_report:
            del torch.UntypedStorage.resize_
            if _SAVED[0] is not None:
                torch.UntypedStorage.resize_ = _SAVED[0]  # type: ignore[method-assign]
