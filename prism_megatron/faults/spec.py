"""Fault specs: stragglers, thermal throttling, degraded links, slow hosts (pure Python).

`faults.inject` holds one or more specs separated by `;`. RANKS selects virtual ranks: `4711`, a
range `0-7`, `node3` (every rank of node 3: `emulation.gpus_per_node` per node), several joined by
`+` (`4711+node9`). Factors are > 0 (1.5: takes 1.5 times as long).

- `slow(RANKS, F)`: compute takes F times as long, all the time (a straggler);
- `throttle(RANKS, F, AFTER_S)`: compute takes F times as long once the job has run AFTER_S seconds
  of sustained load (a GPU dropping its clocks when hot);
- `periodic(RANKS, F, PERIOD_S, DURATION_S)`: F times as long for DURATION_S out of every PERIOD_S
  (a recurring neighbour, a periodic background task);
- `link(RANKS, F)`: every transfer the ranks take part in takes F times as long (a degraded link or
  NIC: a ring, a pair, an all-to-all moves at its slowest member's pace);
- `stall(RANKS, SECONDS, EVERY)`: the ranks start every EVERY-th iteration SECONDS late (a data
  loader or host stall), from the first iteration.

Time-varying faults are evaluated per iteration: iteration i, starting at job time t_i (the sum of
the iterations before it), runs with the factors that hold at t_i (`FaultSet.at`). A replay
(sim/des.py) takes the resulting `Perturbation`: compute factors, link factors and start delays per
rank, and splits its equivalence classes only where these reach.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

KINDS = {"slow": ("factor",), "throttle": ("factor", "after_s"),
         "periodic": ("factor", "period_s", "duration_s"), "link": ("factor",), "stall": ("stall_s", "every")}
EXAMPLE = "slow(4711, 1.5); throttle(node3, 1.3, 600); link(64-71, 2); stall(0, 0.5, 10)"


class FaultError(ValueError):
    """A fault spec that cannot be understood or applied (one line, with the fix)."""


@dataclass(frozen=True)
class Fault:
    """One parsed fault; `ranks` is the selector text until `FaultSet` resolves it on a world."""

    kind: str
    ranks: str
    factor: float = 1.0
    after_s: float = 0.0
    period_s: float = 0.0
    duration_s: float = 0.0
    stall_s: float = 0.0
    every: int = 1

    def factor_at(self, t_s: float) -> float:
        """This fault's factor for an iteration that starts at job time `t_s`."""
        if self.kind == "throttle":
            return self.factor if t_s >= self.after_s else 1.0
        if self.kind == "periodic":
            return self.factor if (t_s % self.period_s) < self.duration_s else 1.0
        return self.factor


def parse_faults(text: str | None) -> list[Fault]:
    """Parse `faults.inject` (see the module docstring); raises FaultError."""
    if not text or not str(text).strip():
        return []
    out = []
    for part in str(text).split(";"):
        part = part.strip()
        if part:
            out.append(_parse_one(part))
    return out


def _parse_one(text: str) -> Fault:
    m = re.fullmatch(r"([a-z]+)\s*\((.*)\)", text)
    if not m or m.group(1) not in KINDS:
        raise FaultError(f"fault {text!r}: expected KIND(RANKS, ...) with KIND one of {', '.join(KINDS)}, "
                         f"e.g. {EXAMPLE}")
    kind = m.group(1)
    args = [a.strip() for a in m.group(2).split(",")]
    names = KINDS[kind]
    if len(args) != 1 + len(names) or not args[0]:
        raise FaultError(f"fault {text!r}: {kind} takes (RANKS, {', '.join(n.upper() for n in names)}), "
                         f"e.g. {EXAMPLE}")
    values = {}
    for name, raw in zip(names, args[1:]):
        try:
            values[name] = int(raw) if name == "every" else float(raw)
        except ValueError:
            raise FaultError(f"fault {text!r}: {name.upper()}={raw!r} is not a number") from None
    fault = Fault(kind=kind, ranks=args[0].replace(" ", ""), **values)
    if kind in ("slow", "throttle", "periodic", "link") and not fault.factor > 0:
        raise FaultError(f"fault {text!r}: the factor must be > 0 (1.5 = takes 1.5 times as long)")
    if kind == "periodic" and not 0 < fault.duration_s <= fault.period_s:
        raise FaultError(f"fault {text!r}: expected 0 < DURATION_S <= PERIOD_S")
    if kind == "throttle" and fault.after_s < 0:
        raise FaultError(f"fault {text!r}: AFTER_S must be >= 0")
    if kind == "stall" and (fault.stall_s < 0 or fault.every < 1):
        raise FaultError(f"fault {text!r}: expected SECONDS >= 0 and EVERY >= 1")
    _selector_parts(fault.ranks, text)  # syntax checked now, ranges against the world later
    return fault


