"""The execution graph: one `RoleGraph` per role of the virtual world, plus the world itself.

Ranks of one role run the same program, so 8192 ranks of 128 roles are 128 graphs, never 8192. A role
graph is columnar (numpy arrays, one entry per node) so that it is small on disk, loads without
per-node Python objects, and replays fast:

- every node is a compute op or a communication op, in program order of its stream;
- `start_s`/`duration_s` are measured on the device's own clock of the slice that captured the role;
- dependencies are CSR (`dep_ptr`, `dep_idx`); a node depends only on earlier nodes (the builder
  enforces it), which makes the graph a DAG by construction and the check O(edges);
- communication nodes carry op, group dim, bytes, dtype, their sequence number on the group, and for
  p2p the peer as an offset of its index along the dim (`peer_delta`), which is what is the same for
  every rank of the role (pipeline: -1 for the previous stage, +1 for the next);
- memory is the allocated-bytes timeline with its peak and the breakdown at the peak;
- pipeline spans mark each forward/backward of each microbatch (and virtual stage) as a node range;
- MoE records hold the tokens routed to each local expert per layer and microbatch.

Strings (op names, streams, dims, dtypes, span names) live in one table per ExecutionGraph; columns
hold their indices. `structure_hash` digests everything but the timings: two ranks whose hashes are
equal run the same program (ops, groups, bytes, dependencies, memory). The capture verifies that
roles believed symmetric are with `structure_difference`, which is the same comparison except that
two peaks from the CUDA caching allocator (whose statistics move with timing) may differ by 0.01 %.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Optional, Sequence

import numpy as np

from prism_megatron.world import Role, VirtualWorld

SCHEMA_VERSION = 2
NO_PEER = np.iinfo(np.int32).min

COLUMNS: dict[str, str] = {  # name -> numpy dtype, one entry per node
    "kind": "u1", "name": "i4", "stream": "i4", "start_s": "f8", "duration_s": "f8",
    "op": "i4", "dim": "i4", "nbytes": "i8", "dtype": "i4", "seq": "i8", "peer_delta": "i4",
}

SPAN_COLUMNS: dict[str, str] = {  # one entry per pipeline span (forward/backward of a microbatch)
    "name": "i4", "microbatch": "i4", "chunk": "i4", "first": "i4", "last": "i4",
    "start_s": "f8", "end_s": "f8",
}
MOE_COLUMNS: dict[str, str] = {  # one entry per (MoE layer, microbatch); tokens flat, CSR by ptr
    "layer": "i4", "microbatch": "i4", "chunk": "i4",
}
STRING_COLUMNS = ("name", "stream", "op", "dim", "dtype")
_TIMING = ("start_s", "duration_s")


class NodeKind(IntEnum):
    COMPUTE = 0
    COMM = 1


@dataclass(kw_only=True)
class RoleGraph:
    """Everything one role does in one captured iteration (see the module docstring)."""

    role: Role
    representative: int
    """The virtual rank whose slice captured this graph."""
    source: str = "captured"
    """`captured`, or `inferred:<role>` when a verified-symmetric role's graph was reused."""
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    dep_ptr: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype="i8"))
    dep_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="i4"))
    mem_t_s: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="f8"))
    mem_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="i8"))
    peak_bytes: int = 0
    peak_by_category: dict[str, int] = field(default_factory=dict)
    peak_reserved_bytes: int = 0
    """GPU: the caching allocator's peak reserved bytes; CPU (exact tracker): equal to peak_bytes."""
    memory_source: str = "tracker"
    """`tracker` (CPU, exact per-storage accounting) or `cuda-allocator` (GPU statistics; the
    category breakdown is then params/grads/optimizer state by size and the rest as activations)."""
    spans: dict[str, np.ndarray] = field(default_factory=lambda: _empty(SPAN_COLUMNS))
    moe: dict[str, np.ndarray] = field(default_factory=lambda: _empty(MOE_COLUMNS))
    moe_ptr: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype="i8"))
    moe_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="i8"))

    @property
    def num_nodes(self) -> int:
        return len(self.dep_ptr) - 1

    def deps(self, node: int) -> np.ndarray:
        return self.dep_idx[self.dep_ptr[node]:self.dep_ptr[node + 1]]

    def as_role(self, role: Role, representative: int, source: str, layer_shift: int = 0) -> RoleGraph:
        """This graph reused for another role (arrays shared, not copied). `layer_shift`: what to add
        to the MoE rows' layer numbers (megatron's are global: a stage `d` stages further holds
        layers `d * layers_per_stage` higher)."""
        moe = self.moe
        if layer_shift and len(moe.get("layer", ())):
            layer = moe["layer"]
            moe = dict(moe, layer=np.where(layer >= 0, layer + layer_shift, layer).astype(layer.dtype))
        return replace(self, role=role, representative=representative, source=source, moe=moe)

    def with_durations(self, duration_s: np.ndarray) -> RoleGraph:
        """A copy whose nodes last `duration_s` (one per node; the other arrays shared). Start times,
        spans and the memory timeline stay those of this graph's own clock: the replay reads
        durations, while a trace drawn from `start_s` no longer meets end to end."""
        if len(duration_s) != self.num_nodes:
            raise ValueError(f"{len(duration_s)} durations for a graph of {self.num_nodes} nodes")
        return replace(self, columns=dict(self.columns, duration_s=np.asarray(duration_s, dtype="f8")))

    def remap_strings(self, mapping: np.ndarray) -> RoleGraph:
        """A copy whose string columns go through `mapping` (old index -> new index; -1 stays)."""
        def go(column: np.ndarray) -> np.ndarray:
            return np.where(column >= 0, mapping[np.maximum(column, 0)], -1).astype(column.dtype)

        columns = {n: go(c) if n in STRING_COLUMNS else c for n, c in self.columns.items()}
        spans = dict(self.spans, name=go(self.spans["name"]))
        return replace(self, columns=columns, spans=spans)


