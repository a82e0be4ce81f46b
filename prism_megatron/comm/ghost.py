"""Ghost data: what a ghost member of a group contributes to a collective, by named policy.

Policies (`GhostPolicy.name`):

- ``mirror`` (default): a ghost contributes what the real members contribute. For reductions that is
  the mean of the real contributions, so a SUM over n members is ``(n / r) * sum(real)`` (exactly
  ``n * local`` with one real member) and an AVG or MAX is unchanged. For data movement (gathers,
  all-to-all, broadcast/scatter from a ghost root) ghost j copies real member ``j mod r``. A p2p recv
  from a ghost returns the first tensor of that shape and dtype this rank sent the *other* way (a
  ghost previous stage's activations look like the ones we pass on; a ghost next stage's gradients
  like the ones we pass back; the first, so our outputs never loop back into our inputs), and seeded
  N(0, 1) data before there is one. An in-place all-gather of sharded state keeps the ghosts' shards.
- ``zeros``: ghosts contribute zeros.
- ``random``: ghosts contribute seeded standard-normal values; the draws depend only on the seed,
  the group and the call's sequence number, so every real member sees the same ghost data.

Integer and bool tensors (token counts, split sizes, pickled objects of the object collectives) are
always mirrored: zeros or noise there would produce impossible sizes and unpicklable bytes.

Every fill here works in place on the caller's buffers, so the sandbox's tracked memory is what a real
rank's would be. Known limits: ``random`` allocates one temporary the size of the reduced tensor; a
PRODUCT under ``mirror`` raises the real product to the power n/r (sign lost for non-integer powers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch.distributed import ReduceOp

from prism_megatron.comm.ops import same_memory
from prism_megatron.config.schema import GHOST_POLICIES


def is_mirrored_dtype(dtype: torch.dtype) -> bool:
    """Integer/bool data (sizes, counts, object bytes) is always mirrored, whatever the policy."""
    return not (dtype.is_floating_point or dtype.is_complex)


@dataclass(frozen=True, kw_only=True)
class GhostPolicy:
    """A named ghost-data policy; see the module docstring for the semantics of each name."""

    name: str = "mirror"
    seed: int = 1234
    _factors: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """(n, dtype) -> a 0-dim tensor holding n exactly in that dtype, or None where it cannot."""

    def __post_init__(self) -> None:
        if self.name not in GHOST_POLICIES:
            raise ValueError(f"ghost policy {self.name!r} is unknown; expected one of "
                             f"{', '.join(GHOST_POLICIES)}")

    def effective(self, dtype: torch.dtype) -> str:
        return "mirror" if is_mirrored_dtype(dtype) else self.name

    def generator(self, device: torch.device, group_id: str, seq: int, salt: int = 0) -> torch.Generator:
        """A generator identical on every real member for this (group, call, salt)."""
        digest = hashlib.blake2b(f"{self.seed}/{group_id}/{seq}/{salt}".encode(), digest_size=8)
        gen = torch.Generator(device=device)
        gen.manual_seed(int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1))
        return gen

    # -- reductions ------------------------------------------------------------------------------

    def _scale(self, out: torch.Tensor, n: int, r: int) -> None:
        """`out *= n / r`: exact for every dtype with one real member."""
        if r == 1:
            self._times(out, n)
        else:
            _scale_shared(out, n, r)

    def _times(self, out: torch.Tensor, n: int) -> None:
        """`out.mul_(n)`, bit for bit. A Python number is wrapped in a new 0-dim tensor at each call,
        which is more than half of a small multiply's host time (5.4 against 2.3 us on the 2-core VM);
        a cached 0-dim CPU tensor of `out`'s dtype is the same multiply where that dtype holds n
        exactly: CPU and CUDA kernels read a CPU 0-dim operand as a scalar argument, in the same
        compute type as the Python number (no copy, no sync). It is made on the CPU whatever the
        default device (a `torch.device` context, DeepSpeed's zero.Init). FakeTensors keep the plain
        call."""
        if type(out) is not torch.Tensor:
            out.mul_(n)
            return
        key = (n, out.dtype)
        factor = self._factors.get(key, _UNSET)
        if factor is _UNSET:
            exact = torch.tensor(n, dtype=out.dtype, device="cpu")
            factor = self._factors[key] = exact if exact.item() == n else None
        out.mul_(n if factor is None else factor)

    def finish_reduction(self, out: torch.Tensor, op: ReduceOp, *, n: int, r: int,
                         gen_factory) -> None:
        """`out` holds the reduction over the r real members; fold in the n - r ghosts in place.

        For AVG, `out` holds the real SUM; the average happens here (under mirror, where the ghosts
        bring the real mean, it is the division by r, or none with one real member).
        `gen_factory()` returns this call's shared generator (only the random policy draws).
        """
        ghosts = n - r
        if op is _SUM and ghosts and self.name == "mirror":  # nearly every reduction: first, alone
            self._scale(out, n, r)
            return
        policy = self.effective(out.dtype)
        if ghosts == 0:
            if op == ReduceOp.AVG:
                _divide(out, n)
            return
        if op == ReduceOp.AVG and policy == "mirror":  # (n / r) * sum / n: one division, or none
            if r > 1:
                _divide(out, r)
        elif op in (ReduceOp.SUM, ReduceOp.AVG):
            if policy == "mirror":
                self._scale(out, n, r)
            elif policy == "random":
                noise = torch.randn(out.shape, generator=gen_factory(), device=out.device,
                                    dtype=out.dtype)
                out.add_(noise, alpha=float(ghosts) ** 0.5)  # sum of `ghosts` iid N(0, 1)
            if op == ReduceOp.AVG:
                _divide(out, n)
        elif op in (ReduceOp.MAX, ReduceOp.MIN):
            if policy == "zeros":
                (out.clamp_(min=0) if op == ReduceOp.MAX else out.clamp_(max=0))
            elif policy == "random":
                extreme = _normal_extreme(out, ghosts, gen_factory())
                (torch.maximum(out, extreme, out=out) if op == ReduceOp.MAX
                 else torch.minimum(out, extreme.neg_(), out=out))
        elif op == ReduceOp.PRODUCT:
            if policy == "zeros":
                out.zero_()
            elif policy == "random":
                gen = gen_factory()
                for _ in range(ghosts):
                    out.mul_(torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype))
            else:
                exponent = n / r
                out.copy_(out.pow(int(exponent)) if exponent.is_integer() else
                          out.abs().pow(exponent))
        else:
            raise ValueError(f"reduce op {op} is not supported by the prism backend; expected "
                             "SUM, AVG, MAX, MIN or PRODUCT")

    # -- data movement ---------------------------------------------------------------------------

    def fill(self, dst: torch.Tensor, source: torch.Tensor | None, gen_factory) -> None:
        """Fill a ghost's slot `dst` in place: copy of `source` (mirror), zeros, or noise.

        A mirror source of another length is tiled/truncated along dim 0 (all-to-all splits of a
        ghost can differ from the mirrored member's); no source at all gives zeros.
        """
        policy = self.effective(dst.dtype)
        if dst.numel() == 0:
            return
        if policy == "zeros" or (policy == "mirror" and (source is None or source.numel() == 0)):
            dst.zero_()
        elif policy == "random":
            dst.normal_(generator=gen_factory())
        elif source.shape == dst.shape:
            if not same_memory(source, dst):
                dst.copy_(source)
        else:
            _tile_into(dst, source)


_SUM = ReduceOp.SUM  # the object `comm.ops.reduce_op_of` returns for a sum, compared by identity


_UNSET = object()


def _scale_shared(out: torch.Tensor, n: int, r: int) -> None:
    """`out *= n / r` for several real members (one real member: `GhostPolicy._times`)."""
    if out.dtype.is_floating_point or out.dtype.is_complex:
        out.mul_(n / r)
    elif n % r == 0:
        out.mul_(n // r)
    else:
        out.mul_(n).div_(r, rounding_mode="floor")


def _divide(out: torch.Tensor, n: int) -> None:
    if out.dtype.is_floating_point or out.dtype.is_complex:
        out.div_(n)
    else:
        out.div_(n, rounding_mode="floor")


def _normal_extreme(like: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    """The max of `count` iid N(0, 1) per element, drawn exactly: Phi^-1(U^(1/count))."""
    u = torch.rand(like.shape, generator=gen, device=like.device, dtype=torch.float64)
    u.pow_(1.0 / count).clamp_(max=1 - 1e-16)
    return torch.special.ndtri(u).to(like.dtype)


def _tile_into(dst: torch.Tensor, source: torch.Tensor) -> None:
    """Copy `source` into `dst` along dim 0, repeating or truncating rows; other dims must agree."""
    if dst.dim() == 0 or source.dim() == 0 or dst.shape[1:] != source.shape[1:]:
        flat_dst, flat_src = dst.reshape(-1), source.reshape(-1)
        _tile_rows(flat_dst, flat_src)
        if not same_memory(flat_dst, dst) or not dst.is_contiguous():
            dst.copy_(flat_dst.view(dst.shape))
        return
    _tile_rows(dst, source)


def _tile_rows(dst: torch.Tensor, source: torch.Tensor) -> None:
    """dst's rows are source's, repeated: at most two copies (the whole repeats as one broadcast
    copy, then the rest), not one per repeat: on GPU each copy is a launch of host time, and an
    imbalanced all-to-all gives a ghost's slot many times the mirrored member's rows."""
    rows, have = dst.shape[0], source.shape[0]
    if have >= rows:
        dst.copy_(source[:rows])
        return
    whole = rows // have
    dst.narrow(0, 0, whole * have).unflatten(0, (whole, have)).copy_(source.unsqueeze(0).expand(whole, *source.shape))
    if rows > whole * have:
        dst.narrow(0, whole * have, rows - whole * have).copy_(source[:rows - whole * have])
