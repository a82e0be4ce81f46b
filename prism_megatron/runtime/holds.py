"""Holds on a host-driven clock: the hold arithmetic every clock shares, and what the holds lasted.

A realtime or paced sandbox holds each communication operation until the end its plan gives
(trace/holdplan.py); `HostHolds` runs that plan on a clock whose stream is the calling thread (the
CPU clock, trace/clock.py, and fake execution's modelled clock, runtime/fake.py), over the native
`HoldBook` (comm/native.py). It lives with the runtime, below the recorder, because the device
runtimes' clocks are made of it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


class DelayAccount:
    """What the injected holds were asked for (their goal less the time they began) and what they
    lasted."""

    def __init__(self) -> None:
        self.count = 0
        self.planned_s = 0.0
        self.measured_s = 0.0

    def add(self, planned_s: float, measured_s: float) -> None:
        self.count += 1
        self.planned_s += planned_s
        self.measured_s += measured_s

    def report(self, accrued_s: float = 0.0, absorbed_s: float = 0.0) -> dict:
        """{"count", "planned_s", "measured_s", "error_pct", "overhead_accrued_s",
        "overhead_absorbed_s"}: the last two, the emulator's own time the holds ran up and paid back
        (emulate/holds.py), are the book's, given here."""
        return {"count": self.count, "planned_s": self.planned_s, "measured_s": self.measured_s,
                "error_pct": (self.measured_s / self.planned_s - 1) * 100 if self.planned_s > 0 else None,
                "overhead_accrued_s": accrued_s, "overhead_absorbed_s": absorbed_s}


def HoldBook(rows: Sequence[Optional[tuple]]) -> Any:  # noqa: N802 - it makes the native book
    """An iteration's holds on one clock: `rows[k]` = (self_s, terms[, transfer_s]) or (self_s, terms,
    at_wait, transfer_s) of the k-th communication operation, None where it is not held.

    Times are kept on the job's timeline: the clock's time less `debt`, the emulator's own time run
    up so far this iteration (emulate/holds.py). `plan` sets an operation's end to the latest of its
    own part (its stamped begin plus transfer_s, or without a stamp `now + self_s`) and each term
    (anchor, ghost_s) as (end of anchor + ghost_s), anchor -1 being the iteration's start; an
    operation issued past that end runs up the debt by the difference. `goal` is where a hold of
    `ordinals` spins to on the clock, after paying back what it can of the debt. The arithmetic is the
    native trace's (comm/native.py: one implementation for every host clock)."""
    from prism_megatron.comm import native

    def row(r):
        if r is None:
            return None
        if len(r) == 4:
            return (float(r[0]), tuple(r[1]), bool(r[2]), r[3])
        return (float(r[0]), tuple(r[1]), False, r[2] if len(r) > 2 else None)

    return native.load().HoldBook([row(r) for r in rows])


class HostHolds:
    """Holds on a clock whose stream is the calling thread (its `now()` and `wait_until()`)."""

    _book: Any = None

    def set_holds(self, rows: Sequence[Optional[tuple]]) -> None:
        self._book = HoldBook(rows)

    def hold_iteration(self) -> None:
        self._book.begin(self.now())

    def stamp(self, ordinal: int, idle: Optional[bool] = None) -> None:
        """The held operation `ordinal` begins now (`idle`: a device clock's probe, unused here)."""
        self._book.stamp(ordinal, self.now())

    def hold(self, ordinals, spin: bool) -> None:
        """Plan the ends of `ordinals` (held operations issued together) and, with `spin`, hold the
        stream until the latest of them."""
        now = self.now()
        self._book.plan(ordinals, now)
        if spin:
            self.wait_until(self._book.goal(ordinals, now))

    def hold_wait(self, ordinals) -> None:
        """Hold the stream until the planned ends of `ordinals` (an overlapped operation's wait)."""
        self.wait_until(self._book.goal(ordinals, self.now()))

    def delay_report(self) -> dict:
        book = self._book
        return self.delays.report() if book is None else self.delays.report(book.accrued_s, book.absorbed_s)
