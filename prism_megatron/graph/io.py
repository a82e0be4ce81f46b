"""The graph file: one compressed zip, versioned, checksummed, written atomically, loaded without pickle.

Layout: `header.json` (schema version, the world's parameters, the string table, each distinct graph's
metadata with the sha256 of every array, and each role's entry naming its graph) plus one `.npy`
entry per array (`graphs/<i>/<array>.npy`), read back with `allow_pickle=False`. Roles inferred from a
verified-symmetric role share its graph: stored once, loaded once.

`load_graph` rejects, with one `GraphFileError` line each: a file
that is not a readable zip (truncated or corrupted), a missing or foreign header, another schema
version, a header whose fields are missing or of the wrong type, an array that is not a plain 1-D
array of its column's type or whose checksum or length disagrees with the header, NaN, infinite or
negative durations, string indices outside the string table, a dependency on a later node
(not a DAG), a world whose roles are not all present, and collectives that do not match across the
roles of a group (graph/check.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from dataclasses import asdict

import numpy as np

from prism_megatron.graph.check import GraphFileError, check_graph
from prism_megatron.graph.model import (
    COLUMNS,
    MOE_COLUMNS,
    SCHEMA_VERSION,
    SPAN_COLUMNS,
    ExecutionGraph,
    RoleGraph,
)
from prism_megatron.util import atomic_write_bytes
from prism_megatron.world import Role, VirtualWorld

FORMAT = "prism-execution-graph"
_WORLD_FIELDS = ("world_size", "tp", "pp", "cp", "ep", "etp", "vpp", "order", "gpus_per_node")
_EXTRA_ARRAYS = ("dep_ptr", "dep_idx", "mem_t_s", "mem_bytes", "moe_ptr", "moe_tokens")
_ARRAY_NAMES = (*COLUMNS, *_EXTRA_ARRAYS, *(f"span_{n}" for n in SPAN_COLUMNS),
                *(f"moe_{n}" for n in MOE_COLUMNS))
_GRAPH_FIELDS = ("peak_bytes", "peak_by_category", "peak_reserved_bytes", "memory_source")
_EXTRA_DTYPES = {"dep_ptr": "i8", "dep_idx": "i4", "mem_t_s": "f8", "mem_bytes": "i8", "moe_ptr": "i8",
                 "moe_tokens": "i8"}
_DTYPES = {**COLUMNS, **_EXTRA_DTYPES, **{f"span_{n}": t for n, t in SPAN_COLUMNS.items()},
           **{f"moe_{n}": t for n, t in MOE_COLUMNS.items()}}
"""Every array's type: a file's array must be of the same kind (integer or float) to be read."""


def _arrays(role: RoleGraph) -> dict[str, np.ndarray]:
    out = dict(role.columns)
    out.update({name: getattr(role, name) for name in _EXTRA_ARRAYS})
    out.update({f"span_{n}": a for n, a in role.spans.items()})
    out.update({f"moe_{n}": a for n, a in role.moe.items()})
    return out


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def save_graph(graph: ExecutionGraph, path: str) -> None:
    """Write `graph` to `path` atomically (readers see the old file or the whole new one)."""
    header = {"format": FORMAT, "schema_version": SCHEMA_VERSION,
              "world": {k: getattr(graph.world, k) for k in _WORLD_FIELDS},
              "strings": graph.strings, "meta": graph.meta, "graphs": [], "roles": []}
    entries: dict[str, bytes] = {}
    stored: dict[int, int] = {}  # id(dep_ptr) -> graph index: roles sharing arrays share the entry
    for role in graph.roles.values():
        index = stored.get(id(role.dep_ptr))
        if index is None:
            index = stored[id(role.dep_ptr)] = len(header["graphs"])
            checksums = {}
            for name, array in _arrays(role).items():
                data = _npy_bytes(array)
                entries[f"graphs/{index}/{name}.npy"] = data
                checksums[name] = hashlib.sha256(data).hexdigest()
            header["graphs"].append({"num_nodes": role.num_nodes, "sha256": checksums,
                                     **{k: getattr(role, k) for k in _GRAPH_FIELDS}})
        header["roles"].append({"role": asdict(role.role), "representative": role.representative,
                                "source": role.source, "graph": index})
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        zf.writestr("header.json", json.dumps(header))
        for name, data in entries.items():
            zf.writestr(name, data)
    atomic_write_bytes(path, buffer.getvalue())  # a killed writer leaves no partial or temporary file


def load_graph(path: str, *, check: bool = True) -> ExecutionGraph:
    """Read and verify a graph file; every problem is one `GraphFileError` line naming the file."""
    if not os.path.isfile(path):
        raise GraphFileError(f"{path}: {'a folder, not' if os.path.isdir(path) else 'no such'} graph file; give "
                             "the graph.prism that `prism-megatron capture --out DIR` wrote in DIR")
    try:
        with zipfile.ZipFile(path) as zf:
            header = _header(zf, path)
            graph = _read(zf, header, path)
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        raise GraphFileError(f"{path}: not a readable graph file ({err}); it is truncated or "
                             "corrupted: capture it again") from None
    if check:
        check_graph(graph, path)
    return graph


def _header(zf: zipfile.ZipFile, path: str) -> dict:
    try:
        header = json.loads(zf.read("header.json"))
    except KeyError:
        raise GraphFileError(f"{path}: no header.json; this is not a prism execution graph") from None
    except (ValueError, zipfile.BadZipFile) as err:
        raise GraphFileError(f"{path}: header.json is damaged ({err}); capture the graph again") from None
    if not isinstance(header, dict):
        raise GraphFileError(f"{path}: header.json holds a {type(header).__name__}, expected an object; "
                             "this is not a prism execution graph")
    if header.get("format") != FORMAT:
        raise GraphFileError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
    if header.get("schema_version") != SCHEMA_VERSION:
        raise GraphFileError(f"{path}: schema version {header.get('schema_version')}, this prism_megatron "
                             f"reads version {SCHEMA_VERSION}; capture again with this version")
    _check_header(header, path)
    return header


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_HEADER_FIELDS = {"world": dict, "strings": list, "meta": dict, "graphs": list, "roles": list}
_GRAPH_ENTRY = {"num_nodes": _is_int, "sha256": lambda v: isinstance(v, dict),
                "peak_bytes": lambda v: _is_int(v) and v >= 0,
                "peak_reserved_bytes": lambda v: _is_int(v) and v >= 0,
                "peak_by_category": lambda v: isinstance(v, dict) and all(
                    isinstance(k, str) and _is_int(n) for k, n in v.items()),
                "memory_source": lambda v: isinstance(v, str)}
_ROLE_ENTRY = {"role": lambda v: isinstance(v, dict), "representative": _is_int,
               "source": lambda v: isinstance(v, str), "graph": _is_int}


def _check_header(header: dict, path: str) -> None:
    """The header's schema: every field present with its type, before anything is built from it."""
    def bad(what: str) -> GraphFileError:
        return GraphFileError(f"{path}: header.json {what}; the file is damaged or was not written by "
                              "prism_megatron: capture the graph again")

    for key, kind in _HEADER_FIELDS.items():
        if not isinstance(header.get(key, {} if key == "meta" else None), kind):
            raise bad(f"field {key!r} is {type(header.get(key)).__name__}, expected a {kind.__name__}")
    if not all(isinstance(s, str) for s in header["strings"]):
        raise bad("string table holds non-strings")
    for table, checks, size in (("graphs", _GRAPH_ENTRY, None), ("roles", _ROLE_ENTRY, len(header["graphs"]))):
        for i, entry in enumerate(header[table]):
            if not isinstance(entry, dict):
                raise bad(f"{table}[{i}] is a {type(entry).__name__}, expected an object")
            wrong = [k for k, ok in checks.items() if k not in entry or not ok(entry[k])]
            if wrong:
                raise bad(f"{table}[{i}] has {'a missing or invalid' if len(wrong) == 1 else 'missing or invalid'}"
                          f" {', '.join(wrong)}")
            if size is not None and not 0 <= entry["graph"] < size:
                raise bad(f"roles[{i}] names graph {entry['graph']}, but there are {size}")


