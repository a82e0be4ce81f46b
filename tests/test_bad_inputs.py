"""Bad input, generated: every case exits 2 with one line on stderr, no traceback, nothing left behind.

The cases are what a user could type: unknown keys, wrong types, values out of range, missing,
damaged or unwritable files, broken YAML and corrupted graph files, for every subcommand and the
graph loader. They run in-process (`cli.main`), a few through a real subprocess with a timeout.
Anything that would start real work (a capture, sandboxes, a calibration, a sweep, the training
example) is replaced by a tripwire: a bad input must be refused before it, not half-way through.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from prism_megatron import cli
from prism_megatron.graph.io import save_graph
from prism_megatron.graph.synthetic import synthetic_graph
from prism_megatron.world import VirtualWorld

# A valid 8-rank world (tp2 x pp2 x dp2) whose config the cases break one thing of.
WORLD8 = ["emulation.virtual_world_size=8", "emulation.sandbox_ranks=[0]", "parallel.tp=2",
          "parallel.pp=2", "model.num_layers=2", "train.global_batch_size=4", "train.micro_batch_size=1"]
MOE8 = [*WORLD8, "model=tiny_moe", "model.num_layers=2"]

# --- files the cases name: written once per module -------------------------------------------------

TEXT_FILES = {
    "malformed.yaml": "parallel:\n  tp: [2,\n",
    "tabs.yaml": "parallel:\n\ttp: 2\n",
    "list.yaml": "- parallel\n- tp\n",
    "scalar.yaml": "just some words\n",
    "unknown_section.yaml": "paralel:\n  tp: 2\n",
    "unknown_key.yaml": "parallel:\n  tpp: 2\n",
    "wrong_type.yaml": "parallel:\n  tp: two\n",
    "section_scalar.yaml": "parallel: 8\n",
    "bad_preset.yaml": "model: gpt5\n",
    "zero_tp.yaml": "parallel:\n  tp: 0\n",
    "duplicate_key.yaml": "parallel:\n  tp: 2\n  tp: 4\n",
    "cluster_malformed.yaml": "name: x\ngpus_per_node: [8,\n",
    "cluster_unknown_key.yaml": "name: x\ngpu_count: 8\n",
    "cluster_wrong_type.yaml": "name: x\ngpus_per_node: eight\n",
    "cluster_float_type.yaml": "name: x\nnic_Gbps: fast\n",
    "cluster_list.yaml": "- dgx\n",
    "cluster_tabs.yaml": "name: x\n\tnic_Gbps: 400\n",
    "cluster_nan.yaml": "name: x\nnic_Gbps: .nan\n",
    "cluster_negative.yaml": "name: x\nnvlink_GBps: -450\n",
    "calib_list.json": "[1, 2, 3]",
    "calib_points_dict.json": '{"points": {"a": 1}, "fits": {}}',
    "calib_fits_list.json": '{"points": [], "fits": [1, 2]}',
    "calib_string.json": '"calibration"',
    "calib_garbage.json": "this is not json",
    "calib_fit_shape.json": '{"points": [], "fits": {"all_reduce/inter/8": {"segments": 3}}}',
    "log_garbage.json": "{not json",
    "log_list.json": "[]",
    "log_ranks_list.json": '{"ranks": []}',
    "log_strings.json": '{"ranks": {"0": {"iteration_s": ["fast", "slow"]}}}',
    "log_bad_rank.json": '{"ranks": {"x": {"iteration_s": [0.01, 0.01]}}}',
    "log_far_rank.json": '{"ranks": {"999": {"iteration_s": [0.01, 0.01]}}}',
    "log_nan.json": '{"ranks": {"0": {"iteration_s": [NaN, 0.01]}}}',
    "log_empty_ranks.json": '{"ranks": {}}',
    "summary_garbage.json": "{half a summary",
    "summary_list.json": "[1, 2]",
    "plain.txt": "a regular file, not a folder\n",
    "empty.json": "",
}
BYTE_FILES = {
    "latin1.yaml": "model:\n  num_layers: 4 # \xe9t\xe9\n".encode("latin-1"),
    "binary.yaml": bytes(range(256)),
}


def _graph_entries(path: Path) -> tuple[dict, dict[str, bytes]]:
    with zipfile.ZipFile(path) as zf:
        return json.loads(zf.read("header.json")), {n: zf.read(n) for n in zf.namelist() if n != "header.json"}


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def _write_zip(path: Path, header, entries: dict[str, bytes], header_text: str | None = None) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("header.json", header_text if header_text is not None else json.dumps(header))
        for name, data in entries.items():
            zf.writestr(name, data)


def _with_array(valid: Path, name: str, change, graph: int = 0):
    """A graph file whose array `name` of graph `graph` is `change(array)`, checksum made to match
    (so only the content checks can catch it)."""
    def make(path: Path) -> None:
        header, entries = _graph_entries(valid)
        key = f"graphs/{graph}/{name}.npy"
        data = _npy(change(np.load(io.BytesIO(entries[key]), allow_pickle=False)))
        entries[key] = data
        header["graphs"][graph]["sha256"][name] = hashlib.sha256(data).hexdigest()
        _write_zip(path, header, entries)
    return make


def _with_header(valid: Path, change):
    def make(path: Path) -> None:
        header, entries = _graph_entries(valid)
        _write_zip(path, change(header), entries)
    return make


def _set(mapping: dict, dotted: str, value):
    keys = dotted.split(".")
    node = mapping
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is _DELETE:
        node.pop(keys[-1]) if isinstance(node, dict) else node.pop(int(keys[-1]))
    elif isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value
    return mapping


_DELETE = object()


def _header_set(valid: Path, dotted: str, value):
    return _with_header(valid, lambda h: _set(h, dotted, value))


def _set_at(index: int, value):
    def change(a: np.ndarray) -> np.ndarray:
        a = a.copy()
        a[index] = value
        return a
    return change


def _corrupt_graphs(valid: Path) -> dict:
    """name -> a function writing that corrupted graph file to a path."""
    first = "graphs/0/duration_s.npy"

    def entries() -> dict[str, bytes]:
        return _graph_entries(valid)[1]

    def header_text(text: str):
        return lambda p: _write_zip(p, None, entries(), header_text=text)

    def without(entry: str):
        return lambda p: _write_zip(p, _graph_entries(valid)[0],
                                    {k: v for k, v in entries().items() if k != entry})

    def tampered(p: Path) -> None:
        header, changed = _graph_entries(valid)
        changed[first] = changed[first][:-8] + b"\x00" * 8
        _write_zip(p, header, changed)

    def garbage_npy(p: Path) -> None:
        h, e = _graph_entries(valid)
        e[first] = b"not an npy array at all"
        h["graphs"][0]["sha256"]["duration_s"] = hashlib.sha256(e[first]).hexdigest()
        _write_zip(p, h, e)

    def drop_role(h: dict) -> dict:
        h["roles"] = h["roles"][:-1]
        return h

    def mismatched_collective(p: Path) -> None:  # role 0's tp all-reduce of other bytes than its peer's
        _with_array(valid, "nbytes", lambda a: a * 2, graph=0)(p)

    return {
        "truncated_half": lambda p: p.write_bytes(valid.read_bytes()[: valid.stat().st_size // 2]),
        "truncated_head": lambda p: p.write_bytes(valid.read_bytes()[:100]),
        "empty": lambda p: p.write_bytes(b""),
        "random_bytes": lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)),
        "yaml_text": lambda p: p.write_text("parallel:\n  tp: 2\n"),
        "gzip_magic": lambda p: p.write_bytes(b"\x1f\x8b\x08\x00" + valid.read_bytes()[4:]),
        "zip_magic_flipped": lambda p: p.write_bytes(b"PK\x05\x06" + valid.read_bytes()[4:]),
        "no_header": lambda p: _write_zip_no_header(p, entries()),
        "header_not_json": header_text("{format: prism"),
        "header_list": header_text("[]"),
        "header_string": header_text('"prism"'),
        "format_foreign": _header_set(valid, "format", "chakra-et"),
        "schema_old": _header_set(valid, "schema_version", 1),
        "schema_string": _header_set(valid, "schema_version", "2"),
        "world_missing": _header_set(valid, "world", _DELETE),
        "world_list": _header_set(valid, "world", [8, 2, 2]),
        "world_tp_string": _header_set(valid, "world.tp", "two"),
        "world_tp_float": _header_set(valid, "world.tp", 2.5),
        "world_tp_not_dividing": _header_set(valid, "world.tp", 3),
        "world_size_zero": _header_set(valid, "world.world_size", 0),
        "world_size_2_30": _header_set(valid, "world.world_size", 2**30),
        "world_unknown_key": _header_set(valid, "world.zp", 2),
        "world_order_foreign": _header_set(valid, "world.order", "tp-pp-foo"),
        "strings_missing": _header_set(valid, "strings", _DELETE),
        "strings_dict": _header_set(valid, "strings", {"a": 1}),
        "strings_numbers": _header_set(valid, "strings", list(range(12))),
        "meta_list": _header_set(valid, "meta", [1, 2]),
        "graphs_missing": _header_set(valid, "graphs", _DELETE),
        "graphs_int": _header_set(valid, "graphs", 4),
        "graph_entry_string": _header_set(valid, "graphs.0", "graph"),
        "sha_missing": _header_set(valid, "graphs.0.sha256", _DELETE),
        "sha_list": _header_set(valid, "graphs.0.sha256", []),
        "num_nodes_missing": _header_set(valid, "graphs.0.num_nodes", _DELETE),
        "num_nodes_string": _header_set(valid, "graphs.0.num_nodes", "13"),
        "num_nodes_wrong": _header_set(valid, "graphs.0.num_nodes", 14),
        "num_nodes_negative": _header_set(valid, "graphs.0.num_nodes", -1),
        "peak_missing": _header_set(valid, "graphs.0.peak_bytes", _DELETE),
        "peak_string": _header_set(valid, "graphs.0.peak_bytes", "lots"),
        "peak_negative": _header_set(valid, "graphs.0.peak_bytes", -5),
        "peak_by_category_list": _header_set(valid, "graphs.0.peak_by_category", [1]),
        "roles_missing": _header_set(valid, "roles", _DELETE),
        "roles_dict": _header_set(valid, "roles", {"a": 1}),
        "role_dropped": _with_header(valid, drop_role),
        "role_graph_index_out": _header_set(valid, "roles.0.graph", 99),
        "role_graph_index_negative": _header_set(valid, "roles.0.graph", -1),
        "role_graph_index_string": _header_set(valid, "roles.0.graph", "0"),
        "role_field_missing": _header_set(valid, "roles.0.role.pp", _DELETE),
        "role_field_string": _header_set(valid, "roles.0.role.pp", "zero"),
        "role_outside_world": _header_set(valid, "roles.0.role.pp", 7),
        "role_representative_missing": _header_set(valid, "roles.0.representative", _DELETE),
        "role_entry_list": _header_set(valid, "roles.0", [0, 1]),
        "array_missing": without(first),
        "checksum_mismatch": tampered,
        "npy_garbage": garbage_npy,
        "npy_pickled_objects": _with_array(valid, "duration_s", lambda a: a.astype(object)),
        "duration_strings": _with_array(valid, "duration_s", lambda a: a.astype(str)),
        "duration_2d": _with_array(valid, "duration_s", lambda a: np.stack([a, a])),
        "kind_float": _with_array(valid, "kind", lambda a: a.astype("f8") + 0.5),
        "name_complex": _with_array(valid, "name", lambda a: a.astype("c16")),
        "duration_short": _with_array(valid, "duration_s", lambda a: a[:-1]),
        "start_long": _with_array(valid, "start_s", lambda a: np.append(a, 0.0)),
        "dep_ptr_short": _with_array(valid, "dep_ptr", lambda a: a[:-1]),
        "duration_nan": _with_array(valid, "duration_s", _set_at(0, np.nan)),
        "duration_negative": _with_array(valid, "duration_s", _set_at(1, -1e-3)),
        "duration_inf": _with_array(valid, "duration_s", _set_at(2, np.inf)),
        "start_nan": _with_array(valid, "start_s", _set_at(3, np.nan)),
        "start_negative_inf": _with_array(valid, "start_s", _set_at(0, -np.inf)),
        "nbytes_negative": _with_array(valid, "nbytes", _set_at(2, -4096)),
        "mem_bytes_negative": _with_array(valid, "mem_bytes", _set_at(0, -1000)),
        "mem_t_nan": _with_array(valid, "mem_t_s", _set_at(1, np.nan)),
        "mem_length_mismatch": _with_array(valid, "mem_bytes", lambda a: a[:-1]),
        "dep_later_node": _with_array(valid, "dep_idx", _set_at(0, 12)),
        "dep_negative": _with_array(valid, "dep_idx", _set_at(0, -3)),
        "dep_ptr_decreasing": _with_array(valid, "dep_ptr", _set_at(2, 9)),
        "dep_ptr_past_end": _with_array(valid, "dep_ptr", lambda a: a + 5),
        "name_index_out_of_table": _with_array(valid, "name", _set_at(0, 10**6)),
        "op_index_negative": _with_array(valid, "op", _set_at(2, -7)),
        "kind_unknown": _with_array(valid, "kind", _set_at(0, 7)),
        "moe_ptr_past_tokens": _with_array(valid, "moe_ptr", lambda a: a + 3),
        "collectives_mismatch": mismatched_collective,
    }


def _write_zip_no_header(path: Path, entries: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Every file a case names (valid ones included): name -> path."""
    root = tmp_path_factory.mktemp("inputs")
    files: dict[str, str] = {}
    for name, text in TEXT_FILES.items():
        (root / name).write_text(text)
    for name, data in BYTE_FILES.items():
        (root / name).write_bytes(data)
    graph = root / "graph.prism"
    save_graph(synthetic_graph(VirtualWorld(world_size=8, tp=2, pp=2)), str(graph))
    for name, make in _corrupt_graphs(graph).items():
        make(root / f"{name}.prism")
    (root / "folder.prism").mkdir()
    (root / "summary_garbage").mkdir()
    (root / "summary_garbage" / "run.json").write_text(TEXT_FILES["summary_garbage.json"])
    (root / "summary_list").mkdir()
    (root / "summary_list" / "run.json").write_text(TEXT_FILES["summary_list.json"])
    (root / "summary_no_graph").mkdir()
    (root / "summary_no_graph" / "run.json").write_text('{"graph_path": "/nonexistent/graph.prism"}')
    (root / "summary_bad_rows").mkdir()
    (root / "summary_bad_rows" / "run.json").write_text(json.dumps(
        {"graph_path": str(graph), "sandbox": [{"virtual_rank": "zero"}]}))
    (root / "empty_run").mkdir()
    for p in root.iterdir():
        files[p.name] = str(p)
    files["missing.yaml"] = str(root / "missing.yaml")
    files["missing.json"] = str(root / "missing.json")
    files["missing.prism"] = str(root / "missing.prism")
    files["missing_run"] = str(root / "missing_run")
    files["under_file"] = str(root / "plain.txt" / "out")  # a path below a regular file: unwritable
    files["proc"] = "/proc/prism-megatron-cannot-write-here/out"
    return files