def _empty(spec: dict[str, str]) -> dict[str, np.ndarray]:
    return {name: np.zeros(0, dtype=dtype) for name, dtype in spec.items()}


PEAK_TOLERANCE = 1e-4
"""How far (a fraction of the larger peak, per category and in total) two roles' memory peaks may
differ and still count as the same program: 1e-4, the product's memory goal (< 0.01 %), so a member
inferred from a probe is within that goal. What moves the figures between members of one role: the
CUDA allocator's statistics move with timing (a block used on a side stream, as megatron's all-to-all
dispatcher does for its split sizes with `record_stream`, is freed only when the allocator next sees
that stream's event done); the exact trackers see kilobytes of rank-dependent small tensors (a
context-parallel rank's position indices, an expert rank's routing counts)."""


def structure_parts(g: RoleGraph, strings: Sequence[str]) -> dict[str, str]:
    """sha256 per part of what the role does, without its timings: `nodes` (strings resolved),
    `dependencies`, `memory` (peak and breakdown), `spans` (pipeline) and `moe` (token counts). MoE
    layers count by their order within the role, so two stages whose layers route alike hash alike."""
    parts = {name: hashlib.sha256() for name in ("nodes", "dependencies", "memory", "spans", "moe")}

    def text(column: np.ndarray) -> bytes:
        return "\x1f".join(strings[i] if i >= 0 else "" for i in column.tolist()).encode()

    for name in sorted(g.columns):
        if name in _TIMING:
            continue
        parts["nodes"].update(name.encode())
        parts["nodes"].update(text(g.columns[name]) if name in STRING_COLUMNS else g.columns[name].tobytes())
    parts["dependencies"].update(g.dep_ptr.tobytes())
    parts["dependencies"].update(g.dep_idx.tobytes())
    parts["memory"].update(repr((g.peak_bytes, sorted(g.peak_by_category.items()))).encode())
    for name in sorted(g.spans):
        if name not in ("start_s", "end_s"):
            parts["spans"].update(text(g.spans[name]) if name == "name" else g.spans[name].tobytes())
    for name in sorted(g.moe):
        column = g.moe[name]
        if name == "layer":  # megatron's layer numbers are global: hash each row's place among
            column = np.unique(column, return_inverse=True)[1].astype("i4")  # the role's own layers
        parts["moe"].update(column.tobytes())
    parts["moe"].update(g.moe_ptr.tobytes())
    parts["moe"].update(g.moe_tokens.tobytes())
    return {name: h.hexdigest() for name, h in parts.items()}


