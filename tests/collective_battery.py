"""The collective battery shared by the prism backend tests (one process, and several gloo processes).

A `Case` issues one operation (or a short sequence) the way megatron-core / deepspeed do, on one group,
with inputs derived from the caller's virtual rank. `check` compares what came back with the value the
documented semantics give (module docstrings of prism_megatron/comm/ghost.py and backend.py), computed
here from the inputs alone, never by calling the backend again; `events` lists the `CommEvent`s the call
must record, with bytes in nccl-tests' "size" convention (events.py). `run_battery` runs every case on
every group this process is a member of and returns plain data, so a parent process can check the
results of all real members side by side (`worker` is the entry point of those processes).

Random-policy ghost data cannot be predicted value by value: it is checked for its documented
distribution (sums/max/products of iid N(0, 1)) and, across real members, for being identical.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from prism_megatron.comm.backend import register_prism_backend
from prism_megatron.comm.ghost import GhostPolicy
from prism_megatron.comm.session import PhysicalWorld, VirtualSession

POLICIES = ("mirror", "zeros", "random")
SEED = 7
K = 1024
"""Elements per slot: enough for the distribution checks of random ghost data (5-sigma bounds)."""
H = 2
"""Row width of all-to-all payloads: ghost slots of another length are tiled row by row."""
REPEATS = 8
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
_OFFSETS = torch.tensor([0.0, 100.0, -100.0, 0.5]).repeat(K // 4)


# -- the group as the documented semantics see it --------------------------------------------------

@dataclass(frozen=True)
class GroupView:
    """One group seen from one real member: who is real, who is a ghost, whom each ghost mirrors."""

    members: tuple[int, ...]
    sandboxes: tuple[int, ...]
    me: int
    world_size: int

    @property
    def n(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def real(self) -> list[int]:
        return [g for g, v in enumerate(self.members) if v in self.sandboxes]

    @property
    def ghosts(self) -> list[int]:
        return [g for g, v in enumerate(self.members) if v not in self.sandboxes]

    @property
    def r(self) -> int:
        return len(self.real)

    @property
    def dim(self) -> str:
        return "world" if self.n == self.world_size else "other"

    def source(self, g: int) -> int:
        """Group rank whose data slot g holds under mirror: ghost j copies real member j mod r."""
        if g in self.real:
            return g
        return self.real[self.ghosts.index(g) % self.r]


# -- inputs: functions of the contributing virtual rank ---------------------------------------------

def data(v: int, salt: int = 0, k: int = K) -> torch.Tensor:
    """Member v's float data; a quarter of the elements at +100, a quarter at -100 (MAX/MIN winners)."""
    return (v + 1 + 0.25 * salt + _OFFSETS[:k] + torch.arange(k) / 1024).float()


