"""`prism-megatron report`: a self-contained HTML page and a Markdown summary of a run or emulation."""

from prism_megatron.report.page import ReportData, load_report, render_html, render_markdown, write_report

__all__ = ["ReportData", "load_report", "render_html", "render_markdown", "write_report"]
