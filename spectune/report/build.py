"""`spectune report`: collect the frames (data.py), draw the plots (plots.py), render both files (render.py)."""

from __future__ import annotations

from pathlib import Path

from spectune.store import atomic_write_bytes


def write_report(results: str | Path, out: str | Path) -> list[Path]:
    """report.html (self-contained) and report.md with its PNGs beside it, in `out`. Returns [html, md]."""
    from spectune.report.data import collect
    from spectune.report.plots import make_plots
    from spectune.report.render import render_html, render_markdown

    out = Path(out)
    data = collect(results)
    plots = make_plots(data)
    for plot in plots:
        atomic_write_bytes(out / f"{plot.name}.png", plot.png)
    page, md = out / "report.html", out / "report.md"
    atomic_write_bytes(md, render_markdown(data, plots).encode())
    atomic_write_bytes(page, render_html(data, plots).encode())
    return [page, md]