# --- the cases ---------------------------------------------------------------------------------------
#
# Each is (id, argv). In argv, "{name}" is the path of input file `name`, "{out}" a fresh path that
# must still not exist afterwards, and "{unwritable}" the path below a regular file.

BAD_OVERRIDES = [
    # unknown keys
    "parallel.tpp=2", "paralel.tp=2", "foo=1", "model.layers=4", "emulation.world_size=8",
    # wrong types
    "parallel.tp=two", "parallel.tp=1.5", "parallel.tp=[2]", "train.lr=fast", "model.num_layers=abc",
    "parallel.sequence_parallel=maybe", "emulation.sandbox_ranks=abc", "emulation.sandbox_ranks=[a]",
    "model.hidden_size={}",
    # out of range
    "parallel.tp=0", "parallel.pp=-2", "model.num_layers=0", "train.iters=0", "train.lr=nan",
    "train.lr=inf", "train.lr=-1", "train.micro_batch_size=0", "emulation.virtual_world_size=0",
    "emulation.virtual_world_size=1073741824", "emulation.gpus_per_node=0", "trace.iteration=0",
    "emulation.sandbox_ranks=[-1]", "emulation.stop_after=-1", "model.hidden_size=65",
    "model.moe_expert_capacity_factor=nan", "train.global_batch_size=3",
    # unknown choices
    "parallel.order=tp-pp-foo", "parallel.order=tp-tp-cp-ep-dp-pp", "model.params_dtype=fp8",
    "train.device=tpu", "train.framework=jax", "emulation.execution=maybe", "emulation.clock=wall",
    "emulation.ghost_policy=ones", "trace.granularity=kernel", "model=gpt5",
    # moe / faults specs
    "moe.imbalance=zipf(nan)", "moe.imbalance=dirichlet(nan)", "moe.imbalance=zipf(-1)",
    "moe.imbalance=pareto(1)", "moe.drift_per_iteration=nan", "faults.inject=slow(x)",
    # not key=value
    "parallel.tp", "=2",
]
MOE_OVERRIDES = ["moe.imbalance=hot-experts(99, 0.5)", "moe.imbalance=hot-experts(2, 1.5)",
                 "moe.imbalance=zipf(inf)", "moe.imbalance=dirichlet(0)", "parallel.ep=3"]
