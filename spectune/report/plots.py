"""The report's plots (matplotlib, Agg): one PNG each, with a title and a one-line caption on how to read it.

One hue per method in every plot (target-only is black), a darker shade and another marker per step count g;
batch sizes on a log axis with ticks only where they were measured, labelled as plain numbers."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pandas as pd

from spectune.report.data import POS_COLUMN, ReportData

# Known methods keep their hue from run to run; others take the next free one.
METHOD_CMAPS = {"eagle": "Blues", "ngram": "Oranges", "draft_model": "Greens", "dflash": "Purples", "eagle3": "Reds",
                "mtp": "YlOrBr", "suffix": "PuRd", "dspark": "BuGn"}
SPARE_CMAPS = ("GnBu", "RdPu", "YlGn", "OrRd", "PuBu", "Greys")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h", "<", ">")
TARGET_COLOR = "#222222"
BATCH_LABEL = "batch size (concurrent requests)"


@dataclass(frozen=True, slots=True)
class Plot:
    name: str  # file stem: <name>.png beside report.md
    title: str
    caption: str  # one line: how to read it
    png: bytes


@dataclass(frozen=True, slots=True)
class Style:
    color: tuple[float, float, float, float] | str
    marker: str
    label: str


def _method_cmaps(servers: pd.DataFrame) -> dict[str, str]:
    spare = iter(SPARE_CMAPS)
    return {m: METHOD_CMAPS.get(m) or next(spare, "Greys") for m in sorted(servers["method"].dropna().unique())}


def method_colors(servers: pd.DataFrame) -> dict[str, tuple[float, float, float, float]]:
    """Method -> its hue (a middle shade), for plots about a method rather than a server."""
    import matplotlib

    return {m: matplotlib.colormaps[c](0.75) for m, c in _method_cmaps(servers).items()} if not servers.empty else {}


def server_styles(servers: pd.DataFrame) -> dict[str, Style]:
    """Server -> colour, marker and legend label; the same in every plot of one report."""
    import matplotlib

    styles: dict[str, Style] = {}
    if servers.empty:
        return styles
    cmaps = _method_cmaps(servers)
    for method, group in servers.groupby(servers["method"].fillna(""), sort=True):
        group = group.sort_values(["is_adaptive", "g"])
        if not method:
            for row in group.itertuples():
                what = "speculates, undeclared" if getattr(row, "drafted_undeclared", False) else "target-only"
                styles[row.server] = Style(TARGET_COLOR, "o", f"{row.server} ({what})")
            continue
        cmap = matplotlib.colormaps[cmaps[method]]
        shades = np.linspace(0.5, 0.9, len(group)) if len(group) > 1 else [0.7]
        for shade, row in zip(shades, group.itertuples()):
            marker = "*" if row.is_adaptive else MARKERS[(row.g - 1) % len(MARKERS)] if row.g > 0 else "o"
            what = "adaptive" if row.is_adaptive else f"g={row.g}"
            styles[row.server] = Style(cmap(float(shade)), marker, f"{row.server} ({method}, {what})")
    return styles


def make_plots(data: ReportData) -> list[Plot]:
    import matplotlib

    matplotlib.use("Agg")
    styles = server_styles(data.servers)
    makers = (_speedup, _latency, _throughput, _acceptance, _memory, _tuning)
    return [plot for make in makers if (plot := make(data, styles)) is not None]


# --- one function per plot ---------------------------------------------------------------------------------


def _speedup(data: ReportData, styles: dict[str, Style]) -> Plot | None:
    """One panel per method (its g as lines, CI bands, the model's dashed prediction), sharing the y axis."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if data.speedups.empty:
        return None
    method_of = dict(zip(data.servers["server"], data.servers["method"].fillna("?")))
    frame = data.speedups.assign(method=data.speedups["server"].map(method_of))
    methods = sorted(frame["method"].unique())
    cols = min(3, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 0.6, 4.3 * rows), squeeze=False, sharey=True)
    for ax in axes.flat[len(methods):]:
        ax.set_visible(False)
    colors = method_colors(data.servers)
    col = x_axis(data)[0]
    for ax, method in zip(axes.flat, methods):
        for server, group in frame[frame["method"] == method].groupby("server", sort=True):
            s = styles[server]
            group = group.sort_values(col)
            x = group[col].to_numpy(float)
            ax.plot(x, group["speedup"], marker=s.marker, color=s.color, lw=2, ms=7, label=s.label.split(" (")[0])
            low, high = group["speedup_ci_low"].to_numpy(float), group["speedup_ci_high"].to_numpy(float)
            if np.isfinite(low).any():
                ax.fill_between(x, low, high, color=s.color, alpha=0.13, lw=0)
            pred = data.predicted[data.predicted["server"] == server].sort_values("batch_size")
            if not pred.empty:
                ax.plot(pred["batch_size"], pred["predicted_speedup"], ls="--", lw=1.3, color=s.color)
        ax.axhline(1.0, color="#555555", lw=1.2, ls=":")
        ax.set_title(method, color=colors.get(method, TARGET_COLOR), fontsize=11, fontweight="bold")
        _x(ax, data)
        handles, labels = ax.get_legend_handles_labels()
        if not data.predicted[data.predicted["server"].map(method_of) == method].empty:
            handles.append(Line2D([], [], ls="--", color="#555555", lw=1.3))
            labels.append("model prediction")
        ax.legend(handles, labels, fontsize=8, loc="best", framealpha=0.85)
    for ax in axes[:, 0]:
        what = "output tok/s" if col == "batch_size" else "its TPOT / the server's"
        ax.set_ylabel(f"speedup vs target-only (×, {what})")
    # The y range follows the estimates, not the intervals: with 2 repeats a t-interval can span x0.3..x3 and would
    # flatten every line; a band that leaves the plot is clipped (the table above gives its numbers).
    points = pd.concat([frame["speedup"], data.predicted["predicted_speedup"]]).astype(float)
    points = points[np.isfinite(points)]
    low, high = min(points.min(), 1.0), max(points.max(), 1.0)
    pad = max(0.08, 0.25 * (high - low))
    axes[0][0].set_ylim(max(0.0, low - pad), high + pad)
    axes[0][0].text(0.02, 1.0, "break-even", transform=axes[0][0].get_yaxis_transform(), va="bottom", fontsize=8, color="#555555")
    caption = ("Above the dotted break-even line speculation beats target-only on the same traffic; shaded: 95% CI over "
               "repeats" + ("; dashed: what the fitted cost model predicts for that g." if not data.predicted.empty else "."))
    return Plot("speedup", "Speedup vs batch size" if col == "batch_size" else "Speedup vs request rate", caption, _png(fig))


