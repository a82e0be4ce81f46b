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

For reductions under ``mirror`` with one real member, the fold is ``out *= n`` bit for bit as
``out.mul_(n)``. A ghost's all-to-all slot of another length than the mirrored member's takes that
member's rows repeated from the first, or cut.

The semantics are implemented once, natively (comm/native.py, `csrc/policy.cpp`); this module names
the policies. Every fill works in place on the caller's buffers, so the sandbox's tracked memory is
what a real rank's would be. Known limits: ``random`` allocates one temporary the size of the reduced
tensor, and draws nothing for fake tensors (fake execution has no values); a PRODUCT under ``mirror``
raises the real product to the power n/r (sign lost for non-integer powers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prism_megatron.config.schema import GHOST_POLICIES


def is_mirrored_dtype(dtype: torch.dtype) -> bool:
    """Integer/bool data (sizes, counts, object bytes) is always mirrored, whatever the policy."""
    return not (dtype.is_floating_point or dtype.is_complex)


@dataclass(frozen=True, kw_only=True)
class GhostPolicy:
    """A named ghost-data policy; see the module docstring for the semantics of each name."""

    name: str = "mirror"
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.name not in GHOST_POLICIES:
            raise ValueError(f"ghost policy {self.name!r} is unknown; expected one of "
                             f"{', '.join(GHOST_POLICIES)}")

    def effective(self, dtype: torch.dtype) -> str:
        return "mirror" if is_mirrored_dtype(dtype) else self.name