BAD_CONFIG_FILES = ["missing.yaml", "folder.prism", "malformed.yaml", "tabs.yaml", "latin1.yaml",
                    "binary.yaml", "list.yaml", "scalar.yaml", "unknown_section.yaml", "unknown_key.yaml",
                    "wrong_type.yaml", "section_scalar.yaml", "bad_preset.yaml", "zero_tp.yaml",
                    "duplicate_key.yaml"]
BAD_CLUSTERS = ["cluster=dgx_h900", "cluster={missing.yaml}", "cluster={cluster_malformed.yaml}",
                "cluster={cluster_unknown_key.yaml}", "cluster={cluster_wrong_type.yaml}",
                "cluster={cluster_float_type.yaml}", "cluster={cluster_list.yaml}",
                "cluster={cluster_tabs.yaml}", "cluster={cluster_nan.yaml}", "cluster={cluster_negative.yaml}",
                "cluster={latin1.yaml}", "cluster.nic_Gbps=0", "cluster.nic_Gbps=fast", "cluster.nic_Gbps=nan",
                "cluster.gpus_per_node=2.5", "cluster.nic_gbps=400", "cluster.nvls=[1]"]
BAD_CALIBRATIONS = ["calibration={missing.json}", "calibration={calib_list.json}",
                    "calibration={calib_points_dict.json}", "calibration={calib_fits_list.json}",
                    "calibration={calib_string.json}", "calibration={calib_garbage.json}",
                    "calibration={calib_fit_shape.json}", "calibration={empty.json}",
                    "calibration={folder.prism}"]
