"""The collective cost model: how long an operation of a group takes on a cluster (pure numpy).

Shape of the model, NCCL's own (its tuning model: a base latency per algorithm and protocol, a
per-step hardware latency per link type, and a bandwidth scaled by the protocol's efficiency):

    time = base_lat[algo][proto] + steps(algo, op, n) * hw_lat[link][algo][proto]
           + bus_bytes(op, n, S) / (link_bandwidth * efficiency[proto])

- algorithms: ring (every op), tree (all-reduce across nodes), NVLS (all-reduce inside one NVLink
  domain when the cluster has NVLink SHARP); protocols LL (8-byte lines carrying 4 data bytes: half
  the bandwidth, lowest latency), LL128 (120 of 128 bytes), Simple (full bandwidth, highest latency);
- the choice is NCCL's: the (algorithm, protocol) with the smallest predicted time;
- bus bytes follow nccl-tests' bus-bandwidth definitions (`bus_factor`): all_reduce 2(n-1)/n,
  all_gather and reduce_scatter (n-1)/n of the full buffer, broadcast and reduce 1, all_to_all
  (n-1)/n, send/recv 1; so `busbw = bus_factor * S / time` is what nccl-tests prints;
- placement: a group inside one node uses NVLink; a group across nodes uses the NICs, each rank its
  own rail (rail-optimized fat-tree), with the oversubscription of the spine applied when the group
  spans more nodes than one leaf switch holds (and two extra switch hops of latency);
- calibration (`prism-megatron calibrate`): measured (latency, bus bandwidth) per (op, link) replace
  the spec figures for that op; see `Calibration`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

PROTOCOLS = ("LL", "LL128", "Simple")
EFFICIENCY = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
# NCCL's published latency figures (us): base per algorithm, and per step per link type.
BASE_LAT_US = {"tree": {"LL": 6.8, "LL128": 14.0, "Simple": 14.0},
               "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
               "nvls": {"LL": 0.0, "LL128": 0.0, "Simple": 25.0}}
HW_LAT_US = {"intra": {"tree": {"LL": 0.52, "LL128": 1.25, "Simple": 28.0},
                        "ring": {"LL": 0.47, "LL128": 1.9, "Simple": 3.4},
                        "nvls": {"LL": 0.0, "LL128": 0.0, "Simple": 25.0}},
             "inter": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 14.0},
                     "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
                     "nvls": {"LL": 0.0, "LL128": 0.0, "Simple": 0.0}}}
# NVLink SHARP all-reduce moves about 1.3x the bus bandwidth of a ring on the same links (DGX H100:
# ~480 vs ~370 GB/s in nccl-tests).
NVLS_GAIN = 1.3
FLAT_BUSBW_BPS = 1e18  # "no size dependence" in a fitted segment (finite, so it stays JSON)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send",
       "recv", "gather", "scatter", "barrier")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw = algbw * factor (algbw = S / time, S the op's buffer size)."""
    if n <= 1:
        return 0.0 if op not in ("send", "recv") else 1.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send, recv


def bus_bandwidth(op: str, n: int, nbytes: int, time_s: float) -> float:
    """Bus bandwidth in bytes/s as nccl-tests defines it."""
    return bus_factor(op, n) * nbytes / time_s


@dataclass(frozen=True)
class Link:
    """One kind of path: per-GPU unidirectional bandwidth and the latency of one hop."""

    bandwidth_Bps: float
    kind: str  # intra (NVLink, or loopback on a CPU host) | inter (NICs)
    extra_latency_us: float = 0.0


@dataclass(frozen=True)
class Placement:
    """How a group's members sit on the cluster."""

    n: int
    nodes: int
    per_node: int
    leaves: int = 1

    @property
    def intra_node(self) -> bool:
        return self.nodes <= 1


