"""The hold plan file: per virtual rank, a `Hold` per communication operation of an iteration.

emulate/holds.py computes the holds from a replay and writes the plan; a realtime or paced sandbox
reads its own rank's holds (`emulation.delay_plan`, hooks/install.py) and its clock runs them
(trace/clock.py). The format lives here, with its reader, so the sandbox side needs no replay code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Optional

START = -1
"""The anchor of a ghost chain that began at the iteration's start."""


class Hold(NamedTuple):
    """One communication operation's hold (emulate/holds.py's module docstring). Held until
    max(now + self_s, max over `terms` of (end of anchor + ghost_s)), `now` being when the hold runs
    on the stream."""

    self_s: float
    terms: tuple
    """(anchor, ghost_s) per path by which ghost peers arrive: the anchor is the ordinal (in the
    iteration) of the sandbox's operation the path begins at the end of, or START; empty where no
    ghost takes part."""
    at_wait: bool
    """Held where the operation is waited for (it overlaps the compute after its issue)."""
    transfer_s: Optional[float] = None
    """The modelled transfer (the replay's end of the operation less its start). Where the clock knows
    when the operation began on the stream (a stamp, trace/clock.py), its own part is that begin plus
    this, whatever the backend's local work took; `self_s` is that with the recorded local part
    taken off, for where it does not."""


def write_plan(path: Path, plans: dict[int, list[Optional[Hold]]]) -> None:
    """The plan file a realtime or paced sandbox reads (`emulation.delay_plan`)."""
    from prism_megatron.util import atomic_write_text

    atomic_write_text(str(path), json.dumps({"holds": {
        str(r): [None if h is None else [h.self_s, [list(t) for t in h.terms], h.at_wait, h.transfer_s]
                 for h in plan]
        for r, plan in plans.items()}}))


def read_plan(path: str, rank: int) -> list[Optional[Hold]]:
    """`rank`'s holds from a plan file; ValueError, KeyError or OSError where it has none."""
    rows = json.loads(Path(path).read_text())["holds"][str(rank)]
    return [None if row is None else Hold(float(row[0]), tuple((int(a), float(g)) for a, g in row[1]),
                                          bool(row[2]), None if len(row) < 4 or row[3] is None else float(row[3]))
            for row in rows]