def factor(v: int) -> torch.Tensor:
    """PRODUCT input: magnitudes near 1, alternating signs."""
    signs = torch.tensor([1.0, -1.0]).repeat(K // 2)
    return (signs * (1 + (v + 1) / 32)).float()


def ints(v: int) -> torch.Tensor:
    return torch.arange(K, dtype=torch.int64) % 5 + v


def a2a_rows(src: int, dst: int) -> int:
    """Uneven all-to-all split (0..3 rows, empty splits included) from src to dst."""
    return (src + 2 * dst) % 4


def a2a_payload(src: int, dst: int, rows: Optional[int] = None) -> torch.Tensor:
    rows = a2a_rows(src, dst) if rows is None else rows
    return (1000.0 * src + 10 * dst + torch.arange(rows * H).view(rows, H) / 2).float()


def obj(v: int) -> dict:
    return {"v": v, "pad": "x" * (3 * v)}  # sizes differ: the padded-bytes path of all_gather_object


# -- checks -----------------------------------------------------------------------------------------

def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def assert_normal(x: torch.Tensor, var: float, what: str) -> None:
    """x looks like iid N(0, var): mean and std within 5 standard errors."""
    x = x.double().reshape(-1)
    assert torch.isfinite(x).all(), f"{what}: not finite"
    n = x.numel()
    mean, std = x.mean().item(), x.std().item()
    assert abs(mean) < 5 * (var / n) ** 0.5, f"{what}: mean {mean:.4f} is not ~0 (var {var}, n {n})"
    assert abs(std / var ** 0.5 - 1) < 5 / (2 * n) ** 0.5 + 0.01, \
        f"{what}: std {std:.4f} is not ~{var ** 0.5:.4f} (n {n})"


def assert_fraction(mask: torch.Tensor, p: float, what: str) -> None:
    frac, n = mask.double().mean().item(), mask.numel()
    assert abs(frac - p) < 5 * (p * (1 - p) / n) ** 0.5, f"{what}: fraction {frac:.3f} is not ~{p}"


def check_reduction(got: torch.Tensor, reals: list[torch.Tensor], op: str, n: int, policy: str,
                    what: str) -> None:
    """`got` against the reduction over `reals` (the real members' inputs) with n - r ghosts folded in."""
    stacked = torch.stack([t.double() for t in reals])
    r, ghosts = len(reals), n - len(reals)
    if not got.dtype.is_floating_point:  # integers are always mirrored
        assert op == "sum"
        assert torch.equal(got, stacked.long().sum(0) * n // r), f"{what}: int64 SUM is not floor(n/r * sum)"
        return
    total, high, low, prod = stacked.sum(0), stacked.max(0).values, stacked.min(0).values, stacked.prod(0)
    if policy == "mirror" or ghosts == 0:
        scale = n / r
        want = {"sum": total * scale, "avg": total / r, "max": high, "min": low,
                "product": prod ** scale if scale.is_integer() else prod.abs() ** scale}[op]
        return assert_close(got, want, what)
    if policy == "zeros":
        want = {"sum": total, "avg": total / n, "max": high.clamp(min=0), "min": low.clamp(max=0),
                "product": torch.zeros_like(prod)}[op]
        return assert_close(got, want, what)
    got = got.double()
    if op == "sum":
        assert_normal(got - total, ghosts, f"{what}: ghost part of a random SUM")
    elif op == "avg":
        assert_normal(got * n - total, ghosts, f"{what}: ghost part of a random AVG * n")
    elif op == "product":
        ratio = got / prod
        assert torch.isfinite(ratio).all() and (ratio != 0).all(), f"{what}: ghost product not finite/nonzero"
        assert_fraction(ratio < 0, 0.5, f"{what}: sign of the product of {ghosts} ghost N(0, 1)")
    else:  # the extreme of `ghosts` iid N(0, 1) has CDF Phi(t) ** ghosts
        sign = 1.0 if op == "max" else -1.0
        real = high if op == "max" else low
        assert (sign * got >= sign * real - 1e-4).all(), f"{what}: ghosts made the {op} less extreme"
        real_wins, ghosts_win = sign * real > 50, sign * real < -50
        assert_close(got[real_wins], real[real_wins], f"{what}: elements the real data wins")
        median = torch.special.ndtri(torch.tensor(0.5 ** (1 / ghosts), dtype=torch.float64))
        assert_fraction(sign * got[ghosts_win] < median, 0.5, f"{what}: median of the {op} of {ghosts} N(0, 1)")


def check_slots(slots: list[torch.Tensor], view: GroupView, policy: str, value_of: Callable[[int], torch.Tensor],
                what: str) -> None:
    """Gathered slots: real members' data exactly; ghost slots mirror / zeros / N(0, 1), distinct."""
    assert len(slots) == view.n, f"{what}: {len(slots)} slots for {view.n} members"
    effective = "mirror" if not slots[0].dtype.is_floating_point else policy
    for g, slot in enumerate(slots):
        label = f"{what}: slot {g} (virtual rank {view.members[g]}, {'real' if g in view.real else 'ghost'})"
        if g in view.real or effective == "mirror":
            want = value_of(view.members[view.source(g)])
            assert slot.dtype == want.dtype and torch.equal(slot, want), f"{label}: {slot[:4]} != {want[:4]}"
        elif effective == "zeros":
            assert not slot.any(), f"{label}: not zeros"
        else:
            assert_normal(slot, 1.0, label)
    if effective == "random" and len(view.ghosts) > 1:
        a, b = view.ghosts[:2]
        assert not torch.equal(slots[a], slots[b]), f"{what}: ghosts {a} and {b} drew the same data"


def check_filled(got: torch.Tensor, policy: str, mirror_value: torch.Tensor, what: str) -> None:
    """A buffer a ghost filled (broadcast/scatter root, p2p peer): the policy's data."""
    if policy == "mirror" or not got.dtype.is_floating_point:
        assert torch.equal(got, mirror_value), f"{what}: {got[:4]} != {mirror_value[:4]}"
    elif policy == "zeros":
        assert not got.any(), f"{what}: not zeros"
    else:
        assert_normal(got, 1.0, what)


def tile_rows(source: torch.Tensor, rows: int) -> torch.Tensor:
    """Documented mirror of a ghost's all-to-all slot: the source's rows repeated/truncated."""
    if source.shape[0] == 0:
        return torch.zeros(rows, *source.shape[1:])
    return source[torch.arange(rows) % source.shape[0]]


def check_a2a(outs: list[torch.Tensor], view: GroupView, policy: str, what: str) -> None:
    me = view.me
    for g, out in enumerate(outs):
        v = view.members[g]
        label = f"{what}: slot {g} (virtual rank {v})"
        assert out.shape == (a2a_rows(v, me), H), f"{label}: shape {tuple(out.shape)}"
        if g in view.real:
            assert torch.equal(out, a2a_payload(v, me)), f"{label}: {out} != {a2a_payload(v, me)}"
        elif policy == "mirror":
            want = tile_rows(a2a_payload(view.members[view.source(g)], me), out.shape[0])
            assert torch.equal(out, want), f"{label}: {out} != tiled mirror {want}"
        elif policy == "zeros":
            assert not out.any(), f"{label}: not zeros"
        else:
            assert torch.isfinite(out).all() and (out != 0).all(), f"{label}: not N(0, 1) draws: {out}"


def ev(op: str, nbytes: int, dtype: str = "float32", peer: Optional[int] = None,
       reduce_op: Optional[str] = None) -> dict:
    return {"op": op, "nbytes": nbytes, "dtype": dtype, "peer": peer, "reduce_op": reduce_op}


# -- the cases --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ctx:
    group: dist.ProcessGroup
    view: GroupView


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Ctx], Any]
    check: Callable[[GroupView, str, Any], None]
    events: Optional[Callable[[GroupView], list[dict]]]
    """Expected events; None for object collectives, whose sizes come from torch's pickling."""
    applies: Callable[[GroupView], bool] = lambda view: True
    same_on_all: bool = False
    """Every real member must get a bitwise identical result."""
    known_bug: Callable[[GroupView, str], Optional[str]] = lambda view, policy: None
    """Why the result check is expected to fail for (view, policy), while the backend has that bug."""
    known_event_bug: Callable[[GroupView], Optional[str]] = lambda view: None
    """Why the event check is expected to fail on this member."""


