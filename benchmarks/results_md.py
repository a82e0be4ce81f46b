"""Write docs/results.md from the benchmark results: one section per benchmark, generated, never edited.

Every `benchmarks/results/*.json` is one current result: `benchmark` (the script's name), `command`
(the command that made it), `machine` (what it ran on, in words), optional `notes` and `columns` (the
row fields its main table shows), and the figures the script wrote. Results of one benchmark (its
configurations: `emulate_scale-gpt175b.json`, `emulate_scale-moe_ep64.json`) share a section. Per
benchmark the page gives what it measures (the script's module docstring, or its leading comment for
a shell script), then per result the command, the machine, the notes and its figures as Markdown
tables. The page is written atomically. Earlier results stay in git history.

    python benchmarks/results_md.py [--results DIR] [--out PATH]
    python benchmarks/results_md.py --stamp FILE --benchmark NAME --command CMD --machine WORDS

`--stamp` adds the three fields to a result a script has just written (scripts write only figures).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
OUT = REPO / "docs" / "results.md"
COMMAND = "python benchmarks/results_md.py"
META = ("benchmark", "command", "machine", "notes", "columns")
REQUIRED = ("benchmark", "command", "machine")
MAX_ROWS = 64      # a longer table (raw samples, every calibration point) stays in its JSON
MAX_COLUMNS = 14
MAX_TEXT = 60      # longer strings (configs, argument lists) stay in the JSON
MAX_INLINE = 6     # lists of at most this many scalars are shown inline


def load_results(results: Path) -> list[tuple[str, dict]]:
    """(file name, data) of every result, sorted by benchmark then file; ValueError names a bad one."""
    out = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path.name}: not JSON ({e})") from None
        missing = [k for k in REQUIRED if not isinstance(data, dict) or not isinstance(data.get(k), str)
                   or not data[k]]
        if missing:
            raise ValueError(f"{path.name}: no {', '.join(missing)} (add them with --stamp)")
        out.append((path.name, data))
    return sorted(out, key=lambda item: (item[1]["benchmark"], item[0] != f"{item[1]['benchmark']}.json", item[0]))


def describe(benchmark: str) -> str:
    """What the benchmark measures: its script's docstring (usage blocks left out) or leading comment."""
    script = REPO / "benchmarks" / f"{benchmark}.py"
    command = REPO / "prism_megatron" / "commands" / f"{benchmark}.py"
    shell = REPO / "benchmarks" / f"{benchmark}.sh"
    text = ""
    for path in (script, command):
        if path.is_file():
            text = ast.get_docstring(ast.parse(path.read_text())) or ""
            break
    else:
        if shell.is_file():
            lines = []
            for line in shell.read_text().splitlines()[1:]:
                if not line.startswith("#"):
                    break
                lines.append(line[2:] if line.startswith("# ") else line[1:])
            text = "\n".join(lines)
    paragraphs = []
    for block in text.strip().split("\n\n"):
        lines = block.splitlines()
        if all(line.startswith("    ") for line in lines) or block.lstrip().startswith("Usage:"):
            continue  # the usage: the result's own command stands beside it
        paragraphs.append(block if re.match(r"(- |\d+\. )", block) else _indented_as_code(lines))
    return "\n\n".join(paragraphs) if paragraphs else f"(`{benchmark}` has no description.)"


def _indented_as_code(lines: list[str]) -> str:
    """A paragraph whose indented lines (a column legend, a list of modes) are kept as a code block."""
    out: list[str] = []
    code = False
    for line in lines:
        if line.startswith("  ") != code:
            code = not code
            if out:
                out.append("")
        out.append(f"    {line}" if code else line)
    return "\n".join(out)


def fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "–"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:,.0f}" if abs(value) >= 1e5 else f"{value:.3g}"
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= MAX_TEXT)


def _cell(value):
    """The cell's value if it fits a cell, else a marker that drops it."""
    if _scalar(value):
        return value
    if isinstance(value, list) and len(value) <= MAX_INLINE and all(_scalar(v) for v in value):
        return value
    if isinstance(value, list) and len(value) <= 3 and all(
            isinstance(v, dict) and all(_scalar(x) for x in v.values()) for v in value):
        return "; ".join(fmt(v) for v in value)
    return _DROP


_DROP = object()


