"""MoE load-imbalance models: how many token assignments each expert gets (pure numpy, seeded).

A model decides, for one MoE layer, microbatch, iteration and *source* rank (the rank whose tokens
are routed), how the T x k assignments (T tokens, top-k) spread over the E experts. Every rank of
the job evaluates the same function with the same arguments, so a sandbox, its ghosts and every
capture slice agree on the routing (what makes MoE slices of one job consistent, and what lets a
ghost send the sandbox exactly the tokens the model implies).

Models (spec strings, `moe.imbalance`):

- `none`: the model's own router decides (no override);
- `uniform`: every assignment picks an expert uniformly at random (seeded multinomial);
- `force-balanced`: exactly T*k/E per expert (remainder round-robin), as NVIDIA's public MoE
  benchmarks run with megatron's `moe_router_force_load_balancing`;
- `zipf(s)`: expert of popularity rank r gets a share proportional to 1/r^s; which expert has which
  rank is a seeded permutation per layer;
- `dirichlet(alpha)`: shares drawn from Dirichlet(alpha, ..., alpha) per (layer, source rank);
- `hot-experts(h, p)`: h experts (seeded per layer) share the fraction p of assignments, the others
  the rest;
- `replay(PATH)`: the routing a run logged (`moe.log_path` of every rank, PATH with `{rank}`): each
  source rank's assignments per expert, layer and microbatch; iterations past the logged ones wrap;

and `moe.drift_per_iteration` (>= 0) rotates the expert permutation by that many places per
iteration (a hot set that wanders, as routers do during training).

Shares become integer counts by largest-remainder apportionment, capped at T per expert (a token's k
experts are distinct); what a cap cuts off goes to the others in proportion (water-filling). So the
counts sum to T*k exactly and are feasible for a routing map (`routing_map`).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

_MEMO_ROWS = 1 << 14
"""Entries of `Imbalance.counts`' memo (at 256 experts, 32 MiB)."""
KINDS = ("none", "uniform", "force-balanced", "zipf", "dirichlet", "hot-experts", "replay")
_SPEC = re.compile(r"^\s*([a-z-]+)\s*(?:\(\s*([^)]*)\))?\s*$")
_ARITY = {"none": 0, "uniform": 0, "force-balanced": 0, "zipf": 1, "dirichlet": 1, "hot-experts": 2}


class ImbalanceError(ValueError):
    """A spec that names no model or gives it bad parameters."""


