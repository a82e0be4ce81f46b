"""What every config section shares: the error type and the checks of plain values."""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional


class ConfigError(ValueError):
    """A user configuration error; its message is one line that teaches the fix."""


def require_positive(owner: str, **values: Optional[int]) -> None:
    """Each given integer is >= 1 (None: unset, allowed)."""
    bad = {k: v for k, v in values.items() if v is not None and (not isinstance(v, int) or v < 1)}
    if bad:
        listed = ", ".join(f"{owner}.{k}={v!r}" for k, v in bad.items())
        raise ConfigError(f"{listed}: expected positive integers; set each to 1 or more")


def require_choice(key: str, value: Any, choices: Iterable[str]) -> None:
    """`value` is one of `choices`."""
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is unknown; expected one of {', '.join(choices)}")


def require_fraction(key: str, value: Any, *, low_open: bool = False) -> None:
    """`value` is a finite number in [0, 1] ((0, 1] with `low_open`)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (0 < value if low_open else 0 <= value) and value <= 1)
    if not ok:
        bounds = "(0, 1]" if low_open else "[0, 1]"
        raise ConfigError(f"{key}={value!r}: expected a number in {bounds}")