def structure_hash(g: RoleGraph, strings: Sequence[str]) -> str:
    """sha256 of what the role does, without its timings: every part of `structure_parts`."""
    return hashlib.sha256("".join(structure_parts(g, strings).values()).encode()).hexdigest()


def structure_difference(a: RoleGraph, sa: Sequence[str], b: RoleGraph, sb: Sequence[str]) -> Optional[str]:
    """None when `a` and `b` run the same program, else which parts differ, in words. Memory counts
    as the same within `PEAK_TOLERANCE`; the other parts must be equal."""
    pa, pb = structure_parts(a, sa), structure_parts(b, sb)
    differ = [name for name in pa if name != "memory" and pa[name] != pb[name]]
    if pa["memory"] != pb["memory"]:
        allowed = int(PEAK_TOLERANCE * max(a.peak_bytes, b.peak_bytes))
        keys = set(a.peak_by_category) | set(b.peak_by_category)
        if (set(a.peak_by_category) != set(b.peak_by_category)
                or abs(a.peak_bytes - b.peak_bytes) > allowed
                or any(abs(a.peak_by_category.get(k, 0) - b.peak_by_category.get(k, 0)) > allowed for k in keys)):
            differ.append(f"memory (peak {a.peak_bytes:,} vs {b.peak_bytes:,} B, {a.memory_source}; "
                          f"{allowed:,} B allowed)")
    return ", ".join(differ) or None


@dataclass(kw_only=True)
class ExecutionGraph:
    """The full-scale graph: the world and one RoleGraph per role, sharing one string table."""

    world: VirtualWorld
    roles: dict[Role, RoleGraph]
    strings: list[str]
    meta: dict[str, object] = field(default_factory=dict)

    def string(self, index: int) -> str:
        return self.strings[index] if index >= 0 else ""

    def graph_of(self, rank: int) -> RoleGraph:
        """The graph rank `rank` runs (its role's)."""
        return self.roles[self.world.role(rank)]


class StringTable:
    """Interns strings to indices; -1 stands for "none"."""

    def __init__(self, strings: Sequence[str] = ()) -> None:
        self.strings = list(strings)
        self._index = {s: i for i, s in enumerate(self.strings)}

    def __call__(self, value: Optional[str]) -> int:
        if value is None:
            return -1
        if value not in self._index:
            self._index[value] = len(self.strings)
            self.strings.append(value)
        return self._index[value]


