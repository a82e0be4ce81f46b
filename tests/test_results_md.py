"""docs/results.md is generated from benchmarks/results/*.json and cannot drift from them."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def test_every_result_names_its_benchmark_command_and_machine():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        for key in ("benchmark", "command", "machine"):
            assert isinstance(data.get(key), str) and data[key], f"{path.name}: no {key}"


def test_the_committed_page_is_what_the_generator_writes(tmp_path):
    out = tmp_path / "results.md"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "results_md.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert out.read_text() == (REPO / "docs" / "results.md").read_text(), \
        "docs/results.md is stale: run `python benchmarks/results_md.py`"


def test_a_result_without_its_command_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"benchmark": "x", "machine": "m", "rows": []}))
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "results_md.py"), "--results", str(tmp_path),
                          "--out", str(tmp_path / "r.md")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "x.json: no command" in run.stderr
    assert not (tmp_path / "r.md").exists()
