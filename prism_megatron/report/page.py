"""The report of one run: what it found, and where each figure came from.

Input: the directory of `prism-megatron run` (run.json, capture/, emulation/) or of `emulate --out`
(emulation.json). Output: `report.html`, one file with inline SVG charts and no scripts or network
resources, and `report.md`, the same headline figures as text. Provenance labels:

- measured: what a sandbox rank did on this machine (its recorded iteration, its peak memory);
- captured: what a capture slice of the rank's role recorded (the other ranks' peak memory, MoE
  tokens);
- modelled: what the replay computed over all N ranks on the modelled cluster (the job's iteration
  time, tokens/s/GPU, MFU, the timeline).

Charts: peak memory per virtual rank (ranks binned to at most `MAX_BARS` bars, each bar the bin's
largest; sandboxes drawn apart), tokens per expert per MoE layer (when the model has experts), and the
pipeline timeline (forward and backward of each microbatch) of the emulated ranks.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from prism_megatron.config.schema import ConfigError
from prism_megatron.util import atomic_write_text

MAX_BARS = 256
GIB = 2 ** 30


@dataclass
class ReportData:
    """What the page shows, gathered from a run directory."""

    source: Path
    summary: dict
    rank_peak_bytes: np.ndarray
    """Peak allocated bytes per virtual rank (sandboxes measured, other ranks their role's capture)."""
    sandbox_ranks: list[int]
    moe_tokens: Optional[np.ndarray] = None
    """Tokens per (MoE layer, global expert) summed over the microbatches of one iteration."""
    timeline: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)
    """rank -> (span label, start ms, end ms) of the emulated pipeline spans."""
    perfetto: Optional[str] = None


def load_report(run_dir: str) -> ReportData:
    from prism_megatron.graph import load_graph

    root = Path(run_dir)
    candidates = [root / "run.json", root / "emulation.json", root / "emulation" / "emulation.json"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ConfigError(f"{run_dir}: no run.json or emulation.json; pass the --out directory of "
                          "`prism-megatron run` or `prism-megatron emulate`")
    try:
        summary = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path} is not a summary JSON ({err}); run it again") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("sandbox", []), list):
        raise ConfigError(f"{path} is not a summary of `run` or `emulate` (expected an object with a "
                          "sandbox list); pass the --out directory of one of them")
    graph_path = summary.get("graph_path") or str(root / "capture" / "graph.prism")
    if not Path(graph_path).is_file():
        raise ConfigError(f"{path} names no captured graph ({graph_path} is missing); the report needs it")
    graph = load_graph(graph_path, check=False)
    world = graph.world
    peaks = np.zeros(world.world_size, dtype=np.int64)
    for role, g in graph.roles.items():
        peaks[np.asarray(world.role_members(role), dtype=np.int64)] = int(g.peak_bytes)
    try:
        sandboxes = [int(row["virtual_rank"]) for row in summary.get("sandbox", [])]
        for row in summary.get("sandbox", []):
            peaks[int(row["virtual_rank"])] = int(row["peak_allocated_bytes"])
    except (TypeError, KeyError, ValueError, IndexError) as err:
        raise ConfigError(f"{path}: a sandbox row is damaged ({type(err).__name__}: {err}); run it "
                          "again") from None
    trace = summary.get("perfetto")
    return ReportData(source=path, summary=summary, rank_peak_bytes=peaks, sandbox_ranks=sandboxes,
                      moe_tokens=_moe_matrix(graph), timeline=_timeline(trace), perfetto=trace)