class RoleGraphBuilder:
    """Appends nodes in program order and produces a RoleGraph; used by the recorder."""

    def __init__(self, role: Role, representative: int, strings: StringTable) -> None:
        self.role, self.representative, self.strings = role, representative, strings
        self._rows: dict[str, list] = {name: [] for name in COLUMNS}
        self._deps: list[int] = []
        self._dep_ptr: list[int] = [0]
        self._spans: dict[str, list] = {name: [] for name in SPAN_COLUMNS}
        self._moe: dict[str, list] = {name: [] for name in MOE_COLUMNS}
        self._moe_ptr: list[int] = [0]
        self._moe_tokens: list[int] = []

    def _add(self, deps: Sequence[int], **values) -> int:
        node = len(self._dep_ptr) - 1
        bad = [d for d in deps if not 0 <= d < node]
        if bad:
            raise ValueError(f"node {node} depends on {bad}: a node may only depend on earlier nodes")
        for name in COLUMNS:
            self._rows[name].append(values[name])
        self._deps.extend(sorted(set(deps)))
        self._dep_ptr.append(len(self._deps))
        return node

    def compute(self, name: str, *, stream: str, start_s: float, duration_s: float,
                deps: Sequence[int] = ()) -> int:
        s = self.strings
        return self._add(deps, kind=NodeKind.COMPUTE, name=s(name), stream=s(stream),
                         start_s=start_s, duration_s=duration_s, op=-1, dim=-1, nbytes=0, dtype=-1,
                         seq=-1, peer_delta=NO_PEER)

    def comm(self, op: str, *, dim: str, nbytes: int, dtype: str, seq: int, stream: str,
             start_s: float, duration_s: float, peer_delta: Optional[int] = None,
             deps: Sequence[int] = ()) -> int:
        s = self.strings
        return self._add(deps, kind=NodeKind.COMM, name=s(op), stream=s(stream), start_s=start_s,
                         duration_s=duration_s, op=s(op), dim=s(dim), nbytes=nbytes, dtype=s(dtype),
                         seq=seq, peer_delta=NO_PEER if peer_delta is None else peer_delta)

    def span(self, name: str, *, microbatch: int, chunk: int, first: int, last: int,
             start_s: float, end_s: float) -> None:
        """Mark nodes first..last (inclusive) as one forward/backward of a microbatch."""
        row = {"name": self.strings(name), "microbatch": microbatch, "chunk": chunk, "first": first,
               "last": last, "start_s": start_s, "end_s": end_s}
        for key, value in row.items():
            self._spans[key].append(value)

    def moe(self, *, layer: int, microbatch: int, chunk: int, tokens: Sequence[int]) -> None:
        """Tokens routed to each local expert of MoE layer `layer` in one microbatch."""
        self._moe["layer"].append(layer)
        self._moe["microbatch"].append(microbatch)
        self._moe["chunk"].append(chunk)
        self._moe_tokens.extend(int(t) for t in tokens)
        self._moe_ptr.append(len(self._moe_tokens))

    def build(self, *, mem_t_s: Sequence[float] = (), mem_bytes: Sequence[int] = (),
              peak_by_category: Optional[dict[str, int]] = None, source: str = "captured",
              peak_bytes: Optional[int] = None, peak_reserved_bytes: Optional[int] = None,
              memory_source: str = "tracker") -> RoleGraph:
        """The RoleGraph; `peak_bytes` defaults to the timeline's maximum (pass the run's peak when
        the timeline covers only the recorded iteration)."""
        mem_b = np.asarray(mem_bytes, dtype="i8")
        if peak_bytes is None:
            peak_bytes = int(mem_b.max()) if len(mem_b) else 0
        return RoleGraph(
            role=self.role, representative=self.representative, source=source,
            columns={n: np.asarray(v, dtype=COLUMNS[n]) for n, v in self._rows.items()},
            dep_ptr=np.asarray(self._dep_ptr, dtype="i8"), dep_idx=np.asarray(self._deps, dtype="i4"),
            mem_t_s=np.asarray(mem_t_s, dtype="f8"), mem_bytes=mem_b, peak_bytes=int(peak_bytes),
            peak_by_category=dict(peak_by_category or {}),
            peak_reserved_bytes=int(peak_bytes if peak_reserved_bytes is None else peak_reserved_bytes),
            memory_source=memory_source,
            spans={n: np.asarray(v, dtype=SPAN_COLUMNS[n]) for n, v in self._spans.items()},
            moe={n: np.asarray(v, dtype=MOE_COLUMNS[n]) for n, v in self._moe.items()},
            moe_ptr=np.asarray(self._moe_ptr, dtype="i8"),
            moe_tokens=np.asarray(self._moe_tokens, dtype="i8"))