def _lookup(row: dict, key: str):
    value = row
    for part in key.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def _flat_row(row: dict) -> dict:
    """A row's cells: nested dicts one level down as `outer.inner`."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            for inner, v in value.items():
                if _cell(v) is not _DROP:
                    out[f"{key}.{inner}"] = v
        elif _cell(value) is not _DROP:
            out[key] = _cell(value)
    return out


def table(rows: list, columns: list | None = None, first: str | None = None) -> list[str]:
    """Markdown lines of a table of dict rows (`first`: the name of a key column already in the rows)."""
    if len(rows) > MAX_ROWS:
        return [f"({len(rows)} rows: in the JSON)"]
    if columns:
        flat = [{c: _cell(_lookup(r, c)) for c in columns} for r in rows]
        cols = list(columns)
        if first and first not in cols:
            cols.insert(0, first)
            for f, r in zip(flat, rows):
                f[first] = r.get(first)
    else:
        flat = [_flat_row(r) for r in rows]
        cols = []
        for r in flat:
            cols += [c for c in r if c not in cols]
        cols = cols[:MAX_COLUMNS]
    if not cols:
        return []
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---" if all(isinstance(r.get(c), str) for r in flat if r.get(c) not in (None, _DROP))
                            else "---:" for c in cols) + "|"]
    for r in flat:
        lines.append("| " + " | ".join("…" if r.get(c) is _DROP else fmt(r.get(c)) for c in cols) + " |")
    return lines


def _is_rows(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def figures(data: dict) -> list[str]:
    """The figures of one result: its scalars in one table, then a table per list of rows."""
    scalars: dict = {}
    tables: list[tuple[str, list[str]]] = []
    columns = data.get("columns")

    def walk(key: str, value, depth: int) -> None:
        if _is_rows(value):
            tables.append((key, table(value, columns if key == "rows" else None)))
        elif isinstance(value, dict) and value and all(_is_rows(v) for v in value.values()):
            rows = [{"": k, **r} for k, rs in value.items() for r in rs]
            tables.append((key, table(rows, [""] + columns if columns and key == "rows" else None)))
        elif isinstance(value, dict) and value and depth == 0 and len(value) > 2 and all(
                isinstance(v, dict) for v in value.values()):
            rows = [{"": k, **v} for k, v in value.items()]
            tables.append((key, table(rows)))
        elif isinstance(value, dict):
            for inner, v in value.items():
                walk(f"{key}.{inner}", v, depth + 1)
        elif isinstance(value, list):
            if len(value) <= MAX_INLINE and all(_scalar(v) for v in value):
                scalars[key] = value
            elif value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                finite = [v for v in value if not (isinstance(v, float) and math.isnan(v))]
                scalars[key] = f"{len(value)} values, {fmt(min(finite))} .. {fmt(max(finite))}" if finite \
                    else f"{len(value)} values"
            else:
                scalars[key] = f"({len(value)} entries: in the JSON)"
        elif _scalar(value):
            scalars[key] = value
        else:
            scalars[key] = "(in the JSON)"

    for key, value in data.items():
        if key not in META:
            walk(key, value, 0)
    lines = []
    if scalars:
        lines += ["| figure | value |", "|---|---:|"]
        lines += [f"| {k} | {fmt(v)} |" for k, v in scalars.items()]
        lines.append("")
    for key, body in tables:
        if body:
            lines += [f"`{key}`:", "", *body, ""]
    return lines


def render(results: list[tuple[str, dict]]) -> str:
    benchmarks: dict[str, list[tuple[str, dict]]] = {}
    for name, data in results:
        benchmarks.setdefault(data["benchmark"], []).append((name, data))
    lines = [f"*Generated by `{COMMAND}` from `benchmarks/results/*.json`: do not edit by hand; rerun it.*",
             "",
             "# Benchmark results",
             "",
             "One current result per benchmark (a benchmark run in several configurations has one per "
             "configuration), with the command that made it and the machine it ran on. The scripts are in "
             "`benchmarks/`, their results in `benchmarks/results/` (where a result is more than a JSON, its "
             "files are in a folder of the same name). Earlier results, diagnostics and one-off scripts are in "
             "the git history (branch `results-archive`). How each part works: [`design.md`](design.md).",
             ""]
    lines += [f"- [{b}](#{b})" for b in benchmarks]
    lines.append("")
    for benchmark, items in benchmarks.items():
        lines += [f"## {benchmark}", "", describe(benchmark), ""]
        for name, data in items:
            if len(items) > 1:
                lines += [f"### {name}", ""]
            else:
                lines += [f"Result: `benchmarks/results/{name}`", ""]
            lines += ["Command:", "", f"    {data['command']}", "", f"Machine: {data['machine']}", ""]
            if data.get("notes"):
                lines += [f"Notes: {data['notes']}", ""]
            lines += figures(data)
    return "\n".join(lines).rstrip("\n") + "\n"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def stamp(path: Path, benchmark: str, command: str, machine: str) -> None:
    data = {k: v for k, v in json.loads(path.read_text()).items() if k not in REQUIRED}
    data = {"benchmark": benchmark, "command": command, "machine": machine, **data}
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS), help="folder of the results (*.json)")
    parser.add_argument("--out", default=str(OUT), help="the page (default: docs/results.md)")
    parser.add_argument("--stamp", metavar="FILE", help="add benchmark, command and machine to FILE, then stop")
    parser.add_argument("--benchmark")
    parser.add_argument("--command")
    parser.add_argument("--machine")
    args = parser.parse_args(argv)
    if args.stamp:
        if not (args.benchmark and args.command and args.machine):
            print("error: --stamp needs --benchmark, --command and --machine", file=sys.stderr)
            return 2
        stamp(Path(args.stamp), args.benchmark, args.command, args.machine)
        return 0
    try:
        results = load_results(Path(args.results))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_atomic(Path(args.out), render(results))
    print(f"{args.out}: {len(results)} results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
