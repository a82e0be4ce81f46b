"""Holds on a CUDA stream, decided on the device (realtime emulation and pacing on GPU).

A hold (emulate/holds.py) ends at max(own part, end of each path's anchor + its ghost_s), the own
part being the operation's stamped begin plus its modelled transfer, or, unstamped, `now + self_s`
where `now` is when the stream reaches the hold. On a GPU the host runs ahead of the stream and cannot know that
time without a synchronize, which a real rank never does; so the decision is taken by a one-thread
kernel on the stream itself, on the device's global timer (`%globaltimer`, nanoseconds): it reads the
time, computes the end from the anchors' ends that earlier holds of the iteration wrote to a device
buffer, writes its own, and (where the stream is held) spins until the latest end of the operations
issued with it.
Where the stream had nothing queued when an operation began (the host was behind, as after a
device-to-host synchronization), a one-thread kernel stamps that begin, and the operation's own part is
its begin plus the modelled transfer; an operation issued past its planned end runs up the emulator's
debt, which later holds pay back (emulate/holds.py). The kernel keeps the debt on the device.
The spinning kernel holds the stream as an NCCL kernel waiting for its peers does, while other
streams run on. The plan's rows are on the device from the start, so a hold costs one launch (and
an operation's begin a stream query, plus a launch where it is stamped). An
overlapped operation waited for on another stream than it was issued on has its plan waited for
first; a plan that reads an anchor planned on another stream is not ordered after it (the holds of
megatron's and DeepSpeed's communication are issued on one stream).

Triton writes the kernel (it reads the timer with inline PTX). Its integer arguments are not
specialized, and the three variants an iteration uses are compiled when the holds are set, so nothing
compiles in the middle of a run. They are then launched through the compiled kernel's own launcher:
`kernel[grid](...)` binds and specializes its arguments and looks up its cache at every call, which
on the H200 host was the larger part of a hold's launch (py-spy, benchmarks/results/hostcost-2026-12-02).
"""

from __future__ import annotations

from typing import Optional, Sequence

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a GPU machine without Triton
    triton = None


def available() -> bool:
    """Whether holds can run on this machine's GPUs (Triton is installed)."""
    return triton is not None


NS = 1e9
NEVER = -(1 << 62)
"""The end of an operation not planned yet (every max with it keeps the other side)."""

if triton is not None:
    _NEVER = tl.constexpr(NEVER)  # a jitted function reads module globals only as constexpr

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit(do_not_specialize=["row", "out", "lo", "hi", "acc"])
    def _hold_kernel(ends, rows, row, out, lo, hi, acc, TERMS: tl.constexpr, PLAN: tl.constexpr,
                     SPIN: tl.constexpr):
        # ends: planned ends on the job's timeline (the timer less the debt); acc.. : the account
        # (holds that waited, ns asked, ns held, ns of debt run up, ns paid back), the debt, the debt
        # the current group of operations (issued together: ordinals lo..out) found, then each
        # operation's begin on the stream (a stamp, or NEVER)
        entry = _now()
        debt = tl.load(ends + acc + 5)
        if PLAN:  # rows[row] = (self ns, transfer ns or NEVER, then (anchor slot, ghost ns) per term)
            if out == lo:  # the group's first: what it plans against
                tl.store(ends + acc + 6, debt)
            found = tl.load(ends + acc + 6)
            base = rows + (2 + 2 * TERMS) * row
            transfer = tl.load(base + 1)
            begin = tl.load(ends + acc + 7 + out)
            stamped = (begin != _NEVER) & (transfer != _NEVER)
            end = tl.where(stamped, begin - found + transfer, entry - found + tl.load(base))
            for t in tl.static_range(TERMS):
                end = tl.maximum(end, tl.load(ends + tl.load(base + 2 + 2 * t)) + tl.load(base + 3 + 2 * t))
            tl.store(ends + out, end)
            latest = tl.load(ends + lo)  # the group so far: its issue past the latest end is the
            for k in range(lo + 1, out + 1):  # emulator's time, run up once for the group (each
                latest = tl.maximum(latest, tl.load(ends + k))  # launch of it sets it again)
            again = found + tl.maximum(entry - found - latest, 0)
            tl.store(ends + acc + 3, tl.load(ends + acc + 3) + (again - debt))
            debt = again
        if SPIN:
            goal = tl.load(ends + lo)
            for k in range(lo + 1, hi + 1):
                goal = tl.maximum(goal, tl.load(ends + k))
            slack = goal - (entry - debt)
            if (slack > 0) & (debt > 0):  # pay back what this hold can of the debt
                paid = tl.minimum(debt, slack)
                debt = debt - paid
                tl.store(ends + acc + 4, tl.load(ends + acc + 4) + paid)
            tl.store(ends + acc + 5, debt)  # before the spin: a hold on another stream reads it meanwhile
            goal = goal + debt
            now = entry
            while now < goal:
                now = _now()
            if goal > entry:
                tl.store(ends + acc, tl.load(ends + acc) + 1)
                tl.store(ends + acc + 1, tl.load(ends + acc + 1) + (goal - entry))
                tl.store(ends + acc + 2, tl.load(ends + acc + 2) + (now - entry))
        else:
            tl.store(ends + acc + 5, debt)

    @triton.jit(do_not_specialize=["slot"])
    def _stamp_kernel(ends, slot):
        tl.store(ends + slot, _now())


