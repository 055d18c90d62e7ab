"""HTML and Markdown reports of a results directory: what was measured, what it means, and the plots."""

from spectune.report.build import write_report

__all__ = ["write_report"]
