"""`PatchSet`: attribute replacements that can be undone, in reverse order, exactly once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


@dataclass
class PatchSet:
    """Records each `setattr` it makes so that `restore()` puts back what was there (or nothing)."""

    _undo: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()

    def __len__(self) -> int:
        return len(self._undo)