CASES: dict[str, Case] = {}


def case(name: str, events, **kw):
    def register(run):
        check = kw.pop("check")
        CASES[name] = Case(name, run, check, events, **kw)
        return run
    return register


def _has_ghosts(view: GroupView) -> bool:
    return bool(view.ghosts)


def _reduction_case(op: str) -> None:
    make = factor if op == "product" else data

    def run(ctx):
        t = make(ctx.view.me)
        dist.all_reduce(t, op=REDUCE_OPS[op], group=ctx.group)
        return t

    def check(view, policy, got):
        check_reduction(got, [make(view.members[g]) for g in view.real], op, view.n, policy, f"all_reduce {op}")

    case(f"all_reduce_{op}", lambda view: [ev("all_reduce", K * 4, reduce_op=op)], check=check,
         same_on_all=True)(run)


for _op in REDUCE_OPS:
    _reduction_case(_op)


@case("all_reduce_sum_int64", lambda view: [ev("all_reduce", K * 8, "int64", reduce_op="sum")],
      same_on_all=True,
      check=lambda view, policy, got: check_reduction(
          got, [ints(view.members[g]) for g in view.real], "sum", view.n, policy, "int64 all_reduce"))
def _(ctx):
    t = ints(ctx.view.me)
    dist.all_reduce(t, group=ctx.group)
    return t


