"""`prism-megatron report`: the HTML page and Markdown summary of a run, rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
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
    proc = _cli("report", str(out), "--json", str(out / "report.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
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
    summary = json.loads((reported / "report.json").read_text())
    assert Path(summary["html"]).is_file() and {r["from"] for r in summary["headline"]} >= {
        "measured", "modelled", "captured", "config"}
    text = (reported / "report.md").read_text()
    assert "| job iteration time |" in text and "| modelled |" in text and "| measured |" in text


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed here (CI installs it)")
@pytest.mark.slow
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


def _png_pixels(path: Path) -> tuple[int, int, int, bytes]:
    """(width, height, bytes per pixel, unfiltered rows) of an 8-bit RGB/RGBA PNG."""
    data = path.read_bytes()
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, out, prev = zlib.decompress(idat), width * bpp, bytearray(), bytearray(width * bpp)
    for y in range(height):
        kind, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = row[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                row[i] = (row[i] + a) & 255
            elif kind == 2:
                row[i] = (row[i] + b) & 255
            elif kind == 3:
                row[i] = (row[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += row
        prev = row
    return width, height, bpp, bytes(out)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed here (CI installs it)")
@pytest.mark.slow
def test_a_screenshot_shows_the_charts(reported):
    """The page as Chromium paints it: the memory chart's bars (teal, the sandbox red) and the
    timeline's forward (blue) and backward (orange) spans are on screen."""
    shot = reported / "report.png"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={reported / 'chromium-shot'}", "--window-size=900,1300", "--hide-scrollbars",
         f"--screenshot={shot}", (reported / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    width, height, bpp, pixels = _png_pixels(shot)
    assert (width, height) == (900, 1300)
    seen = {pixels[i:i + 3] for i in range(0, len(pixels), bpp)}
    for name, rgb in (("bars", (0x21, 0x91, 0x8C)), ("sandbox bar", (0xD1, 0x49, 0x5B)),
                      ("forward spans", (0x3B, 0x75, 0xAF)), ("backward spans", (0xEF, 0x86, 0x36))):
        assert bytes(rgb) in seen, name


def test_a_directory_without_a_run_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    from test_bad_inputs import run_in_process  # cli.main in this process; real processes: test_bad_inputs

    monkeypatch.chdir(REPO)
    code, err = run_in_process(["report", str(tmp_path)], capsys)
    assert code == 2
    assert err.strip().count("\n") == 0 and "no run.json or emulation.json" in err


def test_the_sandbox_table_says_how_host_bound_each_sandbox_and_the_capture_were(tmp_path):
    import numpy as np

    from prism_megatron.report.page import ReportData, render_html, render_markdown

    bound = {"ops": 19, "idle_ops": 18, "compute_s": 0.016, "idle_compute_s": 0.0144, "share": 0.9,
             "warning": True}
    summary = {"iteration_time_s": 0.126, "tokens_per_s_per_gpu": 4.0, "mfu": 0.0, "ranks": 4,
               "sandbox_count": 2, "physical_fraction": 0.5, "materialized_ghosts": 2, "classes": 3,
               "cluster": "dgx_h200", "capture_host_bound_share": {"rank": 3, "max": 0.87, "warning": True},
               "sandbox": [{"virtual_rank": 1, "iteration_time_s": 0.126, "recorded_iteration_s": 0.1,
                            "peak_allocated_bytes": 2**30, "host_bound": bound},
                           {"virtual_rank": 2, "iteration_time_s": 0.126, "recorded_iteration_s": 0.1,
                            "peak_allocated_bytes": 2**30}]}
    data = ReportData(source=tmp_path / "emulation.json", summary=summary,
                      rank_peak_bytes=np.full(4, 2**30, dtype=np.int64), sandbox_ranks=[1, 2])
    page, text = render_html(data, tmp_path), render_markdown(data)
    for out in (page, text):
        assert "90.0% (host-bound: its compute holds host time)" in out and "n/a (host clock)" in out
        assert "87% of rank 3's compute ended with its device waiting for the host" in out
    summary["capture_host_bound_share"]["warning"] = False
    assert "capture was host-bound" not in render_markdown(data)
