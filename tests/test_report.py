"""`prism-megatron report`: the HTML page and Markdown summary of a run, rendered in headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
# MoE with pipeline stages: every chart of the page has something to show
JOB = ["emulation.virtual_world_size=8", "model=tiny_moe", "parallel.tp=1", "parallel.pp=2", "parallel.ep=2",
       "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.iters=3", "train.device=cpu",
       "moe.imbalance=zipf(1.2)", "cluster=cpu_host"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "prism_megatron.cli", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = _cli("run", *JOB, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _cli("report", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_page_holds_every_chart_and_says_where_each_figure_came_from(reported):
    page = (reported / "report.html").read_text()
    for chart in ("memory-chart", "moe-heatmap", "pipeline-timeline"):
        assert f'id="{chart}"' in page
    assert len(re.findall(r'class="bar"', page)) == 8  # one bar per rank of 8
    assert page.count('fill="#d1495b"') == 1  # the sandbox's bar: measured
    assert len(re.findall(r'class="cell"', page)) == 2 * 8  # 2 MoE layers (one per stage) x 8 experts
    assert len(re.findall(r'class="span"', page)) > 0
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    link = re.search(r'id="perfetto-link" href="([^"]+)"', page).group(1)
    assert (reported / link).is_file()
    text = (reported / "report.md").read_text()
    assert "| job iteration time |" in text and "| modelled |" in text and "| measured |" in text


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed here (CI installs it)")
def test_headless_chromium_renders_the_charts(reported):
    profile = reported / "chromium-profile"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--dump-dom", (reported / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    dom = proc.stdout
    assert proc.returncode == 0 and "<svg" in dom, proc.stderr[-2000:]
    for chart in ("memory-chart", "moe-heatmap", "pipeline-timeline"):
        assert re.search(rf'<svg[^>]*id="{chart}"', dom), chart
    assert len(re.findall(r'<rect class="bar"', dom)) == 8


def test_a_directory_without_a_run_is_one_line_and_exit_2(tmp_path):
    proc = _cli("report", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no run.json or emulation.json" in proc.stderr
