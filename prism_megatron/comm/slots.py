"""How a group operation's buffers split into one slot per member, and the host copies of the p2p
mirror: helpers of the prism group (comm/backend.py) that hold no state of their own."""

from __future__ import annotations

import functools
import itertools
from typing import Sequence

import torch

from prism_megatron.comm.ops import host_bytes


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


def host_copy(t: torch.Tensor):
    """A copy of `t` outside the device allocator, for the p2p mirror: on GPU a pinned host tensor
    filled asynchronously on the current stream (a blocking copy would stall the host until the
    device drained, where a real send does not wait; the recv's copy back is stream-ordered after
    it), on CPU the bytes as numpy (outside torch's allocator, so the tracked memory stays a real
    rank's)."""
    if t.device.type == "cpu":
        return host_bytes(t)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t.detach(), non_blocking=True)
    return pinned


class RowPieces:
    """The n dim-0 pieces of `buffer` with `rows[g]` rows each, cut only when one is asked for
    (torch.split makes all n views at once: 75 us for 64 of them on the 2-core VM)."""

    def __init__(self, buffer: torch.Tensor, rows: list[int]) -> None:
        self.buffer, self.rows = buffer, rows
        self.starts = [0, *itertools.accumulate(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, g: int) -> torch.Tensor:
        return self.buffer.narrow(0, self.starts[g], self.rows[g]) if self.buffer.dim() else self.buffer


def even_pieces(output: torch.Tensor, n: int):
    """(output, rows) when `output` is contiguous and splits into n equal dim-0 pieces, else None."""
    if not output.is_contiguous() or not output.dim() or output.shape[0] % n:
        return None
    return output, [output.shape[0] // n] * n