@dataclass(frozen=True)
class Imbalance:
    """A parsed imbalance model (see the module docstring)."""

    kind: str = "none"
    params: tuple[float, ...] = ()
    seed: int = 1234
    drift_per_iteration: float = 0.0

    trace: Optional[str] = None
    """replay: the log path ({rank} for the source rank)."""
    _tables: dict = field(default_factory=dict, compare=False, repr=False)
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """counts() per argument tuple: a pure function of them, asked for by every router call and every
    count all-gather of a modelled run, where hashing the seed and building a generator and the
    apportioning cost tens of microseconds of the host's time per call."""

    @classmethod
    def parse(cls, spec: str, seed: int = 1234, drift_per_iteration: float = 0.0) -> Imbalance:
        replay = re.match(r"^\s*replay\s*\((.+)\)\s*$", spec or "")
        if replay:
            path = replay.group(1).strip()
            if "{rank}" not in path:
                raise ImbalanceError(f"moe.imbalance={spec!r}: replay(PATH) needs {{rank}} in PATH, where "
                                     "each rank's moe.log_path log is, e.g. replay(/runs/a/load{rank}.jsonl)")
            return cls(kind="replay", seed=int(seed), drift_per_iteration=float(drift_per_iteration),
                       trace=path)
        m = _SPEC.match(spec or "")
        kind = m.group(1) if m else None
        if kind not in _ARITY:
            raise ImbalanceError(f"moe.imbalance={spec!r}: expected one of none, uniform, force-balanced, "
                                 "zipf(s), dirichlet(alpha), hot-experts(h, p), replay(PATH)")
        try:
            params = tuple(float(x) for x in m.group(2).split(",")) if m.group(2) else ()
        except ValueError:
            params = None
        if params is None or len(params) != _ARITY[kind] or not all(math.isfinite(x) for x in params):
            raise ImbalanceError(f"moe.imbalance={spec!r}: {kind} takes {_ARITY[kind]} number(s), e.g. "
                                 f"{_example(kind)}")
        if kind in ("zipf", "dirichlet") and params[0] <= 0:
            raise ImbalanceError(f"moe.imbalance={spec!r}: the parameter must be > 0")
        bad_hot = kind == "hot-experts" and (params[0] < 1 or params[0] != int(params[0])
                                              or not 0 <= params[1] <= 1)
        if bad_hot:
            raise ImbalanceError(f"moe.imbalance={spec!r}: expected hot-experts(h, p) with an integer h >= 1 "
                                 "and 0 <= p <= 1, e.g. hot-experts(2, 0.5)")
        if not 0 <= drift_per_iteration < math.inf:  # NaN too
            raise ImbalanceError(f"moe.drift_per_iteration={drift_per_iteration}: expected a finite number "
                                 ">= 0 (experts per iteration; 0: a fixed popularity order)")
        return cls(kind=kind, params=params, seed=int(seed), drift_per_iteration=float(drift_per_iteration))

    @property
    def overrides_router(self) -> bool:
        return self.kind != "none"

    def counts(self, *, experts: int, tokens: int, topk: int, layer: int, microbatch: int = 0,
               iteration: int = 0, source: int = 0) -> np.ndarray:
        """Assignments per expert (int64, length `experts`, summing to tokens * topk, each <= tokens)
        for `tokens` tokens of rank `source` in MoE layer `layer`. Read-only: the same array answers
        the same arguments again."""
        # what the model does not read is not in the key: a fixed model answers every iteration
        # and every source from one entry
        key = (experts, tokens, topk, layer, microbatch, iteration if self.varies_per_iteration else 0,
               source if self.depends_on_source else 0)
        out = self._memo.get(key)
        if out is None:
            out = self._counts(experts, tokens, topk, layer, microbatch, iteration, source)
            out.setflags(write=False)
            if len(self._memo) >= _MEMO_ROWS:  # a model drawn afresh every iteration: start over
                self._memo.clear()
            self._memo[key] = out
        return out

    def _counts(self, experts: int, tokens: int, topk: int, layer: int, microbatch: int, iteration: int,
                source: int) -> np.ndarray:
        if not 1 <= topk <= experts:
            raise ImbalanceError(f"top-{topk} routing over {experts} experts is impossible")
        total = tokens * topk
        if self.kind == "none":
            raise ImbalanceError("moe.imbalance=none leaves routing to the model's router: no counts")
        if self.kind == "force-balanced":
            base, extra = divmod(total, experts)
            out = np.full(experts, base, dtype=np.int64)
            start = (layer + microbatch) % experts
            out[(start + np.arange(extra)) % experts] += 1
            return out
        if self.kind == "replay":
            return self._replayed(experts, tokens, topk, layer, microbatch, iteration, source)
        if self.kind == "uniform":
            rng = self._rng("uniform", layer, microbatch, iteration, source)
            return _capped_multinomial(rng, total, np.full(experts, 1.0 / experts), tokens)
        shares = self.shares(experts, layer=layer, iteration=iteration, source=source)
        return apportion(shares, total, cap=tokens)

    @property
    def depends_on_source(self) -> bool:
        """Whether two ranks' counts for the same layer and microbatch differ (per-rank draws or
        logs); zipf, hot-experts and force-balanced give every rank the same."""
        return self.kind in ("uniform", "dirichlet", "replay")

    @property
    def varies_per_iteration(self) -> bool:
        """Whether the counts differ between iterations (a fresh draw, a replayed log, or drift)."""
        return self.kind in ("uniform", "replay") or self.drift_per_iteration > 0

    def shares(self, experts: int, *, layer: int, iteration: int = 0, source: int = 0) -> np.ndarray:
        """The expected share of each expert (sums to 1) for the share-based models."""
        if self.kind == "zipf":
            by_rank = 1.0 / np.arange(1, experts + 1) ** self.params[0]
            shares = np.empty(experts)
            shares[self._permutation(experts, layer, iteration)] = by_rank / by_rank.sum()
            return shares
        if self.kind == "dirichlet":
            rng = self._rng("dirichlet", layer, source)
            return rng.dirichlet(np.full(experts, self.params[0]))
        if self.kind == "hot-experts":
            hot, p = int(self.params[0]), self.params[1]
            hot = min(hot, experts)
            shares = np.full(experts, (1 - p) / (experts - hot) if experts > hot else 0.0)
            shares[self._permutation(experts, layer, iteration)[:hot]] = p / hot if experts > hot else 1 / hot
            return shares / shares.sum()
        raise ImbalanceError(f"{self.kind} has no fixed shares")

    def _replayed(self, experts, tokens, topk, layer, microbatch, iteration, source) -> np.ndarray:
        path = self.trace.replace("{rank}", str(source))
        if path not in self._tables:
            self._tables[path] = _load_trace(path, source)
        table = self._tables[path]
        iterations = sorted({k[2] for k in table})
        if not iterations:
            raise ImbalanceError(f"replay: the log of rank {source} has no routing lines")
        it = iterations[iteration % len(iterations)]
        key = (layer, microbatch, it)
        if key not in table:
            raise ImbalanceError(f"replay: rank {source}'s log has no layer {layer} microbatch {microbatch}; "
                                 "replay a run of the same model and batch shape")
        counts = np.asarray(table[key], dtype=np.int64)
        if len(counts) != experts or counts.sum() != tokens * topk or counts.max(initial=0) > tokens:
            raise ImbalanceError(f"replay: rank {source}'s logged routing ({len(counts)} experts, "
                                 f"{int(counts.sum())} assignments) does not fit {experts} experts x "
                                 f"{tokens} tokens x top-{topk}; replay a run of the same shape")
        return counts

    def _permutation(self, experts: int, layer: int, iteration: int) -> np.ndarray:
        """Experts in order of popularity for this layer, rotated by the drift."""
        order = self._rng("order", layer).permutation(experts)
        return np.roll(order, int(iteration * self.drift_per_iteration))

    def _rng(self, *key) -> np.random.Generator:
        digest = hashlib.sha256(repr((self.seed, self.kind, self.params, key)).encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _load_trace(path: str, source: int) -> dict[tuple[int, int, int], list[int]]:
    """(layer, microbatch, iteration) -> routed per expert, from rank `source`'s log at `path`."""
    import json

    table = {}
    try:
        with open(path) as handle:
            for line in handle:
                row = json.loads(line)
                if row.get("routed_per_expert"):
                    table[(row["layer"], row["microbatch"], row["iteration"])] = row["routed_per_expert"]
    except (OSError, ValueError) as err:
        raise ImbalanceError(f"replay: cannot read rank {source}'s routing log {path} ({err})") from None
    return table


def apportion(shares: np.ndarray, total: int, cap: int) -> np.ndarray:
    """Integers summing to `total`, each <= `cap`, proportional to `shares` (largest remainder; what a
    cap cuts off is spread over the others in proportion). Needs total <= cap * len(shares)."""
    shares = np.asarray(shares, dtype=np.float64)
    n = len(shares)
    if total > cap * n:
        raise ImbalanceError(f"{total} assignments cannot fit {n} experts of at most {cap} each")
    out = np.zeros(n, dtype=np.int64)
    free = np.ones(n, dtype=bool)
    left = total
    while left > 0:
        w = np.where(free, shares, 0.0)
        if w.sum() <= 0:
            w = free.astype(np.float64)
        ideal = w / w.sum() * left
        take = np.minimum(np.floor(ideal).astype(np.int64), cap - out)
        short = left - int(take.sum())
        if short > 0:  # largest remainders first, among experts with room
            room = (out + take) < cap
            order = np.lexsort((np.arange(n), -(ideal - np.floor(ideal))))
            for i in order:
                if short == 0:
                    break
                if room[i] and free[i]:
                    take[i] += 1
                    short -= 1
        out += take
        left = total - int(out.sum())
        free &= out < cap
    return out


def _capped_multinomial(rng: np.random.Generator, total: int, p: np.ndarray, cap: int) -> np.ndarray:
    counts = rng.multinomial(total, p).astype(np.int64)
    extra = int(np.maximum(counts - cap, 0).sum())
    if extra:  # a token's experts are distinct: move the excess to experts with room
        counts = np.minimum(counts, cap)
        counts += _fill(cap - counts, extra)
    return counts


def _fill(room: np.ndarray, extra: int) -> np.ndarray:
    add = np.zeros_like(room)
    for i in np.argsort(-room, kind="stable"):
        if extra == 0:
            break
        step = min(int(room[i]), extra)
        add[i], extra = step, extra - step
    return add


def routing_map(counts: np.ndarray, tokens: int, topk: int) -> np.ndarray:
    """A bool [tokens, experts] map with `topk` distinct experts per token and column sums `counts`
    (feasible whenever counts sum to tokens * topk and none exceeds tokens).

    The assignments, expert by expert, are dealt to the tokens in turn: assignment j goes to token
    j mod tokens. Each token then gets exactly `topk` of them, and an expert's run of at most `tokens`
    consecutive assignments never reaches one token twice. Vectorized: it runs in every router call of
    a modelled run, on the host, where the real job's top-k is a GPU kernel (a per-token loop cost
    18-23 ms per call for 2048 tokens on the 2-core VM, which made a modelled MoE iteration
    host-bound)."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.sum() != tokens * topk or (counts > tokens).any() or (counts < 0).any():
        raise ImbalanceError(f"counts {counts.tolist()} do not fit {tokens} tokens x top-{topk}")
    out = np.zeros((tokens, len(counts)), dtype=bool)
    expert_of_assignment = np.repeat(np.arange(len(counts)), counts)
    out[np.arange(tokens * topk) % tokens, expert_of_assignment] = True
    return out


def _example(kind: str) -> str:
    return {"zipf": "zipf(1.2)", "dirichlet": "dirichlet(0.5)", "hot-experts": "hot-experts(2, 0.5)"}.get(
        kind, kind)