@dataclass
class Calibration:
    """Measured (latency, bus bandwidth) per (op, link kind): replaces the spec model for that op.

    File (JSON): {"device": ..., "points": [{"op", "n", "link", "bytes", "time_s"}...], "fits": {
    "<op>/<link>/<n>": {"segments": [{"from_bytes", "latency_s", "busbw_Bps"}, ...]}}}; `fit()`
    derives the fits from the points, one per group size measured.
    """

    points: list[dict] = field(default_factory=list)
    fits: dict[str, dict] = field(default_factory=dict)
    device: str = ""

    def fit(self, min_bytes: int = 1 << 20, sizes: Optional[set[int]] = None) -> None:
        """Per (op, link), over points >= `min_bytes` (and in `sizes` if given): time = latency +
        bus_bytes / busbw, least squares in relative error, in one segment or two. NCCL changes
        protocol (LL128 to Simple) and channel count with the size, so the fit may split the sizes
        in two at the point that minimizes the worst relative error; each segment keeps >= 3 points."""
        groups: dict[str, list[dict]] = {}
        for p in self.points:
            if p["bytes"] >= min_bytes and (sizes is None or p["bytes"] in sizes):
                groups.setdefault(f"{p['op']}/{p['link']}/{p['n']}", []).append(p)
        for key, pts in groups.items():
            pts = sorted(pts, key=lambda p: p["bytes"])
            best = None
            for cut in [0] + list(range(3, len(pts) - 2)):
                parts = [pts[:cut], pts[cut:]] if cut else [pts]
                segments = [_fit_segment(part) for part in parts]
                if any(s is None for s in segments):
                    continue
                worst = max(abs(_segment_time(seg, p) / p["time_s"] - 1)
                            for seg, part in zip(segments, parts) for p in part)
                if best is None or worst < best[0] - 1e-3:  # two segments only if clearly better
                    best = (worst, segments)
            if best is not None:
                self.fits[key] = {"segments": best[1], "points": len(pts), "worst_error": best[0]}

    def lookup(self, op: str, link: str, nbytes: int = 0, n: int = 0) -> Optional[dict]:
        """The fitted (latency_s, busbw_Bps) segment for an op of `nbytes` on `n` ranks: the fit
        for that group size, else the one of the nearest size measured; None if the op was not."""
        fit = self.fits.get(f"{op}/{link}/{n}")
        if fit is None:
            sizes = [(abs(int(k.rsplit("/", 1)[1]) - n), k) for k in self.fits
                     if k.startswith(f"{op}/{link}/")]
            fit = self.fits[min(sizes)[1]] if sizes else self.fits.get(f"{op}/{link}")
        if fit is None:
            return None
        chosen = fit["segments"][0]
        for seg in fit["segments"]:
            if nbytes >= seg["from_bytes"]:
                chosen = seg
        return chosen

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "points": self.points, "fits": self.fits}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Parse a calibration file; ValueError (one line) when it is not one `calibrate` writes."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("points", []), list) \
                or not isinstance(data.get("fits"), dict):
            raise ValueError('expected an object {"device": ..., "points": [...], "fits": {"OP/LINK/N": '
                             '{"segments": [...]}}}')
        points = data.get("points", [])
        if not data["fits"] and not points:
            raise ValueError("it holds no measured point and no fitted collective: nothing to calibrate with")
        if not all(_is_point(p) for p in points):
            raise ValueError('a point is not {"op": str, "link": str, "n": int, "bytes": int, "time_s": > 0}')
        for key, fit in data["fits"].items():
            segments = fit.get("segments") if isinstance(fit, dict) else None
            if not isinstance(segments, list) or not segments or not all(_is_segment(s) for s in segments):
                raise ValueError(f"fit {key!r} has no segments of finite from_bytes >= 0, latency_s >= 0 "
                                 "and busbw_Bps > 0")
        return cls(points=list(data.get("points", [])), fits=dict(data["fits"]),
                   device=str(data.get("device", "")))


def _is_point(p) -> bool:
    return isinstance(p, dict) and isinstance(p.get("op"), str) and isinstance(p.get("link"), str) \
        and isinstance(p.get("n"), int) and isinstance(p.get("bytes"), int) \
        and isinstance(p.get("time_s"), (int, float)) and 0 < p["time_s"] < math.inf


def _is_segment(seg) -> bool:
    def number(key: str) -> float:
        value = seg.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan

    return isinstance(seg, dict) and number("from_bytes") >= 0 and 0 <= number("latency_s") < math.inf \
        and 0 < number("busbw_Bps") < math.inf