LATENCIES = (("ttft_ms", "TTFT", "time to first token (ms)"), ("tpot_ms", "TPOT", "time per output token (ms)"),
             ("icl_ms", "ICL", "inter-chunk latency (ms)"))


def _latency(data: ReportData, styles: dict[str, Style]) -> Plot | None:
    import matplotlib.pyplot as plt

    shown = [entry for entry in LATENCIES if f"{entry[0]}_p50" in data.per_cell]
    if data.per_cell.empty or not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 4.4), squeeze=False)
    for ax, (metric, title, label) in zip(axes[0], shown):
        ax.set_title(title, fontsize=11, fontweight="bold")
        col = x_axis(data)[0]
        for server, frame in data.per_cell.groupby("server", sort=True):
            s = styles[server]
            frame = frame.sort_values(col)
            x = frame[col].to_numpy(float)
            ax.plot(x, frame[f"{metric}_p50"], marker=s.marker, color=s.color, lw=1.8, ms=5, label=s.label)
            if f"{metric}_p99" in frame:
                ax.plot(x, frame[f"{metric}_p99"], ls=":", lw=1.1, color=s.color, alpha=0.8)
        _x(ax, data)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    _figure_legend(fig, axes[0][0])
    return Plot("latency", "Latency percentiles", "Solid: median (p50); dotted: p99 (the slowest 1%); each the mean over repeats. "
                "p90 is in the table below. Lower is better.", _png(fig, tight=False))


