"""A group operation's output as one slot per member, and what goes into the ghosts' slots: the
ghost-data providers' rows or the ghost policy's fill, one copy per run of equal slots where the slots
are pieces of one buffer. Also the host copies of the p2p mirror. Used by the prism group
(comm/backend.py), which does the real exchange."""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from prism_megatron.comm.ops import copy_broadcast, copy_from_host, host_bytes


@functools.lru_cache(maxsize=None)
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def ghost_runs(indices: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values in sorted `indices`: (position of the run's first, first,
    one past the last)."""
    runs: list[tuple[int, int, int]] = []
    for i, g in enumerate(indices):
        if runs and runs[-1][2] == g:
            runs[-1] = (runs[-1][0], runs[-1][1], g + 1)
        else:
            runs.append((i, g, g + 1))
    return runs


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` outside the device allocator, for the p2p mirror: on GPU a pinned host tensor
    filled asynchronously on the current stream (a blocking copy would stall the host until the
    device drained, where a real send does not wait; the recv's copy back is stream-ordered after
    it), on CPU a tensor over numpy's bytes (outside torch's allocator, so the tracked memory stays
    a real rank's), viewed as `t` once here rather than at every recv (6.5 against 1.1 us a recv
    hot on the 2-core VM: benchmarks/results/scale-2026-12-03/recv_view.py)."""
    if t.device.type == "cpu":
        return torch.from_numpy(host_bytes(t)).view(t.dtype).view(t.shape)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t.detach(), non_blocking=True)
    return pinned


class RowPieces:
    """The n dim-0 pieces of `buffer` with `rows[g]` rows each, cut only when one is asked for
    (torch.split makes all n views at once: 75 us for 64 of them on the 2-core VM), and once: an
    operation asks for its own piece several times, and a view costs the host microseconds."""

    def __init__(self, buffer: torch.Tensor, rows: list[int]) -> None:
        self.buffer, self.rows = buffer, rows
        self.starts = [0, *itertools.accumulate(rows)]
        self._views: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, g: int) -> torch.Tensor:
        view = self._views.get(g)
        if view is None:
            view = self._views[g] = (self.buffer.narrow(0, self.starts[g], self.rows[g])
                                     if self.buffer.dim() else self.buffer)
        return view


