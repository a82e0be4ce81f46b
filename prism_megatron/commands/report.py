"""`prism-megatron report`: an HTML page and a Markdown summary of a run or emulation."""

from __future__ import annotations

import json

from prism_megatron.util import atomic_write_text


def add_arguments(cmd) -> None:
    cmd.add_argument("run_dir", help="the --out directory of `run` or `emulate`")
    cmd.add_argument("--out", default=None, help="where report.html and report.md go (default: "
                                                 "beside the run's summary)")
    cmd.add_argument("--json", default=None, help="write the report's paths and headline here too")


def run(args) -> int:
    from prism_megatron.report import write_report
    from prism_megatron.report.page import headline

    page, text, data = write_report(args.run_dir, args.out)
    print(f"report: {page}\nsummary: {text}")
    if args.json:
        rows = [{"figure": a, "value": b, "from": c} for a, b, c in headline(data)]
        atomic_write_text(args.json, json.dumps({"html": page, "markdown": text, "headline": rows}, indent=1))
    return 0