def _throughput(data: ReportData, styles: dict[str, Style]) -> Plot | None:
    import matplotlib.pyplot as plt

    if data.per_cell.empty or "output_throughput_tps" not in data.per_cell:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.6))
    col = x_axis(data)[0]
    for server, frame in data.per_cell.groupby("server", sort=True):
        s = styles[server]
        frame = frame.sort_values(col)
        y = frame["output_throughput_tps"].to_numpy(float)
        ax.errorbar(frame[col], y, yerr=[y - frame["tps_min"].to_numpy(float), frame["tps_max"].to_numpy(float) - y],
                    marker=s.marker, color=s.color, lw=1.8, ms=6, capsize=3, label=s.label)
    _x(ax, data)
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_ylim(bottom=0)
    _legend(ax, *ax.get_legend_handles_labels())
    caption = ("Output tokens per second, all requests of a cell together (mean over repeats; bars: lowest to highest "
               "repeat). " + ("Higher is better." if col == "batch_size" else "Open loop: the arrivals set it, so servers "
                              "that keep up lie together; speculation shows in latency."))
    return Plot("throughput", "Output throughput vs batch size", caption, _png(fig))


def _acceptance(data: ReportData, styles: dict[str, Style]) -> Plot | None:
    import matplotlib.pyplot as plt

    spec = data.per_cell[_drafts(data.per_cell)] if not data.per_cell.empty else data.per_cell
    if spec.empty or not {"acceptance_rate", "acceptance_length"} & set(spec.columns):
        return None
    if spec[[c for c in ("acceptance_rate", "acceptance_length") if c in spec]].isna().all().all():
        return None
    pos_cols = sorted((int(m.group(1)), c) for c in data.cells.columns if (m := POS_COLUMN.match(c)))
    panels = [("acceptance_rate", "acceptance rate", "accepted / drafted tokens"),
              ("acceptance_length", "acceptance length", "tokens per verify round")]
    panels = [p for p in panels if p[0] in spec]
    fig, axes = plt.subplots(1, len(panels) + bool(pos_cols), figsize=(4.2 * (len(panels) + bool(pos_cols)), 4.4), squeeze=False)
    for ax, (metric, title, label) in zip(axes[0], panels):
        ax.set_title(title, fontsize=11, fontweight="bold")
        col = x_axis(data)[0]
        for server, frame in spec.groupby("server", sort=True):
            s = styles[server]
            frame = frame.sort_values(col)
            ax.plot(frame[col], frame[metric], marker=s.marker, color=s.color, lw=1.8, ms=5, label=s.label)
        _x(ax, data)
        ax.set_ylabel(label)
        ax.set_ylim(0, 1.05 if metric == "acceptance_rate" else None)
        if metric == "acceptance_length":
            ax.set_ylim(bottom=1.0)
    if pos_cols:
        ax = axes[0][-1]
        ax.set_title("per draft position", fontsize=11, fontweight="bold")
        cells = data.cells[_drafts(data.cells)]
        for server, frame in cells.groupby("server", sort=True):
            g = int(frame["num_speculative_tokens"].max()) or len(pos_cols)  # 0: drafting undeclared, g unknown
            cols = [(i, c) for i, c in pos_cols if i <= max(g, 1) and c in frame]
            values = [frame[c].mean() for _, c in cols]
            if cols and np.isfinite(values).any():
                s = styles[server]
                ax.plot([i for i, _ in cols], values, marker=s.marker, color=s.color, lw=1.8, ms=5)
        ax.set_xticks([i for i, _ in pos_cols])
        ax.set_xlabel("draft position i")
        ax.set_ylabel("share of rounds with draft i accepted")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.25)
    _figure_legend(fig, axes[0][0])
    return Plot("acceptance", "Acceptance", "How many drafted tokens the target accepted: rate and tokens per verify round "
                "(including the bonus token) per batch size, and per draft position over all batch sizes. Higher is better.",
                _png(fig, tight=False))


def _drafts(frame: pd.DataFrame) -> pd.Series:
    """Rows of speculative servers, and of servers the plan calls target-only that drafted all the same (their
    acceptance is kept: report.data._no_acceptance_without_drafts)."""
    measured = frame["acceptance_rate"].notna() if "acceptance_rate" in frame else False
    return frame["is_speculative"].astype(bool) | measured


