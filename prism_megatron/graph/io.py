"""The graph file: one compressed zip, versioned, checksummed, written atomically, loaded without pickle.

Layout: `header.json` (schema version, the world's parameters, the string table, each distinct graph's
metadata with the sha256 of every array, and each role's entry naming its graph) plus one `.npy`
entry per array (`graphs/<i>/<array>.npy`), read back with `allow_pickle=False`. Roles inferred from a
verified-symmetric role share its graph: stored once, loaded once.

`load_graph` rejects, with one `GraphFileError` line each: a file
that is not a readable zip (truncated or corrupted), a missing or foreign header, another schema
version, an array whose checksum or length disagrees with the header, a dependency on a later node
(not a DAG), a world whose roles are not all present, and collectives that do not match across the
roles of a group (graph/check.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
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
from prism_megatron.world import Role, VirtualWorld

FORMAT = "prism-execution-graph"
_WORLD_FIELDS = ("world_size", "tp", "pp", "cp", "ep", "etp", "vpp", "order", "gpus_per_node")
_EXTRA_ARRAYS = ("dep_ptr", "dep_idx", "mem_t_s", "mem_bytes", "moe_ptr", "moe_tokens")
_ARRAY_NAMES = (*COLUMNS, *_EXTRA_ARRAYS, *(f"span_{n}" for n in SPAN_COLUMNS),
                *(f"moe_{n}" for n in MOE_COLUMNS))
_GRAPH_FIELDS = ("peak_bytes", "peak_by_category", "peak_reserved_bytes", "memory_source")


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
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-graph-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
                zf.writestr("header.json", json.dumps(header))
                for name, data in entries.items():
                    zf.writestr(name, data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_graph(path: str, *, check: bool = True) -> ExecutionGraph:
    """Read and verify a graph file; every problem is one `GraphFileError` line naming the file."""
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
    if header.get("format") != FORMAT:
        raise GraphFileError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
    if header.get("schema_version") != SCHEMA_VERSION:
        raise GraphFileError(f"{path}: schema version {header.get('schema_version')}, this prism_megatron "
                             f"reads version {SCHEMA_VERSION}; capture again with this version")
    return header


def _read(zf: zipfile.ZipFile, header: dict, path: str) -> ExecutionGraph:
    try:
        world = VirtualWorld(**header["world"])
    except (TypeError, ValueError) as err:
        raise GraphFileError(f"{path}: the world in the header is invalid: {err}") from None
    graphs = [_read_graph(zf, i, meta, path) for i, meta in enumerate(header["graphs"])]
    roles: dict[Role, RoleGraph] = {}
    for entry in header["roles"]:
        try:
            role, base = Role(**entry["role"]), graphs[entry["graph"]]
        except (TypeError, IndexError, KeyError) as err:
            raise GraphFileError(f"{path}: a role entry is malformed ({err}); the file is damaged") from None
        roles[role] = base.as_role(role, entry["representative"], entry["source"])
    return ExecutionGraph(world=world, roles=roles, strings=header["strings"],
                          meta=header.get("meta", {}))


def _read_graph(zf: zipfile.ZipFile, i: int, meta: dict, path: str) -> RoleGraph:
    arrays = {}
    for name in _ARRAY_NAMES:
        entry = f"graphs/{i}/{name}.npy"
        try:
            data = zf.read(entry)
        except KeyError:
            raise GraphFileError(f"{path}: {entry} is missing; the file is incomplete") from None
        if hashlib.sha256(data).hexdigest() != meta["sha256"].get(name):
            raise GraphFileError(f"{path}: checksum mismatch in {entry}; the file is corrupted")
        arrays[name] = np.load(io.BytesIO(data), allow_pickle=False)
    n = meta["num_nodes"]
    if len(arrays["dep_ptr"]) != n + 1 or any(len(arrays[c]) != n for c in COLUMNS):
        raise GraphFileError(f"{path}: graph {i} has columns of the wrong length for {n} nodes")
    return RoleGraph(
        role=Role(pp=0, tp=0, cp=0, ep=0, etp=0), representative=-1,
        columns={c: arrays[c] for c in COLUMNS},
        **{name: arrays[name] for name in _EXTRA_ARRAYS},
        spans={n: arrays[f"span_{n}"] for n in SPAN_COLUMNS},
        moe={n: arrays[f"moe_{n}"] for n in MOE_COLUMNS},
        **{k: meta[k] for k in _GRAPH_FIELDS})