GRAPH_FILES = ["missing.prism", "folder.prism", *(f"{n}.prism" for n in _corrupt_graphs(Path("-")))]


def _cases() -> list[tuple[str, list[str]]]:
    cases: list[tuple[str, list[str]]] = []

    def add(cid: str, *argv: str) -> None:
        cases.append((cid, list(argv)))

    # top level
    add("no-command")
    add("unknown-command", "frobnicate")
    add("script-to-world", "world", "--", "train.py")
    add("nothing-after-dashes", "capture", "--out", "{out}", "--")
    add("launch-no-script", "launch")
    add("launch-nproc-zero", "launch", "--nproc-per-node", "0", "--", "train.py")
    # config overrides, through every command that takes them
    for o in BAD_OVERRIDES:
        add(f"config[{o}]", "config", *WORLD8, o)
        add(f"world[{o}]", "world", *WORLD8, o)
    for o in BAD_OVERRIDES[::4]:
        add(f"train[{o}]", "train", *WORLD8, o, "--json", "{out}")
        add(f"capture[{o}]", "capture", *WORLD8, o, "--out", "{out}")
        add(f"run[{o}]", "run", *WORLD8, o, "--out", "{out}")
        add(f"moe-check[{o}]", "moe-check", *MOE8, o, "--out", "{out}")
    for o in MOE_OVERRIDES:
        add(f"config-moe[{o}]", "config", *MOE8, o)
        add(f"moe-check-moe[{o}]", "moe-check", *MOE8, o, "--out", "{out}")
    # config files
    for f in BAD_CONFIG_FILES:
        add(f"config--config[{f}]", "config", "--config", f"{{{f}}}")
        add(f"world--config[{f}]", "world", "--config", f"{{{f}}}")
    for f in BAD_CONFIG_FILES[::3]:
        add(f"capture--config[{f}]", "capture", "--config", f"{{{f}}}", "--out", "{out}")
        add(f"sweep--config[{f}]", "sweep", "--config", f"{{{f}}}", "parallel.tp=1,2", "--out", "{out}")
    # world
    for rank in ("-1", "8", "99999", "x"):
        add(f"world--rank[{rank}]", "world", *WORLD8, "--rank", rank)
    add("world-no-world", "world", "--config", "{plain.txt}")
    add("world--json-unwritable", "world", *WORLD8, "--json", "{unwritable}")
    add("config--bogus-flag", "config", "--bogus")
    # unwritable outputs before any work
    add("train--json-unwritable", "train", *WORLD8, "--json", "{unwritable}")
    add("capture--out-unwritable", "capture", *WORLD8, "--out", "{unwritable}")
    add("capture--json-unwritable", "capture", *WORLD8, "--out", "{out}", "--json", "{unwritable}")
    add("capture--out-is-file", "capture", *WORLD8, "--out", "{plain.txt}")
    add("capture--workers-zero", "capture", *WORLD8, "--out", "{out}", "--workers", "0")
    add("capture--workers-x", "capture", *WORLD8, "--out", "{out}", "--workers", "x")
    add("capture--device-tpu", "capture", *WORLD8, "--out", "{out}", "--device", "tpu")
    add("capture-no-out", "capture", *WORLD8)
    add("capture-missing-script", "capture", *WORLD8, "--out", "{out}", "--", "{missing.yaml}")
    add("run--out-unwritable", "run", *WORLD8, "--out", "{unwritable}")
    add("run--json-proc", "run", *WORLD8, "--out", "{out}", "--json", "{proc}")
    add("run--workers-zero", "run", *WORLD8, "--out", "{out}", "--workers", "0")
    add("run--sandbox-bogus", "run", *WORLD8, "--out", "{out}", "--sandbox", "hottest")
    add("run--clock-wall", "run", *WORLD8, "--out", "{out}", "--clock", "wall")
    add("run--faults-bad", "run", *WORLD8, "--out", "{out}", "--faults", "slow(x)")
    add("run--faults-unknown", "run", *WORLD8, "--out", "{out}", "--faults", "melt(0, 2)")
    add("moe-check-dense", "moe-check", *WORLD8, "--out", "{out}")
    add("moe-check--capacity-x", "moe-check", *MOE8, "moe.imbalance=zipf(1.2)", "--out", "{out}",
        "--capacity", "lots")
    add("moe-check--capacity-zero", "moe-check", *MOE8, "moe.imbalance=zipf(1.2)", "--out", "{out}",
        "--capacity", "0")
    add("moe-check--out-unwritable", "moe-check", *MOE8, "moe.imbalance=zipf(1.2)", "--out", "{unwritable}")
    add("moe-check-cluster", "moe-check", *MOE8, "moe.imbalance=zipf(1.2)", "cluster=dgx_h900", "--out", "{out}")
    # sweep
    add("sweep--jobs-zero", "sweep", *WORLD8, "parallel.tp=1,2", "--out", "{out}", "--jobs", "0")
    add("sweep--workers-zero", "sweep", *WORLD8, "parallel.tp=1,2", "--out", "{out}", "--workers", "0")
    add("sweep--cluster", "sweep", *WORLD8, "parallel.tp=1,2", "--out", "{out}", "--cluster", "dgx_h900")
    add("sweep--out-unwritable", "sweep", *WORLD8, "parallel.tp=1,2", "--out", "{unwritable}")
    add("sweep--json-unwritable", "sweep", *WORLD8, "parallel.tp=1,2", "--out", "{out}", "--json",
        "{unwritable}")
    add("sweep-range-x", "sweep", *WORLD8, "parallel.tp=range(x)", "--out", "{out}")
    add("sweep-unknown-key", "sweep", *WORLD8, "parallel.tpp=1,2", "--out", "{out}")
    add("sweep-only-bad-points", "sweep", *WORLD8, "parallel.tp=0,-1", "--out", "{out}")
    add("sweep-glob-not-a-group", "sweep", *WORLD8, "parallel.tp=glob(*)", "--out", "{out}")
    add("sweep-glob-no-preset", "sweep", *WORLD8, "model=glob(zzz*)", "--out", "{out}")
    add("sweep-launcher-unknown", "sweep", *WORLD8, "parallel.tp=1,2", "hydra/launcher=nope", "--out", "{out}")
    add("sweep-search-unknown", "sweep", *WORLD8, "parallel.tp=1,2", "hydra.sweeper.search=bayes", "--out",
        "{out}")
    add("sweep-trials-zero", "sweep", *WORLD8, "parallel.tp=1,2", "hydra.sweeper.n_trials=0", "--out", "{out}")
    # simulate: what-ifs, clusters, calibration, outputs
    for o in [*BAD_CLUSTERS, *BAD_CALIBRATIONS, "slowdown.x=1.5", "slowdown.0=abc", "slowdown.0=0",
              "slowdown.0=nan", "slowdown.0=-2", "slowdown.99=1.5", "microbatches=0", "microbatches=abc",
              "microbatches=nan", "microbatches=3", "foo=bar", "cluster="]:
        add(f"simulate[{o}]", "simulate", "{graph.prism}", o, "--json", "{out}")
    add("simulate--json-unwritable", "simulate", "{graph.prism}", "--json", "{unwritable}")
    add("simulate--csv-unwritable", "simulate", "{graph.prism}", "--csv", "{unwritable}")
    add("simulate--json-is-folder", "simulate", "{graph.prism}", "--json", "{folder.prism}")
    add("simulate--perfetto-ranks", "simulate", "{graph.prism}", "--perfetto", "{out}", "--ranks", "0,x")
    add("simulate--perfetto-ranks-out", "simulate", "{graph.prism}", "--perfetto", "{out}", "--ranks", "64")
    # faults
    for o in BAD_CLUSTERS[::3] + BAD_CALIBRATIONS[::2]:
        add(f"faults[{o}]", "faults", "{graph.prism}", o, "--inject", "slow(0, 1.5)", "--json", "{out}")
    for spec in ("slow(x)", "slow(99, 1.5)", "", ";", "slow(0, -1)", "slow(0, nan)", "link(node9, 2)",
                 "throttle(0)", "melt(0, 2)"):
        add(f"faults--inject[{spec}]", "faults", "{graph.prism}", "--inject", spec, "--json", "{out}")
    for log in ("missing.json", "log_garbage.json", "log_list.json", "log_ranks_list.json",
                "log_strings.json", "log_bad_rank.json", "log_far_rank.json", "log_nan.json",
                "log_empty_ranks.json", "folder.prism"):
        add(f"faults--fit[{log}]", "faults", "{graph.prism}", "--fit", f"{{{log}}}", "--json", "{out}")
    add("faults-neither", "faults", "{graph.prism}")
    add("faults-both", "faults", "{graph.prism}", "--inject", "slow(0, 1.5)", "--fit", "{log_list.json}")
    add("faults--iterations-zero", "faults", "{graph.prism}", "--inject", "slow(0, 1.5)", "--iterations", "0")
    add("faults--iterations-x", "faults", "{graph.prism}", "--inject", "slow(0, 1.5)", "--iterations", "x")
    add("faults--candidates", "faults", "{graph.prism}", "--fit", "{log_list.json}", "--candidates", "some")
    add("faults--heatmap-unwritable", "faults", "{graph.prism}", "--inject", "slow(0, 1.5)", "--heatmap",
        "{unwritable}")
    add("faults--json-unwritable", "faults", "{graph.prism}", "--inject", "slow(0, 1.5)", "--json",
        "{unwritable}")
    # export
    add("export-nothing", "export", "{graph.prism}")
    add("export--ranks-x", "export", "{graph.prism}", "--perfetto", "{out}", "--ranks", "x")
    add("export--ranks-out", "export", "{graph.prism}", "--perfetto", "{out}", "--ranks", "8")
    add("export--ranks-negative", "export", "{graph.prism}", "--perfetto", "{out}", "--ranks", "-1")
    add("export--perfetto-unwritable", "export", "{graph.prism}", "--perfetto", "{unwritable}")
    add("export--chakra-is-file", "export", "{graph.prism}", "--chakra", "{plain.txt}")
    add("export--chakra-unwritable", "export", "{graph.prism}", "--chakra", "{unwritable}")
    # emulate
    add("emulate--sandbox-bogus", "emulate", "{graph.prism}", "--out", "{out}", "--sandbox", "hottest")
    add("emulate--clock-wall", "emulate", "{graph.prism}", "--out", "{out}", "--clock", "wall")
    add("emulate--device-tpu", "emulate", "{graph.prism}", "--out", "{out}", "--device", "tpu")
    add("emulate-cluster", "emulate", "{graph.prism}", "cluster=dgx_h900", "--out", "{out}")
    add("emulate-slowdown", "emulate", "{graph.prism}", "slowdown.0=2", "--out", "{out}")
    add("emulate--faults-bad", "emulate", "{graph.prism}", "--out", "{out}", "--faults", "slow(x)")
    add("emulate--faults-factor", "emulate", "{graph.prism}", "--out", "{out}", "--faults", "slow(0, -1)")
    for sandbox in ("8", "99", "-1"):  # outside the graph's world: refused before --out is made
        add(f"emulate--sandbox[{sandbox}]", "emulate", "{graph.prism}", "--out", "{out}", "--sandbox", sandbox)
    for spec in ("slow(99, 1.5)", "link(node9, 2)"):
        add(f"emulate--faults[{spec}]", "emulate", "{graph.prism}", "--out", "{out}", "--faults", spec)
    add("emulate-calibration", "emulate", "{graph.prism}", "calibration={calib_list.json}", "--out", "{out}")
    add("emulate--out-unwritable", "emulate", "{graph.prism}", "--out", "{unwritable}")
    add("emulate--json-unwritable", "emulate", "{graph.prism}", "--out", "{out}", "--json", "{unwritable}")
    add("emulate-no-out", "emulate", "{graph.prism}")
    # calibrate
    for flags in (["--nproc", "0"], ["--nproc", "1"], ["--nproc", "-3"], ["--nproc", "x"],
                  ["--min-bytes", "abc"], ["--min-bytes", "1GiB", "--max-bytes", "1KiB"],
                  ["--max-bytes", "0"], ["--device", "tpu"], ["--ops", "{missing.json}"], ["--quick"],
                  ["--host-modules"]):
        add(f"calibrate{flags}", "calibrate", "--device", "cpu", *flags, "--out", "{out}")
    add("calibrate-no-out", "calibrate", "--device", "cpu")
    add("calibrate--out-unwritable", "calibrate", "--device", "cpu", "--out", "{unwritable}")
    add("calibrate--kernels-ops-missing", "calibrate", "--kernels", "--ops", "{missing.json}", "--out", "{out}")
    # report
    for run_dir in ("missing_run", "empty_run", "plain.txt", "summary_garbage", "summary_list",
                    "summary_no_graph", "summary_bad_rows"):
        add(f"report[{run_dir}]", "report", f"{{{run_dir}}}", "--out", "{out}")
    # the graph loader, through every command that reads a graph
    for name in GRAPH_FILES:
        add(f"simulate-graph[{name}]", "simulate", f"{{{name}}}", "--json", "{out}")
        add(f"export-graph[{name}]", "export", f"{{{name}}}", "--perfetto", "{out}")
        add(f"faults-graph[{name}]", "faults", f"{{{name}}}", "--inject", "slow(0, 1.5)", "--json", "{out}")
    for name in GRAPH_FILES[::4]:
        add(f"emulate-graph[{name}]", "emulate", f"{{{name}}}", "--out", "{out}")
    return cases