def _selector_parts(selector: str, text: str) -> list[tuple[str, int, int]]:
    parts = []
    for item in selector.split("+"):
        m = re.fullmatch(r"(node)?(\d+)(?:-(\d+))?", item)
        if not m:
            raise FaultError(f"fault {text!r}: ranks {item!r}: expected a rank (4711), a range (0-7) or a "
                             "node (node3), joined by +")
        lo = int(m.group(2))
        hi = int(m.group(3)) if m.group(3) else lo
        if hi < lo:
            raise FaultError(f"fault {text!r}: range {item!r} runs backwards")
        parts.append(("node" if m.group(1) else "rank", lo, hi))
    return parts


def resolve_ranks(selector: str, world_size: int, gpus_per_node: int) -> list[int]:
    """The virtual ranks `selector` names; raises FaultError outside the world."""
    ranks: set[int] = set()
    for kind, lo, hi in _selector_parts(selector, selector):
        if kind == "node":
            ranks.update(range(lo * gpus_per_node, (hi + 1) * gpus_per_node))
        else:
            ranks.update(range(lo, hi + 1))
    bad = sorted(r for r in ranks if r >= world_size)
    if bad:
        raise FaultError(f"fault ranks {selector!r} reach rank {bad[0]}, outside the virtual world of "
                         f"{world_size} ranks ({gpus_per_node} per node); choose ranks in "
                         f"0..{world_size - 1}")
    return sorted(ranks)


@dataclass
class Perturbation:
    """What one iteration's replay takes: per rank, a compute factor, a link factor and a start delay."""

    compute: dict[int, float] = field(default_factory=dict)
    link: dict[int, float] = field(default_factory=dict)
    start_s: dict[int, float] = field(default_factory=dict)

    def key(self) -> tuple:
        return tuple(tuple(sorted(d.items())) for d in (self.compute, self.link, self.start_s))

    def __bool__(self) -> bool:
        return bool(self.compute or self.link or self.start_s)


class FaultSet:
    """Faults resolved on a world of `world_size` ranks."""

    def __init__(self, faults: list[Fault], world_size: int, gpus_per_node: int) -> None:
        self.faults = list(faults)
        self.ranks = [resolve_ranks(f.ranks, world_size, gpus_per_node) for f in self.faults]

    @classmethod
    def parse(cls, text: str | None, world_size: int, gpus_per_node: int) -> "FaultSet":
        return cls(parse_faults(text), world_size, gpus_per_node)

    @property
    def time_varying(self) -> bool:
        return any(f.kind in ("throttle", "periodic", "stall") for f in self.faults)

    def affected(self) -> list[int]:
        return sorted({r for ranks in self.ranks for r in ranks})

    def at(self, iteration: int = 0, t_s: float = 0.0) -> Perturbation:
        """The perturbation of iteration `iteration` (0-based), which starts at job time `t_s`."""
        out = Perturbation()
        for fault, ranks in zip(self.faults, self.ranks):
            if fault.kind == "stall":
                if iteration % fault.every == 0 and fault.stall_s > 0:
                    for r in ranks:
                        out.start_s[r] = out.start_s.get(r, 0.0) + fault.stall_s
                continue
            factor = fault.factor_at(t_s)
            if factor == 1.0:
                continue
            target = out.link if fault.kind == "link" else out.compute
            for r in ranks:
                target[r] = target.get(r, 1.0) * factor
        return out