class DeviceHolds:
    """An iteration's holds on the current CUDA stream. Device buffer `ends`: slot k the planned end
    of operation k (on the job's timeline: the timer less the debt, emulate/holds.py), then the
    iteration's start, a slot that is always NEVER (the anchor of an unused term), the account (holds
    that waited, ns asked, ns held, ns of the emulator's own time run up, ns of it paid back), the
    debt, the debt the current group of operations found, and n + 1 slots, one per operation and
    the start: its begin on the stream where it was stamped, else NEVER."""

    def __init__(self, rows: Sequence[Optional[tuple]]) -> None:
        import torch

        if triton is None:
            from prism_megatron.config.schema import ConfigError

            raise ConfigError("emulation.clock=realtime (and pacing) on GPU hold the stream with a Triton "
                              "kernel: pip install triton, or run the emulation with --clock virtual "
                              "--pace off")
        n = len(rows)
        self.start, self.never, self.acc = n, n + 1, n + 2
        self.debt, self.begins = self.acc + 5, self.acc + 7  # acc + 6: the debt a group found
        self.terms = max([len(row[1]) for row in rows if row is not None] + [1])
        table = []
        for row in [*rows, None]:  # the last row is the iteration's start: its end is its entry
            self_s, terms = row[:2] if row is not None else (0.0, ())
            transfer_s = row[2] if row is not None and len(row) > 2 else None
            cells = [round(self_s * NS), NEVER if transfer_s is None else round(transfer_s * NS)]
            for anchor, ghost_s in terms:
                cells += [self.start if anchor < 0 else int(anchor), round(ghost_s * NS)]
            cells += [self.never, 0] * (self.terms - len(terms))
            table.append(cells)
        device = torch.cuda.current_device()
        before = torch.cuda.memory_allocated(device)
        self.rows = torch.tensor(table, dtype=torch.int64, device=device)
        self.ends = torch.full((self.begins + n + 1,), NEVER, dtype=torch.int64, device=device)
        self.device_bytes = torch.cuda.memory_allocated(device) - before
        """What the plan's two buffers hold of the caching allocator (as it counts them, rounded): the
        emulator's own memory, which a real rank does not have (its NCCL buffers are not the
        allocator's), taken off the rank's allocated figures (CudaClock.own_device_bytes)."""
        self.ends[self.acc:self.begins] = 0
        self._stamps = self.ends[self.begins:]  # views kept: the iteration's reset is two launches
        self._debt = self.ends[self.debt:self.debt + 1]
        self._torch = torch
        self._planned: dict[int, tuple] = {}  # overlapped ordinal -> (its plan's stream, an event after it)
        self._device = device
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._runners = {variant: self._compiled(*variant) for variant in ((True, False), (True, True),
                                                                            (False, True))}
        if not self._launcher_works():
            self._runners = {variant: None for variant in self._runners}
        self._stamper = self._compiled_stamp()
        if self._stamper is not None and not self._stamper_works():
            self._stamper = None

    def _compiled(self, plan: bool, spin: bool):
        """The variant's launcher (`CompiledKernel[grid]`), compiled now; None where this Triton has
        no such interface (the hold is then launched the plain way)."""
        try:
            kernel = _hold_kernel.warmup(self.ends, self.rows, 0, 0, 0, 0, self.acc, TERMS=self.terms,
                                         PLAN=plan, SPIN=spin, num_warps=1, grid=(1,))
            if hasattr(kernel, "result"):  # an asynchronous compile
                kernel = kernel.result()
            return None if self._raw_stream is None else kernel[(1, 1, 1)]
        except Exception:  # noqa: BLE001 - another Triton's internals: launch the plain way
            return None

    def _compiled_stamp(self):
        try:
            kernel = _stamp_kernel.warmup(self.ends, 0, num_warps=1, grid=(1,))
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            return None if self._raw_stream is None else kernel[(1, 1, 1)]
        except Exception:  # noqa: BLE001 - see `_compiled`
            return None

    def _launcher_works(self) -> bool:
        """Launch the iteration-start plan once through the launchers and read it back (one
        synchronize, before the run): a launcher that does not write the plan is not used."""
        if any(r is None for r in self._runners.values()):
            return False
        try:
            self._launch(self.start, self.start, self.start, self.start, True, False)
            written = int(self.ends[self.start].item()) != NEVER
            self.ends[self.start] = NEVER
            self._launch(self.start, self.start, self.start, self.start, True, True)  # plans, no spin
            self._launch(0, 0, self.never, self.never, False, True)  # a wait for nothing
            written = written and int(self.ends[self.start].item()) != NEVER
        except Exception:  # noqa: BLE001 - see `_compiled`
            written = False
        self.ends[self.start] = NEVER
        self.ends[self.acc:self.begins] = 0
        return written

    def _stamper_works(self) -> bool:
        """The stamp's launcher, checked as `_launcher_works` checks the holds' (without it, stamps
        are launched the plain way)."""
        try:
            self._stamper(self.ends, self.begins + self.start, stream=self._raw_stream(self._device))
            written = int(self.ends[self.begins + self.start].item()) != NEVER
        except Exception:  # noqa: BLE001 - see `_compiled`
            written = False
        self._stamps.fill_(NEVER)
        return written

    def _launch(self, row: int, out: int, lo: int, hi: int, plan: bool, spin: bool) -> None:
        runner = self._runners.get((plan, spin))
        if runner is not None:
            runner(self.ends, self.rows, row, out, lo, hi, self.acc, self.terms, plan, spin,
                   stream=self._raw_stream(self._device))
            return
        _hold_kernel[(1,)](self.ends, self.rows, row, out, lo, hi, self.acc, TERMS=self.terms, PLAN=plan,
                           SPIN=spin, num_warps=1)

    def begin(self) -> None:
        """A new iteration: no debt, no operation stamped, and its start planned."""
        self._stamps.fill_(NEVER)
        self._debt.zero_()
        self._launch(self.start, self.start, self.start, self.start, True, False)

    def stamp(self, ordinal: int) -> None:
        """Operation `ordinal` begins where the stream is now: a kernel writes the timer to its slot
        (called where the stream has nothing queued, so the operation begins on the device now)."""
        if not 0 <= ordinal < self.start:
            raise IndexError(f"hold stamp for operation {ordinal}: the plan holds {self.start}")
        if self._stamper is not None:
            self._stamper(self.ends, self.begins + ordinal, stream=self._raw_stream(self._device))
        else:
            _stamp_kernel[(1,)](self.ends, self.begins + ordinal, num_warps=1)

    def hold(self, ordinals: Sequence[int], spin: bool) -> None:
        """Plan the ends of `ordinals` (issued together) and, with `spin`, hold the stream until the
        latest. Without `spin` (overlapped operations) an event after the plan lets a wait on another
        stream read it in order."""
        last = len(ordinals) - 1
        for j, k in enumerate(ordinals):
            self._launch(k, k, ordinals[0], k, True, spin and j == last)
        if not spin:
            stream = self._torch.cuda.current_stream()
            event = self._torch.cuda.Event()
            event.record(stream)
            for k in ordinals:
                self._planned[k] = (stream, event)

    def wait(self, ordinals: Sequence[int]) -> None:
        """Hold the current stream until the planned ends of `ordinals`; planned on another stream,
        their plan is waited for first (a wait on a Work makes the same dependency)."""
        stream = self._torch.cuda.current_stream()
        for k in ordinals:
            planned = self._planned.pop(k, None)
            if planned is not None and planned[0] != stream:
                stream.wait_event(planned[1])
        self._launch(0, 0, min(ordinals), max(ordinals), False, True)

    def report(self) -> dict:
        """{"count", "planned_s", "measured_s", "error_pct", "overhead_accrued_s",
        "overhead_absorbed_s"}: holds that waited, what they were asked to wait and what they waited,
        on the global timer; the emulator's own time they ran up and paid back (emulate/holds.py)."""
        count, asked, held, accrued, absorbed = (int(x) for x in self.ends[self.acc:self.debt].tolist())
        return {"count": count, "planned_s": asked / NS, "measured_s": held / NS,
                "error_pct": (held / asked - 1) * 100 if asked > 0 else None,
                "overhead_accrued_s": accrued / NS, "overhead_absorbed_s": absorbed / NS}
