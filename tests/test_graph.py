"""The execution graph file: round trip, and every kind of bad file rejected with one line."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from prism_megatron.graph import (
    GraphFileError,
    RoleGraphBuilder,
    StringTable,
    load_graph,
    save_graph,
)
from prism_megatron.graph.synthetic import synthetic_graph
from prism_megatron.world import VirtualWorld

WORLD = VirtualWorld(world_size=16, tp=2, pp=4)


def test_round_trip_keeps_every_array_and_figure(tmp_path):
    graph = synthetic_graph(WORLD)
    path = str(tmp_path / "g.prism")
    save_graph(graph, path)
    back = load_graph(path)
    assert back.world == WORLD and back.strings == graph.strings and back.meta == graph.meta
    assert set(back.roles) == set(graph.roles)
    for role, g in graph.roles.items():
        h = back.roles[role]
        assert h.representative == g.representative and h.peak_bytes == g.peak_bytes == 5000 + role.pp
        assert h.peak_by_category == g.peak_by_category
        for name, column in g.columns.items():
            np.testing.assert_array_equal(h.columns[name], column)
        np.testing.assert_array_equal(h.dep_idx, g.dep_idx)
    # every rank of a role shares its role's graph
    assert back.graph_of(15) is back.roles[WORLD.role(15)]


def _one_line_error(path) -> str:
    with pytest.raises(GraphFileError) as err:
        load_graph(str(path))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_truncated_or_garbage_files_are_rejected(tmp_path):
    path = tmp_path / "g.prism"
    save_graph(synthetic_graph(WORLD), str(path))
    data = path.read_bytes()
    (tmp_path / "cut.prism").write_bytes(data[: len(data) // 2])
    assert "truncated or corrupted" in _one_line_error(tmp_path / "cut.prism")
    (tmp_path / "junk.prism").write_bytes(b"not a graph at all")
    assert "truncated or corrupted" in _one_line_error(tmp_path / "junk.prism")


def _rewrite(src, dst, change):
    """Copy a graph file, passing each entry through change(name, data) -> data."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item.filename, change(item.filename, zin.read(item.filename)))


def test_corrupted_array_wrong_version_and_foreign_files_are_rejected(tmp_path):
    path = tmp_path / "g.prism"
    save_graph(synthetic_graph(WORLD), str(path))

    def flip(name, data):
        return data[:-1] + bytes([data[-1] ^ 1]) if name.endswith("nbytes.npy") else data

    _rewrite(path, tmp_path / "flip.prism", flip)
    assert "checksum mismatch" in _one_line_error(tmp_path / "flip.prism")

    def version(name, data):
        if name != "header.json":
            return data
        header = json.loads(data)
        header["schema_version"] = 99
        return json.dumps(header).encode()

    _rewrite(path, tmp_path / "v99.prism", version)
    assert "schema version 99" in _one_line_error(tmp_path / "v99.prism")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("hello.txt", "hi")
    assert "no header.json" in _one_line_error(tmp_path / "other.zip")


def test_collectives_that_do_not_match_across_roles_are_rejected(tmp_path):
    graph = synthetic_graph(WORLD)
    other = synthetic_graph(WORLD, tp_bytes=8192)  # a different config's capture
    role = next(r for r in graph.roles if r.pp == 1 and r.tp == 1)
    graph.roles[role] = other.roles[role]
    save_graph(graph, str(tmp_path / "mixed.prism"))
    assert "do not match" in _one_line_error(tmp_path / "mixed.prism")


def test_unmatched_pipeline_messages_and_missing_roles_are_rejected(tmp_path):
    graph = synthetic_graph(WORLD)
    smaller = synthetic_graph(WORLD, pp_bytes=4096)
    for role in [r for r in graph.roles if r.pp == 0]:  # stage 0 sends 4 KB, stage 1 expects 8 KB
        graph.roles[role] = smaller.roles[role]
    save_graph(graph, str(tmp_path / "p2p.prism"))
    assert "no matching recv" in _one_line_error(tmp_path / "p2p.prism")
    first = next(r for r in graph.roles if r.pp == 0 and r.tp == 0)
    partial = synthetic_graph(WORLD)
    partial.roles.pop(first)
    save_graph(partial, str(tmp_path / "partial.prism"))
    assert "roles have no graph" in _one_line_error(tmp_path / "partial.prism")


def test_a_node_can_only_depend_on_earlier_nodes():
    b = RoleGraphBuilder(WORLD.roles()[0], 0, StringTable())
    first = b.compute("a", stream="s", start_s=0.0, duration_s=1.0)
    with pytest.raises(ValueError, match="earlier nodes"):
        b.compute("b", stream="s", start_s=1.0, duration_s=1.0, deps=[first + 1])


def test_a_world_of_8192_loads_as_128_role_graphs(tmp_path):
    world = VirtualWorld(world_size=8192, tp=8, pp=16)
    path = str(tmp_path / "big.prism")
    save_graph(synthetic_graph(world, microbatches=4), path)
    graph = load_graph(path)
    assert len(graph.roles) == 128 and graph.graph_of(4711).representative == world.representative(
        world.role(4711))


def test_perfetto_export_is_valid_chrome_trace_json(tmp_path):
    from prism_megatron.graph.perfetto import write_chrome_trace

    graph = synthetic_graph(WORLD)
    path = tmp_path / "trace.json"
    write_chrome_trace(graph, [0, 13], str(path))
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 13}
    assert len(complete) == graph.graph_of(0).num_nodes + graph.graph_of(13).num_nodes
    for e in complete:  # the Chrome trace event schema for complete events
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0
        assert isinstance(e["tid"], int) and e["cat"] in ("compute", "comm")
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert set(names.values()) == {"compute", "comm"}  # streams become tracks
    assert all((e["pid"], e["tid"]) in names for e in complete)
    sends = [e for e in complete if e["name"] == "send" and e["pid"] == 0]
    assert sends and all(e["args"]["dim"] == "pp" and e["args"]["peer_delta"] == 1 for e in sends)
    with pytest.raises(ValueError, match="outside the virtual world"):
        write_chrome_trace(graph, [16], str(path))