def _moe_matrix(graph) -> Optional[np.ndarray]:
    """layers x global experts: each EP rank's local experts at its place (roles of tp = 0)."""
    per_role = {}
    for role, g in graph.roles.items():
        if len(g.moe_ptr) > 1 and role.tp == 0 and role.cp == 0 and role.etp == 0:
            layers = g.moe["layer"]
            for i, layer in enumerate(layers.tolist()):
                tokens = g.moe_tokens[g.moe_ptr[i]:g.moe_ptr[i + 1]]
                key = (int(layer), role.ep)
                per_role[key] = per_role.get(key, 0) + tokens
    if not per_role:
        return None
    layers = sorted({k[0] for k in per_role})
    eps = sorted({k[1] for k in per_role})
    local = len(next(iter(per_role.values())))
    out = np.zeros((len(layers), len(eps) * local), dtype=np.int64)
    for (layer, ep), tokens in per_role.items():
        out[layers.index(layer), eps.index(ep) * local:(eps.index(ep) + 1) * local] = tokens
    return out


def _timeline(trace: Optional[str]) -> dict[int, list[tuple[str, float, float]]]:
    if not trace or not Path(trace).is_file():
        return {}
    try:
        events = json.loads(Path(trace).read_text()).get("traceEvents", [])
    except ValueError:
        return {}
    out: dict[int, list[tuple[str, float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "pipeline":
            start = float(e["ts"]) / 1e3
            out.setdefault(int(e["pid"]), []).append((str(e["name"]), start, start + float(e["dur"]) / 1e3))
    return out


# -- rendering -----------------------------------------------------------------------------------

def headline(data: ReportData) -> list[tuple[str, str, str]]:
    """(figure, value, provenance) rows."""
    s = data.summary
    rows = [("job iteration time", f"{s['iteration_time_s'] * 1e3:.2f} ms", "modelled"),
            ("tokens/s/GPU", f"{s['tokens_per_s_per_gpu']:.1f}", "modelled"),
            ("MFU", f"{s['mfu'] * 100:.2f} %", "modelled"),
            ("virtual world", f"{s['ranks']} ranks", "config"),
            ("sandboxes", f"{s['sandbox_count']} ({', '.join(map(str, data.sandbox_ranks))})", "measured"),
            ("physical fraction", f"{s['physical_fraction']:.6f}", "config"),
            ("direct-peer ghosts", str(s["materialized_ghosts"]), "modelled"),
            ("replay classes", str(s["classes"]), "modelled"),
            ("worst peak memory", f"{data.rank_peak_bytes.max() / GIB:.3f} GiB (rank "
                                  f"{int(data.rank_peak_bytes.argmax())})", _provenance(data)),
            ("cluster", str(s.get("cluster", "?")), "config")]
    return rows


def _provenance(data: ReportData) -> str:
    return "measured" if int(data.rank_peak_bytes.argmax()) in data.sandbox_ranks else "captured"


def memory_svg(data: ReportData, width: int = 760, height: int = 220) -> str:
    peaks = data.rank_peak_bytes.astype(float)
    n = len(peaks)
    bins = min(n, MAX_BARS)
    edges = np.linspace(0, n, bins + 1).astype(int)
    tops = [peaks[a:b].max() for a, b in zip(edges[:-1], edges[1:])]
    top = max(max(tops), 1.0)
    bar = width / bins
    parts = [f'<svg id="memory-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height + 30}" role="img" aria-label="peak memory per rank">']
    for i, value in enumerate(tops):
        h = value / top * height
        sandbox = any(edges[i] <= r < edges[i + 1] for r in data.sandbox_ranks)
        colour = "#d1495b" if sandbox else "#21918c"
        parts.append(f'<rect class="bar" x="{i * bar:.2f}" y="{height - h:.2f}" '
                     f'width="{max(bar - 0.5, 0.5):.2f}" height="{h:.2f}" fill="{colour}">'
                     f'<title>ranks {edges[i]}-{edges[i + 1] - 1}: {value / GIB:.3f} GiB</title></rect>')
    y = height + 20
    parts.append(f'<text x="0" y="{y}" font-size="12">rank 0</text>'
                 f'<text x="{width - 70}" y="{y}" font-size="12">rank {n - 1}</text>'
                 f'<text x="{width / 2 - 60}" y="{y}" font-size="12">max {top / GIB:.3f} GiB</text>')
    parts.append("</svg>")
    return "".join(parts)


def moe_svg(tokens: np.ndarray, cell: int = 14) -> str:
    layers, experts = tokens.shape
    top = max(int(tokens.max()), 1)
    parts = [f'<svg id="moe-heatmap" xmlns="http://www.w3.org/2000/svg" width="{experts * cell + 60}" '
             f'height="{layers * cell + 20}" role="img" aria-label="tokens per expert and layer">']
    for i in range(layers):
        parts.append(f'<text x="0" y="{i * cell + cell - 3}" font-size="10">L{i}</text>')
        for j in range(experts):
            v = int(tokens[i, j]) / top
            colour = f"rgb({int(255 * v)},{int(80 + 100 * (1 - v))},{int(200 * (1 - v))})"
            parts.append(f'<rect class="cell" x="{40 + j * cell}" y="{i * cell}" width="{cell - 1}" '
                         f'height="{cell - 1}" fill="{colour}"><title>layer {i} expert {j}: '
                         f'{int(tokens[i, j])} tokens</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def timeline_svg(timeline: dict[int, list[tuple[str, float, float]]], width: int = 760, row: int = 22) -> str:
    end = max((e for spans in timeline.values() for _, _, e in spans), default=1.0) or 1.0
    parts = [f'<svg id="pipeline-timeline" xmlns="http://www.w3.org/2000/svg" width="{width + 90}" '
             f'height="{len(timeline) * row + 24}" role="img" aria-label="pipeline timeline">']
    for k, (rank, spans) in enumerate(sorted(timeline.items())):
        y = k * row
        parts.append(f'<text x="0" y="{y + 15}" font-size="12">rank {rank}</text>')
        for name, start, stop in spans:
            colour = "#3b75af" if name.startswith("forward") else "#ef8636"
            parts.append(f'<rect class="span" x="{90 + start / end * width:.2f}" y="{y + 2}" '
                         f'width="{max((stop - start) / end * width, 0.5):.2f}" height="{row - 6}" '
                         f'fill="{colour}"><title>{html.escape(name)}: {start:.2f}-{stop:.2f} ms</title>'
                         '</rect>')
    parts.append(f'<text x="90" y="{len(timeline) * row + 18}" font-size="12">0 ms</text>'
                 f'<text x="{width + 30}" y="{len(timeline) * row + 18}" font-size="12">{end:.1f} ms</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(data: ReportData, out_dir: Optional[Path] = None) -> str:
    s = data.summary
    rows = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td>"
                   f"<td class=\"src {c}\">{c}</td></tr>" for a, b, c in headline(data))
    sandbox_rows = "".join(
        f"<tr><td>{r['virtual_rank']}</td><td>{r['iteration_time_s'] * 1e3:.2f} ms</td>"
        f"<td>{r.get('recorded_iteration_s', 0) * 1e3:.2f} ms</td>"
        f"<td>{r['peak_allocated_bytes'] / GIB:.4f} GiB</td>"
        f"<td>{r.get('peak_reserved_bytes', 0) / GIB:.4f} GiB</td>"
        f"<td>{html.escape(host_wait(r))}</td></tr>" for r in s.get("sandbox", []))
    moe = (f"<h2>MoE tokens per expert and layer <span class=\"src captured\">captured</span></h2>"
           f"{moe_svg(data.moe_tokens)}" if data.moe_tokens is not None else "")
    timeline = (f"<h2>Pipeline timeline <span class=\"src modelled\">modelled</span></h2>"
                f"{timeline_svg(data.timeline)}" if data.timeline else "")
    perfetto = ""
    if data.perfetto:
        link = html.escape(_relative(data.perfetto, out_dir or data.source.parent))
        perfetto = (f'<p>Perfetto trace: <a id="perfetto-link" href="{link}">'
                    f"{html.escape(Path(data.perfetto).name)}</a> (open it in ui.perfetto.dev)</p>")
    capture = capture_wait(s)
    capture_note = f'<p id="capture-host-bound">{html.escape(capture, quote=False)}</p>' if capture else ""
    cluster, clock = html.escape(str(s.get("cluster", "?"))), html.escape(str(s.get("clock", "virtual")))
    where = (f"From {html.escape(str(data.source))}: {s['ranks']} virtual ranks, cluster {cluster}, "
             f"{clock} clock.")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>prism-megatron report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:900px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}
.src{{font-size:80%;padding:1px 4px;border-radius:3px}}.measured{{background:#d1f0d1}}
.captured{{background:#d6e4f5}}.modelled{{background:#f5e6cc}}.config{{background:#eee}}</style>
</head><body>
<h1>prism-megatron report</h1>
<p>{where}</p>
<table id="headline"><tr><th>figure</th><th>value</th><th>from</th></tr>{rows}</table>
<h2>Sandbox ranks <span class="src measured">measured</span></h2>
<table id="sandboxes"><tr><th>virtual rank</th><th>in the job (modelled)</th><th>own recorded iteration</th>
<th>peak allocated</th><th>peak reserved</th><th>compute that ended waiting for the host</th></tr>
{sandbox_rows}</table>{capture_note}
<h2>Peak memory per rank <span class="src captured">captured</span> (sandboxes red: measured)</h2>
{memory_svg(data)}
{moe}
{timeline}
{perfetto}
</body></html>
"""


def render_markdown(data: ReportData) -> str:
    s = data.summary
    lines = ["# prism-megatron report", "", f"From `{data.source}`: {s['ranks']} virtual ranks.", "",
             "| figure | value | from |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in headline(data)]
    lines += ["", "## Sandbox ranks (measured)", "",
              "| virtual rank | in the job | own recorded iteration | peak allocated | compute that ended "
              "waiting for the host |", "|---:|---:|---:|---:|---|"]
    lines += [f"| {r['virtual_rank']} | {r['iteration_time_s'] * 1e3:.2f} ms | "
              f"{r.get('recorded_iteration_s', 0) * 1e3:.2f} ms | {r['peak_allocated_bytes'] / GIB:.4f} GiB | "
              f"{host_wait(r)} |" for r in s.get("sandbox", [])]
    capture = capture_wait(s)
    if capture:
        lines += ["", capture]
    if data.perfetto:
        lines += ["", f"Perfetto trace: `{data.perfetto}` (open it in ui.perfetto.dev)."]
    lines += ["", "Charts (peak memory per rank, MoE tokens, pipeline timeline): `report.html`.", ""]
    return "\n".join(lines)


def host_wait(row: dict) -> str:
    """A sandbox's host-bound figure (emulate/run.py `host_bound`): the share of its compute that ended
    with its device waiting for the host, flagged where it warns; a host clock has none."""
    bound = row.get("host_bound")
    if not bound:
        return "n/a (host clock)"
    return f"{bound['share']:.1%}" + (" (host-bound: its compute holds host time)" if bound.get("warning") else "")


def capture_wait(summary: dict) -> Optional[str]:
    """The warning for a graph whose capture was host-bound (emulate/run.py `_capture_share`)."""
    captured = summary.get("capture_host_bound_share")
    if not captured or not captured.get("warning"):
        return None
    return (f"The capture was host-bound: {captured['max']:.0%} of rank {captured['rank']}'s compute "
            "ended with its device waiting for the host, and the ghosts replay those durations.")


def _relative(path: str, base: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        return Path(path).resolve().as_uri()


def write_report(run_dir: str, out_dir: Optional[str] = None) -> tuple[str, str, ReportData]:
    """Write report.html and report.md (atomically) next to the summary or in `out_dir`; returns
    their paths and what they show."""
    data = load_report(run_dir)
    out = Path(out_dir) if out_dir else data.source.parent
    page, text = out / "report.html", out / "report.md"
    atomic_write_text(str(page), render_html(data, out))
    atomic_write_text(str(text), render_markdown(data))
    return str(page), str(text), data
