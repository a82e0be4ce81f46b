"""The graph file: one compressed zip, versioned, checksummed, written atomically, loaded without pickle.

Layout: `header.json` (schema version, the world's parameters, the string table, each role's
metadata, and the sha256 of every array) plus one `.npy` entry per array (`roles/<i>/<column>.npy`),
read back with `allow_pickle=False`. `load_graph` rejects, with one `GraphFileError` line each: a file
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
    SCHEMA_VERSION,
    ExecutionGraph,
    RoleGraph,
)
from prism_megatron.world import Role, VirtualWorld

FORMAT = "prism-execution-graph"
_WORLD_FIELDS = ("world_size", "tp", "pp", "cp", "ep", "etp", "vpp", "order", "gpus_per_node")
_EXTRA_ARRAYS = ("dep_ptr", "dep_idx", "mem_t_s", "mem_bytes")


def _arrays(role: RoleGraph) -> dict[str, np.ndarray]:
    out = dict(role.columns)
    out.update({name: getattr(role, name) for name in _EXTRA_ARRAYS})
    return out


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def save_graph(graph: ExecutionGraph, path: str) -> None:
    """Write `graph` to `path` atomically (readers see the old file or the whole new one)."""
    header = {"format": FORMAT, "schema_version": SCHEMA_VERSION,
              "world": {k: getattr(graph.world, k) for k in _WORLD_FIELDS},
              "strings": graph.strings, "meta": graph.meta, "roles": []}
    entries: dict[str, bytes] = {}
    for i, role in enumerate(graph.roles.values()):
        checksums = {}
        for name, array in _arrays(role).items():
            data = _npy_bytes(array)
            entries[f"roles/{i}/{name}.npy"] = data
            checksums[name] = hashlib.sha256(data).hexdigest()
        header["roles"].append({"role": asdict(role.role), "representative": role.representative,
                                "source": role.source, "num_nodes": role.num_nodes,
                                "peak_bytes": role.peak_bytes,
                                "peak_by_category": role.peak_by_category, "sha256": checksums})
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
    roles: dict[Role, RoleGraph] = {}
    for i, meta in enumerate(header["roles"]):
        arrays = {}
        for name in (*COLUMNS, *_EXTRA_ARRAYS):
            entry = f"roles/{i}/{name}.npy"
            try:
                data = zf.read(entry)
            except KeyError:
                raise GraphFileError(f"{path}: {entry} is missing; the file is incomplete") from None
            if hashlib.sha256(data).hexdigest() != meta["sha256"].get(name):
                raise GraphFileError(f"{path}: checksum mismatch in {entry}; the file is corrupted")
            arrays[name] = np.load(io.BytesIO(data), allow_pickle=False)
        n = meta["num_nodes"]
        if len(arrays["dep_ptr"]) != n + 1 or any(len(arrays[c]) != n for c in COLUMNS):
            raise GraphFileError(f"{path}: role {i} has columns of the wrong length for {n} nodes")
        role = Role(**meta["role"])
        roles[role] = RoleGraph(
            role=role, representative=meta["representative"], source=meta["source"],
            columns={c: arrays[c] for c in COLUMNS},
            **{name: arrays[name] for name in _EXTRA_ARRAYS},
            peak_bytes=meta["peak_bytes"], peak_by_category=meta["peak_by_category"])
    return ExecutionGraph(world=world, roles=roles, strings=header["strings"],
                          meta=header.get("meta", {}))