@case("all_reduce_coalesced", lambda view: [ev("all_reduce", K * 4, reduce_op="max"),
                                             ev("all_reduce", K // 2 * 4, reduce_op="max")],
      same_on_all=True,
      check=lambda view, policy, got: [check_reduction(
          t, [data(view.members[g], i)[:len(t)] for g in view.real], "max", view.n, policy, f"coalesced {i}")
          for i, t in enumerate(got)])
def _(ctx):
    ts = [data(ctx.view.me, 0), data(ctx.view.me, 1)[:K // 2].clone()]
    dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX, group=ctx.group)
    return ts


@case("repeated_all_reduce_sum", lambda view: [ev("all_reduce", K * 4, reduce_op="sum")] * REPEATS,
      same_on_all=True, check=lambda view, policy, got: _check_repeated(view, policy, got))
def _(ctx):
    t = data(ctx.view.me, 3)
    for _ in range(REPEATS):
        dist.all_reduce(t, group=ctx.group)
    return t


def _check_repeated(view: GroupView, policy: str, got: torch.Tensor) -> None:
    """After the first call every real member holds the same t, so each later call sums r copies of it:
    mirror t <- n * t, zeros t <- r * t, random t <- r * t + sqrt(g) Z (fresh Z per call)."""
    total = sum(data(view.members[g], 3).double() for g in view.real)
    n, r, ghosts = view.n, view.r, view.n - view.r
    assert torch.isfinite(got).all(), "repeated all_reduce overflowed"
    if policy == "mirror" or ghosts == 0:
        return assert_close(got, total * (n / r) * n ** (REPEATS - 1), "repeated mirror SUM")
    deterministic = total * r ** (REPEATS - 1)
    if policy == "zeros":
        return assert_close(got, deterministic, "repeated zeros SUM")
    var = ghosts * sum(r ** (2 * i) for i in range(REPEATS))
    assert_normal(got.double() - deterministic, var, "repeated random SUM: accumulated ghost noise")


@case("reduce_sum_real_root", lambda view: [ev("reduce", K * 4, reduce_op="sum")],
      check=lambda view, policy, got: got is None or check_reduction(
          got, [data(view.members[g], 4) for g in view.real], "sum", view.n, policy, "reduce at a real root"))
def _(ctx):
    t, root = data(ctx.view.me, 4), ctx.view.real[-1]
    dist.reduce(t, group_dst=root, group=ctx.group)
    return t if root == ctx.view.rank else None


@case("reduce_max_ghost_root", lambda view: [ev("reduce", K * 4, reduce_op="max")], applies=_has_ghosts,
      check=lambda view, policy, got: None)  # the result lives on a ghost: only the event is checked
def _(ctx):
    dist.reduce(data(ctx.view.me, 5), group_dst=ctx.view.ghosts[0], op=dist.ReduceOp.MAX, group=ctx.group)


def _reduce_scatter_case(name: str, op: str, tensor_form: bool) -> None:
    def run(ctx):
        inputs = [data(ctx.view.me, 10 + k) for k in range(ctx.view.n)]
        out = torch.empty(K)
        if tensor_form:
            dist.reduce_scatter_tensor(out, torch.cat(inputs), op=REDUCE_OPS[op], group=ctx.group)
        else:
            dist.reduce_scatter(out, inputs, op=REDUCE_OPS[op], group=ctx.group)
        return out

    def check(view, policy, got):
        reals = [data(view.members[g], 10 + view.rank) for g in view.real]
        check_reduction(got, reals, op, view.n, policy, name)

    case(name, lambda view: [ev("reduce_scatter", view.n * K * 4, reduce_op=op)], check=check)(run)


_reduce_scatter_case("reduce_scatter_list_sum", "sum", False)
_reduce_scatter_case("reduce_scatter_list_max", "max", False)
_reduce_scatter_case("reduce_scatter_tensor_sum", "sum", True)
_reduce_scatter_case("reduce_scatter_tensor_avg", "avg", True)


@case("all_gather_list", lambda view: [ev("all_gather", view.n * K * 4)], same_on_all=True,
      check=lambda view, policy, got: check_slots(got, view, policy, lambda v: data(v, 20), "all_gather"))
def _(ctx):
    outs = [torch.empty(K) for _ in range(ctx.view.n)]
    dist.all_gather(outs, data(ctx.view.me, 20), group=ctx.group)
    return outs


@case("all_gather_into_tensor", lambda view: [ev("all_gather", view.n * K * 4)], same_on_all=True,
      check=lambda view, policy, got: check_slots(
          list(got.chunk(view.n)), view, policy, lambda v: data(v, 21), "all_gather_into_tensor"))
def _(ctx):
    out = torch.empty(ctx.view.n * K)
    dist.all_gather_into_tensor(out, data(ctx.view.me, 21), group=ctx.group)
    return out


@case("all_gather_into_tensor_int64", lambda view: [ev("all_gather", view.n * K * 8, "int64")],
      same_on_all=True,
      check=lambda view, policy, got: check_slots(list(got.chunk(view.n)), view, policy, ints, "int64 all_gather"))
def _(ctx):
    out = torch.empty(ctx.view.n * K, dtype=torch.int64)
    dist.all_gather_into_tensor(out, ints(ctx.view.me), group=ctx.group)
    return out


def _check_in_place(slots: list[torch.Tensor], view: GroupView, policy: str, what: str) -> None:
    """In-place gather of shards: real slots hold the new shards; under mirror each ghost keeps its own."""
    if policy != "mirror":
        return check_slots(slots, view, policy, lambda v: data(v, 92), what)
    for g, slot in enumerate(slots):
        want = data(view.members[g], 92 if g in view.real else 91)
        assert torch.equal(slot, want), \
            f"{what}: slot {g} ({'real: its new shard' if g in view.real else 'ghost: keeps its old shard'})"


@case("all_gather_into_tensor_in_place", lambda view: [ev("all_gather", view.n * K * 4)], same_on_all=True,
      check=lambda view, policy, got: _check_in_place(list(got.chunk(view.n)), view, policy,
                                                      "in-place all_gather_into_tensor"))
def _(ctx):
    """The distributed optimizer's parameter all-gather: the input is this rank's shard of the output."""
    out = torch.cat([data(v, 91) for v in ctx.view.members])  # every member's last known shard
    shard = out.chunk(ctx.view.n)[ctx.view.rank]
    shard.copy_(data(ctx.view.me, 92))
    dist.all_gather_into_tensor(out, shard, group=ctx.group)
    return out


@case("all_gather_list_in_place", lambda view: [ev("all_gather", view.n * K * 4)], same_on_all=True,
      check=lambda view, policy, got: _check_in_place(got, view, policy, "in-place all_gather (list)"))
def _(ctx):
    """The same with the list form (deepspeed ZeRO's fallback, older megatron)."""
    outs = [data(v, 91) for v in ctx.view.members]
    outs[ctx.view.rank].copy_(data(ctx.view.me, 92))
    dist.all_gather(outs, outs[ctx.view.rank], group=ctx.group)
    return outs


@case("all_gather_coalesced", lambda view: [ev("all_gather", view.n * K * 4), ev("all_gather", view.n * K * 2)],
      same_on_all=True,
      check=lambda view, policy, got: [check_slots(outs, view, policy, lambda v, i=i: data(v, 22 + i)[:K // (i + 1)],
                                                   f"all_gather_coalesced {i}") for i, outs in enumerate(got)])
def _(ctx):
    inputs = [data(ctx.view.me, 22), data(ctx.view.me, 23)[:K // 2].clone()]
    outs = [[torch.empty_like(t) for _ in range(ctx.view.n)] for t in inputs]
    dist.all_gather_coalesced(outs, inputs, group=ctx.group)
    return outs


@case("broadcast_real_root", lambda view: [ev("broadcast", K * 4)], same_on_all=True,
      check=lambda view, policy, got: assert_close(got, data(view.members[view.real[-1]], 30), "broadcast"))
def _(ctx):
    t = data(ctx.view.me, 30)
    dist.broadcast(t, group_src=ctx.view.real[-1], group=ctx.group)
    return t


def _ghost_root(view: GroupView) -> int:
    """The second ghost when there is one, so that a mirror with r > 1 copies real member 1, not 0."""
    return view.ghosts[min(1, len(view.ghosts) - 1)]


@case("broadcast_ghost_root", lambda view: [ev("broadcast", K * 4)], same_on_all=True, applies=_has_ghosts,
      check=lambda view, policy, got: check_filled(
          got, policy, data(view.members[view.source(_ghost_root(view))], 31), "broadcast from a ghost"))
def _(ctx):
    t = data(ctx.view.me, 31)
    dist.broadcast(t, group_src=_ghost_root(ctx.view), group=ctx.group)
    return t


@case("broadcast_ghost_root_int64", lambda view: [ev("broadcast", K * 8, "int64")], same_on_all=True,
      applies=_has_ghosts,
      check=lambda view, policy, got: check_filled(
          got, policy, ints(view.members[view.source(_ghost_root(view))]), "int64 broadcast from a ghost"))
def _(ctx):
    t = ints(ctx.view.me)
    dist.broadcast(t, group_src=_ghost_root(ctx.view), group=ctx.group)
    return t


@case("gather_real_root", lambda view: [ev("gather", view.n * K * 4)],
      check=lambda view, policy, got: got is None or check_slots(got, view, policy, lambda v: data(v, 40), "gather"))
def _(ctx):
    root = ctx.view.real[-1]
    outs = [torch.empty(K) for _ in range(ctx.view.n)] if root == ctx.view.rank else None
    dist.gather(data(ctx.view.me, 40), outs, group_dst=root, group=ctx.group)
    return outs


@case("gather_ghost_root", lambda view: [ev("gather", view.n * K * 4)], applies=_has_ghosts,
      check=lambda view, policy, got: assert_close(got, data(view.me, 41), "gather to a ghost kept the input"))
def _(ctx):
    t = data(ctx.view.me, 41)
    dist.gather(t, None, group_dst=ctx.view.ghosts[0], group=ctx.group)
    return t


@case("scatter_real_root", lambda view: [ev("scatter", view.n * K * 4)],
      check=lambda view, policy, got: assert_close(got, data(view.members[view.real[0]], 50 + view.rank), "scatter"))
def _(ctx):
    root = ctx.view.real[0]
    inputs = [data(ctx.view.me, 50 + k) for k in range(ctx.view.n)] if root == ctx.view.rank else None
    out = torch.empty(K)
    dist.scatter(out, inputs, group_src=root, group=ctx.group)
    return out


@case("scatter_ghost_root", lambda view: [ev("scatter", view.n * K * 4)], applies=_has_ghosts,
      check=lambda view, policy, got: check_filled(  # mirror keeps the receiver's buffer (backend.py)
          got, policy, data(view.me, 51), "scatter from a ghost"))
def _(ctx):
    out = data(ctx.view.me, 51)
    dist.scatter(out, None, group_src=ctx.view.ghosts[0], group=ctx.group)
    return out


def _a2a_in_bytes(view: GroupView) -> int:
    return sum(a2a_rows(view.me, v) for v in view.members) * H * 4


@case("all_to_all_list_uneven", lambda view: [ev("all_to_all", _a2a_in_bytes(view))],
      check=lambda view, policy, got: check_a2a(got, view, policy, "all_to_all"))
def _(ctx):
    me, members = ctx.view.me, ctx.view.members
    outs = [torch.empty(a2a_rows(v, me), H) for v in members]
    dist.all_to_all(outs, [a2a_payload(me, v) for v in members], group=ctx.group)
    return outs


@case("all_to_all_single_uneven", lambda view: [ev("all_to_all", _a2a_in_bytes(view))],
      check=lambda view, policy, got: check_a2a(got, view, policy, "all_to_all_single"))
def _(ctx):
    me, members = ctx.view.me, ctx.view.members
    out_splits, in_splits = [a2a_rows(v, me) for v in members], [a2a_rows(me, v) for v in members]
    out = torch.empty(sum(out_splits), H)
    dist.all_to_all_single(out, torch.cat([a2a_payload(me, v) for v in members]), out_splits, in_splits,
                           group=ctx.group)
    return list(out.split(out_splits))


@case("all_to_all_single_even", lambda view: [ev("all_to_all", view.n * 2 * H * 4)],
      check=lambda view, policy, got: check_a2a_even(got, view, policy))
def _(ctx):
    out = torch.empty(ctx.view.n * 2, H)
    dist.all_to_all_single(out, torch.cat([a2a_payload(ctx.view.me, v, 2) for v in ctx.view.members]),
                           group=ctx.group)
    return out


def check_a2a_even(got: torch.Tensor, view: GroupView, policy: str) -> None:
    for g, slot in enumerate(got.chunk(view.n)):
        if g in view.real or policy == "mirror":
            want = a2a_payload(view.members[view.source(g)], view.me, 2)
            assert torch.equal(slot, want), f"all_to_all_single even: slot {g}: {slot} != {want}"
        elif policy == "zeros":
            assert not slot.any(), f"all_to_all_single even: ghost slot {g} not zeros"


@case("barrier", lambda view: [ev("barrier", 0, "none")], check=lambda view, policy, got: None)
def _(ctx):
    dist.barrier(group=ctx.group)


@case("async_ops", lambda view: [ev("all_reduce", K * 4, reduce_op="sum"),
                                 ev("reduce_scatter", view.n * K * 4, reduce_op="sum"),
                                 ev("all_gather", view.n * K * 4)],
      check=lambda view, policy, got: _check_async(view, policy, got))
def _(ctx):
    """DDP/distributed-optimizer overlap: async collectives, waited on and through their futures."""
    me, n, group = ctx.view.me, ctx.view.n, ctx.group
    t, rs_out, ag_out = data(me, 60), torch.empty(K), torch.empty(n * K)
    works = [dist.all_reduce(t, group=group, async_op=True),
             dist.reduce_scatter_tensor(rs_out, torch.cat([data(me, 61 + k) for k in range(n)]), group=group,
                                        async_op=True),
             dist.all_gather_into_tensor(ag_out, data(me, 62), group=group, async_op=True)]
    for work in works:
        work.wait()
    futures = [work.get_future().wait() for work in works]
    return {"tensors": [t, rs_out, ag_out], "futures": futures, "done": [w.is_completed() for w in works]}


def _check_async(view: GroupView, policy: str, got: dict) -> None:
    t, rs_out, ag_out = got["tensors"]
    assert all(got["done"]), "a waited work is not completed"
    for tensor, fut in zip(got["tensors"], got["futures"]):
        assert isinstance(fut, list) and torch.equal(fut[0], tensor), "get_future().wait() is not the output"
    check_reduction(t, [data(view.members[g], 60) for g in view.real], "sum", view.n, policy, "async all_reduce")
    check_reduction(rs_out, [data(view.members[g], 61 + view.rank) for g in view.real], "sum", view.n, policy,
                    "async reduce_scatter_tensor")
    check_slots(list(ag_out.chunk(view.n)), view, policy, lambda v: data(v, 62), "async all_gather_into_tensor")


# -- point to point ---------------------------------------------------------------------------------

def _two_ghosts(view: GroupView) -> bool:
    return len(view.ghosts) >= 2


def _p2p_ghost_events(view: GroupView) -> list[dict]:
    a, b = (view.members[g] for g in view.ghosts[:2])
    return [ev(op, K * 4, peer=p) for op, p in
            [("recv", a), ("send", b), ("recv", a), ("recv", b), ("send", a), ("recv", b), ("send", b), ("recv", a)]]


@case("p2p_ghost_peers", _p2p_ghost_events, applies=_two_ghosts,
      check=lambda view, policy, got: _check_p2p_ghosts(view, policy, got))
def _(ctx):
    """A pipeline stage between ghost stages A (previous) and B (next): recv, send, isend/irecv, batch."""
    a, b, me, group = *ctx.view.ghosts[:2], ctx.view.me, ctx.group
    got = [torch.zeros(K, requires_grad=True) for _ in range(5)]
    dist.recv(got[0], group_src=a, group=group)                         # before anything was sent
    dist.send(data(me, 70), group_dst=b, group=group)
    dist.recv(got[1], group_src=a, group=group)                         # mirror: what we sent to B
    dist.recv(got[2], group_src=b, group=group)                         # nothing sent the other way
    dist.isend(data(me, 71), group_dst=a, group=group).wait()
    dist.irecv(got[3], group_src=b, group=group).wait()                 # mirror: what we sent to A
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(me, 72), group=group, group_peer=b),
                                    dist.P2POp(dist.irecv, got[4], group=group, group_peer=a)])  # mirror: 70
    for work in works:
        work.wait()
    return [{"value": t.detach(), "requires_grad": t.requires_grad, "is_leaf": t.is_leaf} for t in got]


def _check_p2p_ghosts(view: GroupView, policy: str, got: list[dict]) -> None:
    for i, item in enumerate(got):
        assert item["requires_grad"] and item["is_leaf"], f"recv {i} changed the buffer's autograd state"
    # Mirror returns the *first* tensor sent the other way: 72 went to B after 70 did.
    sent = {1: data(view.me, 70), 3: data(view.me, 71), 4: data(view.me, 70)}
    for i, item in enumerate(got):
        value = item["value"]
        if policy == "mirror" and i in sent:
            assert torch.equal(value, sent[i]), f"recv {i} from a ghost under mirror: not the tensor sent the other way"
        elif policy == "zeros":
            assert not value.any(), f"recv {i} from a ghost under zeros: not zeros"
        else:  # random, or mirror before anything was sent the other way: seeded N(0, 1)
            assert_normal(value, 1.0, f"recv {i} from a ghost under {policy}")
    if policy != "zeros":
        assert not torch.equal(got[0]["value"], got[2]["value"]), "two recvs from ghosts drew the same data"


@case("p2p_ghost_three_peers", lambda view: [ev("send", K * 4, peer=view.members[view.ghosts[i]]) for i in (0, 1, 0)]
      + [ev("recv", K * 4, peer=view.members[view.ghosts[2]])],
      applies=lambda view: len(view.ghosts) >= 3,
      check=lambda view, policy, got: check_filled(got, policy, data(view.me, 73).view(-1, 2),
                                                   "recv from a third ghost peer"))
def _(ctx):
    a, b, c = ctx.view.ghosts[:3]
    for peer, salt in ((a, 73), (b, 74), (a, 75)):  # a shape of its own: no other case's sends count
        dist.send(data(ctx.view.me, salt).view(-1, 2), group_dst=peer, group=ctx.group)
    got = torch.empty(K // 2, 2)
    dist.recv(got, group_src=c, group=ctx.group)  # documented: the first tensor sent the other way, 73
    return got


@case("p2p_ghost_recv_int64_first", lambda view: [ev("recv", 3 * 8, "int64", peer=view.members[view.ghosts[0]])],
      applies=_two_ghosts,
      check=lambda view, policy, got: assert_close(got, torch.zeros(3, dtype=torch.int64),
                                                   "int recv with nothing to mirror is zeros"))
def _(ctx):
    """megatron's variable_seq_lengths exchange: a stage first receives the int64 shape of its input."""
    shape = torch.zeros(3, dtype=torch.int64)
    dist.recv(shape, group_src=ctx.view.ghosts[0], group=ctx.group)
    return shape


@case("p2p_ghost_recv_int64_after_send", lambda view: [
    ev("send", 4 * 8, "int64", peer=view.members[view.ghosts[1]]),
    ev("recv", 4 * 8, "int64", peer=view.members[view.ghosts[0]])], applies=_two_ghosts,
      check=lambda view, policy, got: check_filled(got, policy, torch.arange(4) + view.me, "int64 recv from a ghost"))
def _(ctx):
    dist.send(torch.arange(4) + ctx.view.me, group_dst=ctx.view.ghosts[1], group=ctx.group)
    got = torch.zeros(4, dtype=torch.int64)
    dist.recv(got, group_src=ctx.view.ghosts[0], group=ctx.group)
    return got


def _ring(view: GroupView) -> tuple[int, int, int]:
    """(my index among the real members, next real member, previous real member), group ranks."""
    i = view.real.index(view.rank)
    return i, view.real[(i + 1) % view.r], view.real[(i - 1) % view.r]


def _ring_events(view: GroupView) -> list[dict]:
    i, nxt, prv = _ring(view)
    nxt, prv = view.members[nxt], view.members[prv]
    blocking = [ev("send", K * 4, peer=nxt), ev("recv", K * 4, peer=prv)]
    events = (blocking if i % 2 == 0 else blocking[::-1]) + [ev("recv", K * 4, peer=prv), ev("send", K * 4, peer=nxt),
                                                             ev("send", K * 4, peer=nxt), ev("recv", K * 4, peer=prv)]
    if view.ghosts:
        ghost = view.members[view.ghosts[0]]
        events += [ev("send", K * 2, peer=ghost), ev("recv", K * 2, peer=ghost)]
    return events


@case("p2p_real_ring", _ring_events, applies=lambda view: view.r >= 2,
      check=lambda view, policy, got: _check_ring(view, policy, got))
def _(ctx):
    """Real-to-real send/recv, isend/irecv and a batch that also talks to a ghost, round the real ring."""
    view, group = ctx.view, ctx.group
    i, nxt, prv = _ring(view)
    got = [torch.zeros(K, requires_grad=True) for _ in range(3)]
    payload = [data(view.me, 80 + s) + 1000 * view.members[nxt] for s in range(3)]
    steps = [lambda: dist.send(payload[0], group_dst=nxt, group=group),
             lambda: dist.recv(got[0], group_src=prv, group=group)]
    for step in (steps if i % 2 == 0 else steps[::-1]):  # even send first, odd receive first: no deadlock
        step()
    works = [dist.irecv(got[1], group_src=prv, group=group), dist.isend(payload[1], group_dst=nxt, group=group)]
    for work in works:
        work.wait()
    ops = [dist.P2POp(dist.isend, payload[2], group=group, group_peer=nxt),
           dist.P2POp(dist.irecv, got[2], group=group, group_peer=prv)]
    ghost_got = torch.zeros(K // 2)
    if view.ghosts:
        ops += [dist.P2POp(dist.isend, data(view.me, 83)[:K // 2].clone(), group=group, group_peer=view.ghosts[0]),
                dist.P2POp(dist.irecv, ghost_got, group=group, group_peer=view.ghosts[0])]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {"got": [t.detach() for t in got], "requires_grad": [t.requires_grad for t in got], "ghost": ghost_got}


def _check_ring(view: GroupView, policy: str, got: dict) -> None:
    _, _, prv = _ring(view)
    assert all(got["requires_grad"]), "recv changed the buffer's requires_grad"
    for s, value in enumerate(got["got"]):
        want = data(view.members[prv], 80 + s) + 1000 * view.me
        assert torch.equal(value, want), f"p2p step {s}: got {value[:3]} from the previous real member, want {want[:3]}"
    if view.ghosts and policy == "zeros":
        assert not got["ghost"].any(), "recv from a ghost under zeros: not zeros"
    elif view.ghosts:  # mirror: nothing of that shape was sent to another peer: seeded N(0, 1), as random
        assert_normal(got["ghost"], 1.0, "recv from a ghost in a batch")


# -- object collectives (run last: their byte counts come from pickling) -----------------------------

@case("all_gather_object", None, same_on_all=True,
      check=lambda view, policy, got: _check_equal(got, [obj(view.members[view.source(g)]) for g in range(view.n)],
                                                   "all_gather_object (bytes are always mirrored)"))
def _(ctx):
    out = [None] * ctx.view.n
    dist.all_gather_object(out, obj(ctx.view.me), group=ctx.group)
    return out


def _root_objects(v: int) -> list:
    return [obj(v), f"root {v}", list(range(v))]


@case("broadcast_object_list_real_root", None, same_on_all=True,
      check=lambda view, policy, got: _check_equal(got, _root_objects(view.members[view.real[-1]]),
                                                   "broadcast_object_list"))
def _(ctx):
    root = ctx.view.real[-1]
    objects = _root_objects(ctx.view.me) if ctx.view.rank == root else [None] * 3
    dist.broadcast_object_list(objects, group_src=root, group=ctx.group)
    return objects


def _check_equal(got, want, what: str) -> None:
    assert got == want, f"{what}: {got} != {want}"


OBJECT_CASES = ("all_gather_object", "broadcast_object_list_real_root")


# -- running ----------------------------------------------------------------------------------------

def views(world_size: int, sandboxes: tuple[int, ...], groups: dict[str, Optional[tuple[int, ...]]],
          me: int) -> dict[str, GroupView]:
    """This member's view of each group it belongs to (None: the world)."""
    out = {}
    for name, members in groups.items():
        members = tuple(range(world_size)) if members is None else tuple(sorted(members))
        if me in members:
            out[name] = GroupView(members, sandboxes, me, world_size)
    return out


def run_battery(policy: str, world_size: int, sandboxes: tuple[int, ...], groups: dict, physical_rank: int = 0,
                store: Optional[dist.Store] = None) -> dict:
    """Run every case on every group this process is in; return results, events, errors and log rows."""
    register_prism_backend()
    physical = PhysicalWorld(rank=physical_rank, sandbox_ranks=sandboxes, store=store,
                             timeout=timedelta(seconds=60))
    session = VirtualSession(world_size=world_size, physical=physical, policy=GhostPolicy(name=policy, seed=SEED))
    me = sandboxes[physical_rank]
    outer = store if store is not None else dist.HashStore()
    dist.init_process_group("prism", store=dist.PrefixStore("prism/", outer), rank=me, world_size=world_size,
                            pg_options=session)
    try:
        session.connect_p2p()
        pgs = {name: dist.group.WORLD if members is None else dist.new_group(sorted(members))
               for name, members in groups.items()}  # every process creates every group, in one order
        my_views = views(world_size, sandboxes, groups, me)
        captured: list = []
        session.log.listeners.append(captured.append)
        out = {"results": {}, "events": {}, "errors": {}, "rows": None}
        for objects in (False, True):
            if objects:
                out["rows"] = session.log.rows()  # the tensor cases only
            for name, view in my_views.items():
                ctx = Ctx(pgs[name], view)
                for case_ in CASES.values():
                    if (case_.name in OBJECT_CASES) != objects or not case_.applies(view):
                        continue
                    captured.clear()
                    try:
                        out["results"].setdefault(name, {})[case_.name] = case_.run(ctx)
                    except Exception:  # noqa: BLE001 - reported per case by the test
                        out["errors"].setdefault(name, {})[case_.name] = traceback.format_exc()
                    out["events"].setdefault(name, {})[case_.name] = [e._asdict() for e in captured]
        return out
    finally:
        dist.destroy_process_group()


def worker(physical_rank: int, port: int, world_size: int, sandboxes: tuple[int, ...], groups: dict,
           out_dir: str) -> None:
    """One real process of the several-process test: every policy in turn, results to out_dir/<rank>.pt."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
    try:
        results = {policy: run_battery(policy, world_size, sandboxes, groups, physical_rank,
                                       dist.PrefixStore(f"{policy}/", store)) for policy in POLICIES}
        path = os.path.join(out_dir, f"{physical_rank}.pt")
        torch.save(results, path + ".tmp")
        os.replace(path + ".tmp", path)
    except BaseException:
        with open(os.path.join(out_dir, f"{physical_rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def check_events(view: GroupView, expected: list[dict], got: list[dict], what: str) -> None:
    """The events one case recorded on one member, against the expected ones, in issue order."""
    common = {"dim": view.dim, "members": view.members, "ghosts": len(view.ghosts)}
    want = [{**e, **common} for e in expected]
    projected = [{key: e[key] for key in (*ev("", 0), *common)} for e in got]
    assert projected == want, f"{what}: recorded events\n{projected}\n!= expected\n{want}"
    seqs = [e["seq"] for e in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True, \
        f"{what}: seq numbers {seqs} are not consecutive"


def expected_rows(per_group_events: dict[str, dict[str, list[dict]]], dims: dict[str, str],
                  skip_ops: tuple[str, ...] = ()) -> list[dict]:
    """`CommLog.rows()` as the expected events of the tensor cases add up."""
    calls: dict[tuple[str, str], int] = {}
    nbytes: dict[tuple[str, str], int] = {}
    for group, by_case in per_group_events.items():
        for events in by_case.values():
            for e in events:
                if e["op"] in skip_ops:
                    continue
                key = (e["op"], dims[group])
                calls[key] = calls.get(key, 0) + 1
                nbytes[key] = nbytes.get(key, 0) + e["nbytes"]
    return [{"op": op, "dim": dim, "calls": calls[(op, dim)], "bytes": nbytes[(op, dim)]} for op, dim in sorted(calls)]


def wait_all(ctx, deadline_s: float) -> None:
    """Join a torch.multiprocessing context by a deadline; kill what is left and fail on a hang."""
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"prism worker processes still running after {deadline_s:.0f} s (a hang?)")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
