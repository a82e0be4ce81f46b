"""Bandwidth shared between concurrent operations on one rank's link (pure Python).

The cost model gives each operation a latency and a transfer time at the full link bandwidth
(`CostModel.parts`). Operations of one rank that transfer at the same time over the same link kind
(its NVLink ports inside a node, its NIC across nodes: each rank has its own rail) share that link
equally, as processor sharing: with k transfers active each progresses at 1/k of the bandwidth. A
collective or p2p transfer involves several ranks; it runs at the pace of its most loaded member, so
its extra time is the largest over its members' links.

The DES computes an operation's end when it starts, so sharing is solved as a fixed point: replay,
compute every transfer's extra time from the overlaps on that replay's timeline, replay again with
those extras, until no extra changes by more than a nanosecond (`Simulator` does the loop).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Iterable

TOLERANCE_S = 1e-9


def shared_finish(flows: list[tuple[float, float]]) -> list[float]:
    """Finish times of transfers (start_s, work_s) sharing one link equally (processor sharing)."""
    order = sorted(range(len(flows)), key=lambda j: flows[j][0])
    finish = [0.0] * len(flows)
    active: dict[int, float] = {}  # flow -> remaining work (seconds at the full bandwidth)
    now, nxt = 0.0, 0
    while nxt < len(order) or active:
        arrival = flows[order[nxt]][0] if nxt < len(order) else float("inf")
        if not active:
            now = arrival
        else:
            share = len(active)
            first_done = min(active.values()) * share
            if now + first_done <= arrival:  # a transfer ends before the next arrives
                now += first_done
                step = first_done / share
                for j in list(active):
                    active[j] -= step
                    if active[j] <= 1e-15:
                        finish[j] = now
                        del active[j]
                continue
            step = (arrival - now) / share
            for j in active:
                active[j] -= step
            now = arrival
        while nxt < len(order) and flows[order[nxt]][0] <= now:
            j = order[nxt]
            if flows[j][1] > 0:
                active[j] = flows[j][1]
            else:
                finish[j] = flows[j][0]
            nxt += 1
    return finish


Flow = tuple[Hashable, tuple[int, ...], str, float, float]


def extra_times(flows: Iterable[Flow]) -> dict[Hashable, float]:
    """Extra seconds per operation key from sharing. `flows`: (key, classes it involves, link kind,
    transfer start s, transfer s at the full bandwidth) of one replay."""
    by_link: dict[tuple[int, str], list[tuple[Hashable, float, float]]] = defaultdict(list)
    for key, classes, link, start, work in flows:
        if work <= 0:
            continue
        for c in set(classes):
            by_link[(c, link)].append((key, start, work))
    extra: dict[Hashable, float] = {}
    for items in by_link.values():
        if len(items) < 2:
            continue
        ends = shared_finish([(start, work) for _, start, work in items])
        for (key, start, work), end in zip(items, ends):
            wait = end - start - work
            if wait > TOLERANCE_S and wait > extra.get(key, 0.0):
                extra[key] = wait
    return extra