def _memory(data: ReportData, styles: dict[str, Style]) -> Plot | None:
    import matplotlib.pyplot as plt

    if data.cells.empty or "mem_peak_mb" not in data.cells or data.cells["mem_peak_mb"].isna().all():
        return None
    peak = data.cells.groupby("server", sort=True)["mem_peak_mb"].max().dropna()
    sources = data.cells.groupby("server")["mem_source"].first() if "mem_source" in data.cells else pd.Series(dtype=object)
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.42 * len(peak)))
    names = list(peak.index)[::-1]
    ax.barh(names, [peak[n] for n in names], color=[styles[n].color for n in names], height=0.6)
    for i, n in enumerate(names):
        ax.text(peak[n], i, f" {peak[n]:,.0f}", va="center", fontsize=8)
    what = {"nvml": "GPU memory (NVML)", "rss": "host RSS of the server's process tree"}
    kinds = sorted({what.get(str(s), str(s)) for s in sources.dropna()}) or ["memory"]
    ax.set_xlabel(f"peak memory during a cell (MiB; {', '.join(kinds)})")
    ax.set_xlim(0, peak.max() * 1.15)
    ax.grid(axis="x", alpha=0.25)
    return Plot("memory", "Memory per server", "Highest memory seen in any cell of each server; a draft model or head "
                "costs memory the KV cache no longer has. Lower is better.", _png(fig))


def _tuning(data: ReportData, styles: dict[str, Style]) -> Plot | None:
    import matplotlib.pyplot as plt

    if data.tuning is None or data.tuning.comparisons.dropna(subset=["speedup"]).empty:
        return None
    rows = data.tuning.comparisons.dropna(subset=["speedup"]).iloc[::-1]
    hue = method_colors(data.servers).get(data.tuning.method or "", "#3b6ea8")
    colors = [hue if n == "tuned_adaptive" else "#bbbbbb" if n == "oracle" else "#888888" for n in rows["name"]]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.42 * len(rows)))
    bars = ax.barh(rows["label"], rows["speedup"], color=colors, height=0.6)
    for bar, n in zip(bars, rows["name"]):
        if n == "oracle":
            bar.set_hatch("//")
    for i, v in enumerate(rows["speedup"]):
        ax.text(v, i, f" {v:.3f}×  ({v - 1:+.1%})", va="center", fontsize=8)
    ax.axvline(1.0, color="#555555", lw=1.2, ls=":")
    ax.set_xlim(min(0.9, rows["speedup"].min() * 0.95), rows["speedup"].max() * 1.18)
    ax.set_xlabel("speedup over target-only (×, simulated on the measured traces)")
    ax.grid(axis="x", alpha=0.25)
    return Plot("tuning", "Tuned config vs the alternatives", "Each policy replayed on the same measured traces; right of the "
                "dotted line beats target-only. The oracle is a bound no config reaches.", _png(fig))


# --- helpers -----------------------------------------------------------------------------------------------


def x_axis(data: ReportData) -> tuple[str, list, str]:
    """What the figures plot against: batch size, or in an open loop with one cap the request rate (its batch size
    is only the cap on requests in flight): (column, measured values, axis label)."""
    frame = data.per_cell
    if not frame.empty and "request_rate" in frame and frame["request_rate"].notna().any() and len(data.batch_sizes) == 1:
        return "request_rate", sorted(frame["request_rate"].dropna().unique()), \
            f"request rate (requests/s; at most {data.batch_sizes[0]} in flight)"
    return "batch_size", list(data.batch_sizes), BATCH_LABEL


def _x(ax, data: ReportData) -> str:
    column, values, label = x_axis(data)
    _batch_axis(ax, values)
    ax.set_xlabel(label)
    return column


def _batch_axis(ax, sizes: list) -> None:
    """Log-2 axis when the sizes span a factor of 4 or more; ticks only at measured sizes, as plain numbers."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    if len(sizes) > 1 and max(sizes) / max(min(sizes), 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_major_formatter(FixedFormatter([f"{s:g}" for s in sizes]))
    ax.xaxis.set_minor_locator(NullLocator())
    if len(sizes) == 1:
        ax.set_xlim(sizes[0] * 0.5, sizes[0] * 1.5)
    ax.set_xlabel(BATCH_LABEL)
    ax.grid(alpha=0.25)


def _figure_legend(fig, ax) -> None:
    """One legend under a row of panels, in rows of at most 5 entries."""
    handles, labels = ax.get_legend_handles_labels()
    ncol = min(5, len(labels)) or 1
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05 + 0.045 * ((len(labels) - 1) // ncol), 1, 1))


def _legend(ax, handles, labels) -> None:
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _png(fig, tight: bool = True) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    if tight:
        fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return buf.getvalue()