def even_pieces(output: torch.Tensor, n: int):
    """(output, rows) when `output` is contiguous and splits into n equal dim-0 pieces, else None."""
    if not output.is_contiguous() or not output.dim() or output.shape[0] % n:
        return None
    return output, [output.shape[0] // n] * n


class GhostSlots:
    """Fills the ghosts' slots of one group's outputs (see the module docstring).

    `pieces` below: (buffer, rows) when the slots are consecutive dim-0 pieces of the contiguous
    `buffer`, `rows[g]` rows each (gathers into one tensor, all-to-all single). A run of ghosts whose
    pieces are alike then takes one copy, not one per ghost: an all-to-all over 64 experts has 63
    ghost slots."""

    def __init__(self, session, members: Sequence[int], real: Sequence[int], ghosts: Sequence[int],
                 me: int, mirror_source: dict[int, int], gen: Callable) -> None:
        self.session, self.members, self.real, self.ghosts = session, tuple(members), real, ghosts
        self.me, self.mirror_source, self._gen = me, mirror_source, gen
        self.ghost_ranks = [self.members[g] for g in ghosts]
        self.runs = ghost_runs(ghosts)

    def provided(self, slots: Sequence[torch.Tensor], op: str, pieces=None) -> bool:
        """Whether a provider (session.ghost_data) filled every ghost slot; each is asked once per
        operation, for all the ghosts, and none when there are none."""
        providers = self.session.ghost_data
        if not providers or not self.ghosts:
            return False
        like = slots[self.ghosts[0]]
        for provide in providers:
            values = provide(op, self.members, self.ghost_ranks, like)
            if values is None:
                continue
            rows = torch.from_numpy(np.ascontiguousarray(values)).reshape(len(self.ghosts), -1)
            for i, a, b in self.runs:
                block = _block(pieces, a, b)
                if block is not None:
                    copy_from_host(block, rows[i:i + b - a])
                else:
                    for k in range(b - a):
                        copy_from_host(slots[a + k], rows[i + k].view(slots[a + k].shape))
            return True
        return False

    def mirror_alone(self, output: torch.Tensor, input: torch.Tensor, local: torch.Tensor,
                     rows: list[int]) -> bool:
        """An all-to-all's output as the only real member under `mirror`: every slot is our own
        piece `local` of `input` (`mirror_own_piece`). False where that does not apply: several real
        members, other data, the output sharing the input's memory, fake tensors (shapes only)."""
        if (len(self.real) != 1 or not input.dim() or rows[self.me] != local.shape[0]
                or type(output) is not torch.Tensor or type(input) is not torch.Tensor
                or self.session.policy.effective(output.dtype) != "mirror"
                or output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()):
            return False
        return mirror_own_piece(output, local, rows)

    def fill(self, slots: Sequence[torch.Tensor], seq: int, op: str, skip: Optional[bool] = None,
             pieces=None) -> None:
        """Fill each ghost's slot of `op`'s output with policy data (mirror copies its source),
        unless a provider filled them all (`skip`; by default, asked here)."""
        if self.provided(slots, op, pieces) if skip is None else skip:
            return
        policy, me = self.session.policy, self.me
        if len(self.real) == 1 and policy.effective(slots[me].dtype) == "mirror":
            local = slots[me]  # one real member: every ghost mirrors our slot
            for _, a, b in self.runs:
                block = _block(pieces, a, b) if pieces and pieces[1][a] == pieces[1][me] else None
                if block is not None:
                    copy_broadcast(block, local)
                else:
                    for g in range(a, b):
                        policy.fill(slots[g], local, None)
            return
        for g in self.ghosts:
            policy.fill(slots[g], slots[self.mirror_source[g]], self._gen(slots[g].device, seq, g))


def mirror_own_piece(output: torch.Tensor, local: torch.Tensor, rows: list[int]) -> bool:
    """An all-to-all's output with one real member under `mirror`, in one operation: every slot,
    ours and the ghosts', is `local` (our own piece) with its rows repeated or cut to the slot's
    (`GhostPolicy.fill`'s tiling; no rows at all: zeros). Equal slots take one broadcast copy; on CPU
    unequal ones one gather (a routed MoE's splits differ per expert, and a copy per ghost slot cost
    650 against 85 us per all-to-all of 64 with cold caches on the 2-core VM). Returns False where it
    does not apply (unequal slots on GPU, whose index would come from the device allocator and show
    in the rank's memory; `output` not contiguous): the caller then fills slot by slot."""
    if not output.is_contiguous() or not output.dim() or sum(rows) != output.shape[0]:
        return False  # (splits that do not add up: the slot-by-slot path, as before)
    have, n = local.shape[0], len(rows)
    if not output.numel():
        return True
    if rows.count(have) == n:
        copy_broadcast(output.view(n, -1), local)
        return True
    if not have:
        output.zero_()
        return True
    if output.device.type != "cpu":
        return False
    starts = np.repeat(np.cumsum(rows) - rows, rows)  # each output row's slot start
    index = (np.arange(output.shape[0]) - starts) % have
    torch.index_select(local, 0, torch.from_numpy(index), out=output)
    return True


def _block(pieces, a: int, b: int) -> Optional[torch.Tensor]:
    """Slots a..b-1 as one [b - a, -1] view of the buffer when they are equal pieces of it."""
    if pieces is None or b - a < 2:
        return None
    buffer, rows = pieces
    if not rows[a] or rows[a:b].count(rows[a]) != b - a:
        return None
    return buffer.narrow(0, sum(rows[:a]), (b - a) * rows[a]).view(b - a, -1)