CASES = _cases()


# --- running one case --------------------------------------------------------------------------------


class WorkStarted(AssertionError):
    """A bad input got as far as real work (a capture, sandboxes, a calibration...)."""


@pytest.fixture(scope="module", autouse=True)
def _quiet_imports():
    """Import what the commands import lazily now, so import-time warnings are not a case's stderr."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import prism_megatron.capture.run  # noqa: F401
        import prism_megatron.emulate.run  # noqa: F401
        import prism_megatron.faults.impact  # noqa: F401
        import prism_megatron.sim.des  # noqa: F401
        import prism_megatron.sweep.sweeper  # noqa: F401


@pytest.fixture
def tripwires(monkeypatch):
    def trip(what):
        def tripped(*args, **kwargs):
            raise WorkStarted(f"{what} started: the bad input was not refused before the work")
        return tripped

    import importlib.util

    import prism_megatron.capture.run as capture
    import prism_megatron.commands.calibrate as calibrate
    import prism_megatron.emulate.run as emulate
    import prism_megatron.sweep.sweeper as sweep

    monkeypatch.setattr(capture.Capture, "run", trip("a capture"))
    def emulation_run(self):  # its first step, `check` (the graph, sandboxes, faults), writes nothing
        self.check()
        raise WorkStarted("an emulation started: the bad input was not refused before the work")

    monkeypatch.setattr(emulate.Emulation, "run", emulation_run)
    monkeypatch.setattr(emulate, "run_sandboxes", trip("sandboxes"))
    monkeypatch.setattr(sweep.SweepDriver, "sweep", trip("a sweep"))  # Hydra composed, no job
    monkeypatch.setattr(calibrate, "calibrate", trip("a calibration"))
    real_spec = importlib.util.spec_from_file_location

    def spec(name, *args, **kwargs):
        if name == "pretrain_gpt":
            raise WorkStarted("the training example started: the bad input was not refused before it")
        return real_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "spec_from_file_location", spec)


def _argv(template: list[str], files: dict[str, str], out: str) -> list[str]:
    subs = {"{out}": out, "{unwritable}": files["under_file"], "{proc}": files["proc"],
            **{f"{{{k}}}": v for k, v in files.items()}}
    argv = []
    for a in template:
        for key, value in subs.items():
            a = a.replace(key, value)
        argv.append(a)
    return argv


def _listing(root: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))


class Hung(AssertionError):
    """A bad input kept the command busy for longer than refusing it could take."""


def _hung(signum, frame):
    raise Hung(f"still running after {HANG_S} s: a bad input must be refused at once")


HANG_S = 30


def run_in_process(argv: list[str], capsys) -> tuple[int, str]:
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(HANG_S)
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, capsys.readouterr().err


def _assert_one_line(code, err: str, argv: list[str]) -> None:
    lines = err.strip("\n").splitlines()
    assert code == 2, f"exit {code!r}, expected 2 for {argv}; stderr: {err[-2000:]}"
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].strip(), f"expected one line on stderr, got {len(lines)}: {err[-2000:]}"


def test_there_are_enough_cases():
    assert len(CASES) >= 200, len(CASES)


def test_a_valid_input_succeeds_so_the_cases_can_fail(inputs, tmp_path, capsys, monkeypatch):
    """The same commands with nothing wrong run and write their outputs (the graph, the overrides)."""
    monkeypatch.chdir(tmp_path)
    for argv in (["config", *WORLD8], ["world", *WORLD8, "--rank", "7"],
                 ["simulate", inputs["graph.prism"], "cluster=dgx_a100", "slowdown.3=1.5",
                  "--json", str(tmp_path / "s.json")],
                 ["export", inputs["graph.prism"], "--perfetto", str(tmp_path / "p.json"), "--ranks", "0,7"],
                 ["faults", inputs["graph.prism"], "--inject", "slow(0, 1.5)", "--json", str(tmp_path / "f.json")]):
        code, err = run_in_process(argv, capsys)
        assert code == 0, (argv, err)
    assert {p.name for p in tmp_path.iterdir()} == {"s.json", "p.json", "f.json"}


@pytest.fixture
def case_dir(tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # a command that writes beside itself writes here, and is caught
    return tmp_path


@pytest.mark.parametrize("case", [argv for _, argv in CASES], ids=[cid for cid, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(case, inputs, case_dir, tripwires, capsys):
    out = str(case_dir / "out")
    argv = _argv(case, inputs, out)
    root = str(Path(inputs["graph.prism"]).parent)
    before = _listing(root)
    code, err = run_in_process(argv, capsys)
    _assert_one_line(code, err, argv)
    assert not os.path.lexists(out), f"{out} was left behind by {argv}"
    assert _listing(str(case_dir)) == ["cwd"], f"files left behind: {_listing(str(case_dir))}"
    assert _listing(root) == before, "an input folder changed"


# --- end to end: a real process, with a timeout -----------------------------------------------------

SUBPROCESS_CASES = {
    "malformed-yaml": ["config", "--config", "{malformed.yaml}"],
    "nan-durations": ["simulate", "{duration_nan.prism}", "--json", "{out}"],
    "huge-world": ["world", *WORLD8[1:], "emulation.virtual_world_size=1073741824"],
    "unwritable-json": ["simulate", "{graph.prism}", "--json", "{unwritable}"],
    "calibrate-nproc-0": ["calibrate", "--device", "cpu", "--nproc", "0", "--out", "{out}"],
}


@pytest.mark.parametrize("name", list(SUBPROCESS_CASES))
def test_bad_input_end_to_end_in_a_real_process(name, inputs, tmp_path):
    out = str(tmp_path / "out")
    argv = _argv(SUBPROCESS_CASES[name], inputs, out)
    proc = subprocess.run([sys.executable, "-m", "prism_megatron.cli", *argv], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    _assert_one_line(proc.returncode, proc.stderr, argv)
    assert proc.stderr.startswith("prism-megatron"), proc.stderr
    assert not os.path.lexists(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