def _read(zf: zipfile.ZipFile, header: dict, path: str) -> ExecutionGraph:
    try:
        world = VirtualWorld(**header["world"])
    except (TypeError, ValueError) as err:
        raise GraphFileError(f"{path}: the world in the header is invalid: {err}") from None
    strings = len(header["strings"])
    graphs = [_read_graph(zf, i, meta, path, strings) for i, meta in enumerate(header["graphs"])]
    roles: dict[Role, RoleGraph] = {}
    for entry in header["roles"]:
        try:
            role, base = Role(**entry["role"]), graphs[entry["graph"]]
        except (TypeError, IndexError, KeyError) as err:
            raise GraphFileError(f"{path}: a role entry is malformed ({err}); the file is damaged") from None
        roles[role] = base.as_role(role, entry["representative"], entry["source"])
    return ExecutionGraph(world=world, roles=roles, strings=header["strings"],
                          meta=header.get("meta", {}))


def _read_graph(zf: zipfile.ZipFile, i: int, meta: dict, path: str, strings: int) -> RoleGraph:
    arrays = {}
    for name in _ARRAY_NAMES:
        entry = f"graphs/{i}/{name}.npy"
        try:
            data = zf.read(entry)
        except KeyError:
            raise GraphFileError(f"{path}: {entry} is missing; the file is incomplete") from None
        if hashlib.sha256(data).hexdigest() != meta["sha256"].get(name):
            raise GraphFileError(f"{path}: checksum mismatch in {entry}; the file is corrupted")
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise GraphFileError(f"{path}: {entry} is not a numeric array ({str(err).splitlines()[0]}); "
                                 "the file is damaged: capture the graph again") from None
        expected = np.dtype(_DTYPES[name])
        if array.ndim != 1 or array.dtype.kind not in ("f" if expected.kind == "f" else "iu"):
            raise GraphFileError(f"{path}: {entry} is a {array.ndim}-D {array.dtype} array, expected 1-D "
                                 f"{expected}; the file is damaged: capture the graph again")
        arrays[name] = array
    n = meta["num_nodes"]
    if len(arrays["dep_ptr"]) != n + 1 or any(len(arrays[c]) != n for c in COLUMNS):
        raise GraphFileError(f"{path}: graph {i} has columns of the wrong length for {n} nodes")
    _check_values(arrays, n, strings, f"{path}: graph {i}")
    return RoleGraph(
        role=Role(pp=0, tp=0, cp=0, ep=0, etp=0), representative=-1,
        columns={c: arrays[c] for c in COLUMNS},
        **{name: arrays[name] for name in _EXTRA_ARRAYS},
        spans={n: arrays[f"span_{n}"] for n in SPAN_COLUMNS},
        moe={n: arrays[f"moe_{n}"] for n in MOE_COLUMNS},
        **{k: meta[k] for k in _GRAPH_FIELDS})


