"""The package installed as a user installs it (`pip install .`, not editable) runs `prism-megatron train`
from a folder outside the checkout: it finds its own default config and example script (package data,
prism_megatron/resources.py), with no checkout to fall back on."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "prism_megatron", "hydra_plugins")
"""What `pip install .` reads: copied first, so the build writes nothing into the checkout."""


def _install(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-compile", "--target", str(site), str(src)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return site


@pytest.mark.slow
def test_the_installed_package_trains_its_default_job_outside_the_checkout(tmp_path):
    site = _install(tmp_path)
    work = tmp_path / "work"  # no configs/, no examples/ here
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_") and k != "PYTHONPATH"}
    # the installed copy first: its path entry answers the import before the venv's editable finder (the
    # native backend it builds is the checkout's, cached under the same name: comm/native.py stages sources)
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    where = subprocess.run([sys.executable, "-P", "-c", "import prism_megatron; print(prism_megatron.__file__)"],
                           capture_output=True, text=True, env=env, cwd=work, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).resolve().is_relative_to(site.resolve()), where.stdout

    script = site / "bin" / "prism-megatron"  # the console script pip wrote
    assert script.is_file()
    proc = subprocess.run([sys.executable, "-P", str(script), "train"], capture_output=True, text=True,
                          env=env, cwd=work, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # the built-in default (configs/default.yaml): rank 4711 of GPT-175B, modelled on an H200, 2 iterations
    assert re.search(r"\[rank 4711\] iteration 2/2 \|.*iteration time \(ms\) \(modelled on h200\): \d",
                     out), out[-3000:]
    assert re.search(r"\[rank 4711\] predicted peak memory on h200: allocated \d", out), out[-3000:]
    # it opens with what it models, and says where its summary went (the only thing written)
    assert ("[rank 4711] modelled: GPT of 175.2B parameters (96 layers, hidden 12288) | TP8 x PP16 x DP64, "
            "8192 ranks | 24 micro-batches of 1 per pipeline | sandbox: rank 4711 (pipeline stage 9 of 16), "
            "8191 ghosts | execution: fake on cpu, predicting h200") in out, out[-3000:]
    assert "lm loss, grad norm: n/a (fake execution: tensors hold no values)" in out, out[-3000:]
    written = re.search(r"\[rank 4711\] summary: (runs/train-default-\w+/summary\.json)$", proc.stdout, re.M)
    assert written, out[-3000:]
    summary = json.loads((work / written[1]).read_text())
    assert summary["virtual_rank"] == 4711 and len(summary["iteration_times_ms"]) == 2
    assert summary["losses"] == [None, None] and summary["grad_norms"] == [None, None]
    assert [p.name for p in work.iterdir()] == ["runs"]
