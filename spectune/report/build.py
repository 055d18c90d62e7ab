"""Build the report from a results directory: tables (pandas), plots (matplotlib), two writers."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from spectune.store import atomic_write_bytes, load_run

METRIC_DEFINITIONS = [
    ("ttft_ms", "time to first token: request due (its arrival under trace/Poisson traffic, its send in closed loop) to the "
                "first chunk carrying at least one output token (ms); ttft_from_send_ms counts from the actual send"),
    ("icl_ms", "inter-chunk latency: gap between consecutive token-carrying chunks, one value per gap (vLLM bench's 'ITL') (ms)"),
    ("itl_ms", "inter-token latency: each chunk gap split evenly over the tokens of that chunk (SGLang bench's ITL) (ms)"),
    ("tpot_ms", "time per output token after the first, per request: (e2e - ttft) / (output_tokens - 1) (ms)"),
    ("e2e_ms", "end-to-end latency per request: due to last token-carrying chunk (ms); e2e_from_send_ms from the send"),
    ("queue_delay_ms", "time a request waited in the client for a free slot under the concurrency cap (ms)"),
    ("tokens_per_chunk", "output tokens per streamed chunk; above 1 when speculation accepts drafts"),
    ("output_throughput_tps", "output tokens per second over the measured window, all requests together (tok/s)"),
    ("acceptance_rate", "accepted draft tokens / proposed draft tokens over the cell, from the server's counters"),
    ("acceptance_length", "mean tokens per verify round including the bonus token: 1 + accepted / rounds"),
    ("speedup", "speculative / target-only output throughput at the same batch size and traffic; 95% CI over repeats"),
    ("mem_peak_mb", "peak GPU memory (NVML) or server process-tree RSS (CPU) during the cell (MiB)"),
]

SHOWN = ["output_throughput_tps", "tpot_ms_mean", "ttft_ms_mean", "icl_ms_p50", "itl_ms_p50", "tokens_per_chunk_mean",
         "acceptance_rate", "acceptance_length", "mem_peak_mb", "failure_rate"]


@dataclass(slots=True)
class ReportData:
    title: str
    manifest: dict
    per_cell: pd.DataFrame  # mean over repeats of each (server, batch size)
    speedups: pd.DataFrame
    flagged: pd.DataFrame  # failed/partial cells and cells over the failure-rate limit
    samples: pd.DataFrame  # the first request of the smallest batch size: prompt and each server's output
    plots: dict[str, bytes]  # name -> PNG


def collect(results: Path) -> ReportData:
    from spectune.analysis import speedup_table

    run = load_run(results)
    cells = run.cells
    limit = run.manifest.get("plan", {}).get("max_failure_rate", 0.05)
    if cells.empty:
        empty = pd.DataFrame()
        return ReportData(str(run.manifest.get("run_id", results.name)), run.manifest, empty, empty, empty, empty, {})
    ok = cells[(cells["status"] == "ok") & (cells["failure_rate"].fillna(0) <= limit)]
    flagged = cells[~cells.index.isin(ok.index)][["server", "batch_size", "repeat", "status", "failure_rate", "error"]]
    shown = [c for c in SHOWN if c in ok.columns]
    axis = ["batch_size", "request_rate"] if "request_rate" in ok and ok["request_rate"].notna().any() else ["batch_size"]
    per_cell = ok.groupby(["server", "num_speculative_tokens", *axis], dropna=False)[shown].mean().reset_index()
    speedups = speedup_table(ok) if not ok.empty else pd.DataFrame()
    return ReportData(str(run.manifest.get("run_id", results.name)), run.manifest, per_cell, speedups, flagged,
                      _samples(run.requests), _plots(per_cell, speedups))


def _samples(requests: pd.DataFrame) -> pd.DataFrame:
    """Prompt and output of one request on every server: greedy outputs should match (lossless)."""
    if requests.empty or "prompt" not in requests:
        return pd.DataFrame()
    parts = requests["cell"].str.split("__", expand=True)
    frame = requests.assign(server=parts[0], bs=parts[1].str[2:].astype(int))
    first = frame[(frame["bs"] == frame["bs"].min()) & (frame["index"] == frame["index"].min())]
    first = first.drop_duplicates("server")
    return pd.DataFrame({"server": first["server"], "prompt": first["prompt"].str[:160], "output": first["text"].str[:160]})


def _plots(per_cell: pd.DataFrame, speedups: pd.DataFrame) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: dict[str, bytes] = {}
    if per_cell.empty:
        return plots
    for metric, label in (("output_throughput_tps", "output throughput (tok/s)"), ("tpot_ms_mean", "mean TPOT (ms)")):
        if metric not in per_cell:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for server, frame in per_cell.groupby("server"):
            ax.plot(frame["batch_size"], frame[metric], marker="o", label=str(server))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (concurrent requests)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        plots[metric] = _png(fig)
    if not speedups.empty and "speedup" in speedups:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for server, frame in speedups.groupby("server"):
            ax.errorbar(frame["batch_size"], frame["speedup"],
                        yerr=[frame["speedup"] - frame["speedup_ci_low"], frame["speedup_ci_high"] - frame["speedup"]],
                        marker="o", capsize=3, label=str(server))
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (concurrent requests)")
        ax.set_ylabel("speedup vs target-only (x)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        plots["speedup"] = _png(fig)
    return plots


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_report(results: str | Path, out: str | Path) -> list[Path]:
    results, out = Path(results), Path(out)
    data = collect(results)
    md, page = out / "report.md", out / "report.html"
    for name, png in data.plots.items():
        atomic_write_bytes(out / f"{name}.png", png)
    atomic_write_bytes(md, render_markdown(data).encode())
    atomic_write_bytes(page, render_html(data).encode())
    return [page, md]


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "" if v != v else f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return "" if v is None else str(v)


def _md_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_none_\n"
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in frame.itertuples(index=False):
        # html.escape: Markdown viewers render raw HTML, and a prompt may hold <script>
        lines.append("| " + " | ".join(html.escape(_fmt(v)).replace("|", "\\|").replace("\n", " ") for v in row) + " |")
    return "\n".join(lines) + "\n"


def _header(data: ReportData) -> list[tuple[str, str]]:
    m, plan = data.manifest, data.manifest.get("plan", {})
    hw = m.get("hardware", {})
    return [
        ("run", str(m.get("run_id", ""))),
        ("workload", str(plan.get("workload", ""))),
        ("batch sizes", ", ".join(str(b) for b in plan.get("batch_sizes", []))),
        ("repeats", str(plan.get("repeats", ""))),
        ("status", f"{m.get('status', '')} ({m.get('progress', {})})"),
        ("hardware", f"{hw.get('cpu_count', '?')} CPUs, {hw.get('memory_gb', '?')} GiB, GPUs: {hw.get('gpus') or 'none'}"),
        ("git sha", str(m.get("git_sha", ""))),
    ]


def render_markdown(data: ReportData) -> str:
    parts = [f"# spectune report: {data.title}\n"]
    parts += [f"- **{k}**: {v}" for k, v in _header(data)]
    parts.append("\n## Speedup vs target-only (same traffic, same batch size)\n")
    parts.append(_md_table(data.speedups))
    parts.append("\n## Per cell (mean over repeats)\n")
    parts.append(_md_table(data.per_cell))
    parts.append("\n## Flagged cells (failed, interrupted, or too many failed requests; excluded above)\n")
    parts.append(_md_table(data.flagged))
    parts.append("\n## Sample output (first request, smallest batch size; greedy outputs must match)\n")
    parts.append(_md_table(data.samples))
    for name in data.plots:
        parts.append(f"\n![{name}]({name}.png)\n")
    parts.append("\n## What the metrics mean\n")
    parts += [f"- `{k}`: {v}" for k, v in METRIC_DEFINITIONS]
    return "\n".join(parts) + "\n"


def _html_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>" for row in frame.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def render_html(data: ReportData) -> str:
    # Every string from the run (names, errors, workload paths) goes through html.escape: a prompt or a server
    # name containing <script> is shown, never run.
    esc = html.escape
    header = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _header(data))
    imgs = "".join(f'<figure><img alt="{esc(n)}" src="data:image/png;base64,{base64.b64encode(p).decode()}"></figure>'
                   for n, p in data.plots.items())
    defs = "".join(f"<li><code>{esc(k)}</code>: {esc(v)}</li>" for k, v in METRIC_DEFINITIONS)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>spectune report: {esc(data.title)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}figure{{display:inline-block;margin:0.5em}}</style></head><body>
<h1>spectune report: {esc(data.title)}</h1><table>{header}</table>
<h2>Speedup vs target-only (same traffic, same batch size)</h2>{_html_table(data.speedups)}
{imgs}
<h2>Per cell (mean over repeats)</h2>{_html_table(data.per_cell)}
<h2>Flagged cells (failed, interrupted, or too many failed requests; excluded above)</h2>{_html_table(data.flagged)}
<h2>Sample output (first request, smallest batch size; greedy outputs must match)</h2>{_html_table(data.samples)}
<h2>What the metrics mean</h2><ul>{defs}</ul></body></html>
"""