def _check_values(a: dict[str, np.ndarray], n: int, strings: int, where: str) -> None:
    """Values a replay cannot use: each problem is one line naming the array."""
    def refuse(what: str) -> GraphFileError:
        return GraphFileError(f"{where}: {what}; the file is damaged or its capture went wrong: capture "
                              "the graph again")

    for name in ("start_s", "duration_s", "mem_t_s", "span_start_s", "span_end_s"):
        if not np.all(np.isfinite(a[name])):
            raise refuse(f"{name} holds {int(np.sum(~np.isfinite(a[name])))} NaN or infinite value(s)")
    for name in ("duration_s", "nbytes", "mem_bytes", "moe_tokens"):
        if np.any(a[name] < 0):
            raise refuse(f"{name} holds negative values (first {a[name][a[name] < 0][0]})")
    if not np.all(np.isin(a["kind"], (0, 1))):
        raise refuse("kind holds values other than 0 (compute) and 1 (communication)")
    for name in ("name", "stream", "op", "dim", "dtype", "span_name"):
        if np.any(a[name] < -1) or np.any(a[name] >= strings):
            raise refuse(f"{name} holds indices outside the string table of {strings}")
    for ptr, idx in (("dep_ptr", "dep_idx"), ("moe_ptr", "moe_tokens")):
        p = a[ptr]
        if len(p) == 0 or p[0] != 0 or np.any(np.diff(p) < 0) or p[-1] != len(a[idx]):
            raise refuse(f"{ptr} is not an index into {idx} (starting at 0, rising to its {len(a[idx])} "
                         "entries)")
    if len(a["mem_t_s"]) != len(a["mem_bytes"]):
        raise refuse(f"mem_t_s has {len(a['mem_t_s'])} entries and mem_bytes {len(a['mem_bytes'])}")
    for group, ref in ((SPAN_COLUMNS, "span_name"), (MOE_COLUMNS, "moe_layer")):
        prefix = ref.split("_")[0]
        lengths = {len(a[f"{prefix}_{c}"]) for c in group}
        if len(lengths) > 1:
            raise refuse(f"the {prefix} arrays have different lengths {sorted(lengths)}")
    if len(a["moe_ptr"]) != len(a["moe_layer"]) + 1:
        raise refuse(f"moe_ptr has {len(a['moe_ptr'])} entries for {len(a['moe_layer'])} MoE records")
    for name in ("span_first", "span_last"):
        if np.any(a[name] < 0) or np.any(a[name] >= max(n, 1)):
            raise refuse(f"{name} names nodes outside the graph's {n}")
