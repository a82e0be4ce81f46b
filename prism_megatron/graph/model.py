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
- memory is the allocated-bytes timeline with its peak and the breakdown at the peak.

Strings (op names, streams, dims, dtypes) live in one table per graph; columns hold their indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Optional, Sequence

import numpy as np

from prism_megatron.world import Role, VirtualWorld

SCHEMA_VERSION = 1
NO_PEER = np.iinfo(np.int32).min

COLUMNS: dict[str, str] = {  # name -> numpy dtype, one entry per node
    "kind": "u1", "name": "i4", "stream": "i4", "start_s": "f8", "duration_s": "f8",
    "op": "i4", "dim": "i4", "nbytes": "i8", "dtype": "i4", "seq": "i8", "peer_delta": "i4",
}


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

    @property
    def num_nodes(self) -> int:
        return len(self.dep_ptr) - 1

    def deps(self, node: int) -> np.ndarray:
        return self.dep_idx[self.dep_ptr[node]:self.dep_ptr[node + 1]]


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

    def build(self, *, mem_t_s: Sequence[float] = (), mem_bytes: Sequence[int] = (),
              peak_by_category: Optional[dict[str, int]] = None, source: str = "captured") -> RoleGraph:
        mem_b = np.asarray(mem_bytes, dtype="i8")
        return RoleGraph(
            role=self.role, representative=self.representative, source=source,
            columns={n: np.asarray(v, dtype=COLUMNS[n]) for n, v in self._rows.items()},
            dep_ptr=np.asarray(self._dep_ptr, dtype="i8"), dep_idx=np.asarray(self._deps, dtype="i4"),
            mem_t_s=np.asarray(mem_t_s, dtype="f8"), mem_bytes=mem_b,
            peak_bytes=int(mem_b.max()) if len(mem_b) else 0,
            peak_by_category=dict(peak_by_category or {}))
