"""A model of PyTorch's CUDA caching allocator: allocated and reserved bytes as `torch.cuda` reports
them, from a sequence of allocations and frees (pure Python; no GPU).

The rules are those of c10's CUDACachingAllocator with its default settings (one stream, no
expandable segments, no `max_split_size_mb`, no `roundup_power2_divisions`):

- every request is rounded up to a multiple of 512 bytes (at least 512);
- requests of at most 1 MiB come from the small pool, larger ones from the large pool;
- a request takes the smallest free cached block of its pool that fits (ties: the lower address);
  if none fits, a new segment is reserved (cudaMalloc): 2 MiB for a small request, 20 MiB for a
  large one under 10 MiB, else the request rounded up to 2 MiB;
- the block is split when the rest is worth keeping: in the small pool when it is at least 512 bytes,
  in the large pool when it is more than 1 MiB; otherwise the request holds the whole block, and
  `allocated_bytes` counts the whole block (what makes the allocated peak differ from the sum of the
  requests);
- a freed block returns to its pool and merges with free neighbours of its segment; segments stay
  reserved (no `empty_cache`).

`replay(events)` runs `("alloc", key, nbytes)` / `("free", key)` events and returns the peaks.
`segment_addresses` may give the base addresses the real allocator got (from a memory snapshot's
`segment_alloc` events), so ties between equal free blocks of different segments break as they did.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Optional

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20          # largest small request
SMALL_BUFFER = 2 << 20        # small pool segment
LARGE_BUFFER = 20 << 20       # large pool segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * -(-nbytes // MIN_BLOCK)


def segment_size(rounded: int) -> int:
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-rounded // ROUND_LARGE)


@dataclass
class _Block:
    address: int
    size: int
    small: bool
    free: bool = True
    prev: Optional["_Block"] = None
    next: Optional["_Block"] = None


@dataclass
class AllocatorModel:
    """The caching allocator's bookkeeping (see the module docstring)."""

    segment_addresses: list[int] = field(default_factory=list)
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    _pools: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _free: dict[tuple[int, int], _Block] = field(default_factory=dict)
    _live: dict[object, _Block] = field(default_factory=dict)
    _next_address: int = 1 << 40

    def malloc(self, key: object, nbytes: int) -> int:
        """Allocate `nbytes` under `key`; returns the bytes the allocation holds (its block)."""
        if key in self._live:
            raise ValueError(f"allocation {key!r} is already live")
        size = round_size(int(nbytes))
        small = size <= SMALL_SIZE
        block = self._take_free(small, size)
        if block is None:
            block = self._new_segment(small, segment_size(size))
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.address + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._put_free(rest)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.size

    def free(self, key: object) -> None:
        block = self._live.pop(key)
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._drop_free(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._put_free(block)

    def replay(self, events: Iterable[tuple]) -> dict:
        """Run ("alloc", key, nbytes) and ("free", key) events; returns the figures."""
        for event in events:
            if event[0] == "alloc":
                self.malloc(event[1], event[2])
            elif event[0] == "free":
                self.free(event[1])
            else:
                raise ValueError(f"unknown allocator event {event[0]!r}; expected alloc or free")
        return self.figures()

    def figures(self) -> dict:
        return {"allocated_bytes": self.allocated, "reserved_bytes": self.reserved,
                "peak_allocated_bytes": self.peak_allocated, "peak_reserved_bytes": self.peak_reserved,
                "segments": self.segments}

    # -- pools ------------------------------------------------------------------------------------

    def _new_segment(self, small: bool, size: int) -> _Block:
        if self.segments < len(self.segment_addresses):
            address = self.segment_addresses[self.segments]
        else:
            address = self._next_address
            self._next_address += size + (1 << 21)
        self.segments += 1
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(address, size, small)

    def _take_free(self, small: bool, size: int) -> Optional[_Block]:
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i == len(pool):
            return None
        _, address, _ = pool.pop(i)
        return self._free.pop((int(small), address))

    def _put_free(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.address, 0))
        self._free[(int(block.small), block.address)] = block

    def _drop_free(self, block: _Block) -> None:
        pool = self._pools[block.small]
        i = bisect.bisect_left(pool, (block.size, block.address, 0))
        del pool[i]
        del self._free[(int(block.small), block.address)]


def events_from_snapshot(snapshot: dict, device: int = 0) -> tuple[list[tuple], list[int]]:
    """Allocator events and segment base addresses from `torch.cuda.memory._snapshot()` taken with
    `torch.cuda.memory._record_memory_history()` on: its device trace's `alloc` and `free_completed`
    entries (keyed by address) and the addresses of its `segment_alloc` entries, in order. Replaying
    them here gives the peaks to compare with the real allocator's `memory_stats()`."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces):
        raise ValueError(f"the snapshot has no trace for device {device}; record it with "
                         "torch.cuda.memory._record_memory_history() before the run")
    events, segments = [], []
    for entry in traces[device]:
        action = entry.get("action")
        if action == "alloc":
            events.append(("alloc", entry["addr"], entry["size"]))
        elif action == "free_completed":
            events.append(("free", entry["addr"]))
        elif action == "segment_alloc":
            segments.append(entry["addr"])
    return events, segments