@dataclass
class CostModel:
    """Time of an operation on a cluster: `time(op, nbytes, placement)` (seconds)."""

    nvlink_Bps: float
    net_Bps: float
    nodes_per_leaf: int = 32
    oversubscription: float = 1.0
    switch_latency_us: float = 0.3
    nvls: bool = False
    calibration: Optional[Calibration] = None

    def link(self, placement: Placement) -> Link:
        if placement.intra_node:
            return Link(self.nvlink_Bps, "intra")
        bandwidth, extra = self.net_Bps, 2 * self.switch_latency_us
        if placement.nodes > self.nodes_per_leaf:  # through the spine
            bandwidth /= self.oversubscription
            extra += 2 * self.switch_latency_us
        return Link(bandwidth, "inter", extra)

    def choices(self, op: str, nbytes: int, placement: Placement) -> dict[tuple[str, str], float]:
        """Predicted time of every (algorithm, protocol) NCCL could use for this op."""
        n = placement.n
        link = self.link(placement)
        bus = bus_factor(op, n) * nbytes
        algos = ["ring"]
        if op == "all_reduce" and not placement.intra_node:
            algos.append("tree")
        if op == "all_reduce" and placement.intra_node and self.nvls and n > 2:
            algos.append("nvls")
        out = {}
        for algo in algos:
            for proto in PROTOCOLS:
                if algo == "nvls" and proto != "Simple":
                    continue
                steps = _steps(algo, op, placement)
                latency_us = (BASE_LAT_US[algo][proto] + steps * HW_LAT_US[link.kind][algo][proto]
                              + link.extra_latency_us)
                if algo == "tree":
                    volume = 2 * nbytes  # reduce up and broadcast down, pipelined
                elif algo == "nvls":
                    volume = bus / NVLS_GAIN  # in-switch reduction: less traffic than a ring
                else:
                    volume = bus
                out[(algo, proto)] = latency_us * 1e-6 + volume / (link.bandwidth_Bps * EFFICIENCY[proto])
        return out

    def time(self, op: str, nbytes: int, placement: Placement) -> float:
        """Seconds for `op` of `nbytes` (nccl-tests size) over a group placed as `placement`."""
        latency_s, transfer_s, _ = self.parts(op, nbytes, placement)
        return latency_s + transfer_s

    def parts(self, op: str, nbytes: int, placement: Placement) -> tuple[float, float, str]:
        """(latency s, transfer s at the full link bandwidth, link kind "intra"/"inter") of `op`: the
        transfer part is what concurrent operations on one rank's link share (sim/sharing.py)."""
        if placement.n <= 1 and op not in ("send", "recv"):
            return 0.0, 0.0, "intra"
        if op == "barrier":
            op, nbytes = "all_reduce", 4
        link = self.link(placement)
        fit = self.calibration.lookup(op, link.kind, nbytes, placement.n) if self.calibration else None
        if fit is not None:
            return fit["latency_s"], bus_factor(op, placement.n) * nbytes / fit["busbw_Bps"], link.kind
        table = self.choices(op, nbytes, placement)
        algo, proto = min(table, key=table.get)
        steps = _steps(algo, op, placement)
        latency_s = (BASE_LAT_US[algo][proto] + steps * HW_LAT_US[link.kind][algo][proto]
                     + link.extra_latency_us) * 1e-6
        return latency_s, max(0.0, table[(algo, proto)] - latency_s), link.kind

    def choice(self, op: str, nbytes: int, placement: Placement) -> tuple[str, str]:
        table = self.choices(op, nbytes, placement)
        return min(table, key=table.get)


def _fit_segment(pts: list[dict]) -> Optional[dict]:
    """Least squares of time = a + b * bus_bytes in relative error (rows weighted by 1/time)."""
    if len(pts) < 2:
        return None
    rows = [(1.0 / p["time_s"], bus_factor(p["op"], p["n"]) * p["bytes"] / p["time_s"]) for p in pts]
    s11 = sum(r[0] * r[0] for r in rows)
    s12 = sum(r[0] * r[1] for r in rows)
    s22 = sum(r[1] * r[1] for r in rows)
    y1 = sum(r[0] for r in rows)
    y2 = sum(r[1] for r in rows)
    det = s11 * s22 - s12 * s12
    if abs(det) < 1e-30:
        return None
    a = (y1 * s22 - y2 * s12) / det
    b = (s11 * y2 - s12 * y1) / det
    if b <= 0:  # time does not grow with size here (latency-bound, or noise): a flat segment
        times = sorted(p["time_s"] for p in pts)
        return {"from_bytes": pts[0]["bytes"], "latency_s": times[len(times) // 2],
                "busbw_Bps": FLAT_BUSBW_BPS}
    return {"from_bytes": pts[0]["bytes"], "latency_s": max(a, 0.0), "busbw_Bps": 1.0 / b}


def _segment_time(seg: dict, p: dict) -> float:
    return seg["latency_s"] + bus_factor(p["op"], p["n"]) * p["bytes"] / seg["busbw_Bps"]


def _steps(algo: str, op: str, placement: Placement) -> float:
    n = placement.n
    if algo == "tree":
        return 2 * math.log2(max(placement.nodes, 2))
    if algo == "nvls":
        return 1.0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("send", "recv"):
        return 1.0
    return n - 1
