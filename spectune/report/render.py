"""Turn ReportData and the plots into report.html and report.md through the jinja2 templates in templates/.

Numbers are formatted here (units in the column headers), so both templates show the same figures. Every string
from the run (server names, prompts, outputs, errors) reaches the page escaped: HTML by jinja2's autoescape,
Markdown by md_escape (backslash escapes, so a viewer shows `<script>` as text and no entity ever shows)."""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from spectune.analysis import open_loop, where_text
from spectune.confirm import naming_run
from spectune.holdout import ANCHOR_NOTE, HOLDOUT_NAMES, HOLDOUTS, NOISE_FLOOR_MEANING, NONE_INSIDE, NOT_COMPUTED, ONE_LAUNCH_NOTE, none_inside
from spectune.report.data import ReportData, drafted_undeclared
from spectune.report.plots import Plot
from spectune.summary import pick_notes

METRIC_DEFINITIONS = [
    ("speedup", "×", "speculative / target-only output throughput at the same batch size and traffic, paired by repeat; "
     "geometric mean over repeats with a 95% t-interval on the log-ratios (none with one repeat)"),
    ("output_throughput_tps", "tokens/s", "output tokens (never chunks) of successful requests / the cell's window, first send to last end"),
    ("ttft_ms", "ms", "time to first token: request due (its arrival under trace/Poisson traffic, its send in closed loop) "
     "to the first streamed chunk that carries an output token"),
    ("tpot_ms", "ms", "time per output token after the first, per request: (e2e - ttft) / (output tokens - 1)"),
    ("icl_ms", "ms", "inter-chunk latency: gap between consecutive token-carrying chunks, one value per gap (vLLM bench's 'ITL')"),
    ("itl_ms", "ms", "inter-token latency: each chunk gap split evenly over that chunk's tokens (SGLang bench's ITL)"),
    ("e2e_ms", "ms", "end-to-end latency per request: due to its last token-carrying chunk"),
    ("tokens_per_chunk", "tokens", "output tokens per streamed chunk; above 1 when drafts are accepted"),
    ("acceptance_rate", "share", "accepted draft tokens / proposed draft tokens over the cell, from the server's counters"),
    ("acceptance_length", "tokens/round", "tokens per verify round including the bonus token: 1 + accepted / rounds"),
    ("accept_pos_i", "share", "share of verify rounds whose i-th draft token was accepted"),
    ("mem_peak_mb", "MiB", "peak GPU memory (NVML) when a GPU is present, else the server process tree's resident memory (RSS)"),
    ("p50 / p90 / p99", "", "percentiles over the requests (or gaps) of one cell, then the mean over repeats"),
]
OPTIONAL_DEFINITIONS = [  # shown when a run has the column (newer load generators add them)
    ("goodput_rps", "requests/s", "successful requests meeting every latency limit (SLO) / the cell's window"),
    ("queue_delay_ms", "ms", "time a request waited in the client for a free slot under the concurrency cap: "
     "intended arrival to the moment it was sent"),
    ("ttft_from_send_ms", "ms", "TTFT counted from the actual send instead of the intended arrival (the server's share)"),
    ("request_rate", "requests/s", "open loop: the arrival rate the cell offered"),
]


class Verbatim(str):
    """Text a Markdown template shows as is (code blocks, image paths): md_escape leaves it alone."""


@dataclass(slots=True)
class Table:
    headers: list[str]
    rows: list[list[str]]
    numeric: list[bool]  # right-align these columns
    nowrap: list[bool] = field(default_factory=list)  # names that must not wrap
    pre: list[bool] = field(default_factory=list)  # text whose line breaks matter (model output), shown preformatted


# --- formatting --------------------------------------------------------------------------------------------


def num(v: object, digits: int = 3) -> str:
    """A measured number with `digits` significant digits (thousands separated); blank when missing."""
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    if not math.isfinite(x):
        return ""
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:,.{digits}g}" if x != 0 else "0"


def pct(v: object, signed: bool = False) -> str:
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    if not math.isfinite(x):
        return ""
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def speedup_text(s: object, low: object, high: object) -> str:
    if not num(s):
        return ""
    ci = f" ({float(low):.2f}–{float(high):.2f})" if num(low) and num(high) else " (one repeat: no CI)"
    return f"{float(s):.2f}×{ci}"


def _table(rows: list[list[str]], headers: list[str], numeric: list[bool], nowrap: list[bool] | None = None) -> Table:
    return Table(headers, rows, numeric, nowrap or [False] * len(headers))


def undeclared_drafting(data: ReportData) -> dict[str, float]:
    """Servers the plan calls target-only that drafted (report.data.drafted_undeclared): their mean acceptance rate."""
    if data.cells.empty:
        return {}
    drafted = data.cells[drafted_undeclared(data.cells)]
    return {str(s): float(g["acceptance_rate"].mean()) for s, g in drafted.groupby("server")}


def recommendation_table(data: ReportData) -> Table:
    rows = []
    drafting = undeclared_drafting(data)
    for r in data.recommendation.itertuples():
        if r.method == "target-only" and str(r.server) in drafting and not r.compared:
            mine = data.cells[(data.cells["server"] == r.server) & (data.cells["batch_size"] == r.batch_size)]
            rows.append([where_text(r.batch_size, r.request_rate), "nothing to compare: the server speculates", "–", "–",
                         num(mine["acceptance_rate"].mean(), 2), num(mine["acceptance_length"].mean(), 3), str(r.server)])
            continue
        if r.method == "target-only":
            why = ("speculation was clearly slower" if r.is_clear else "no speculative server measured at this batch size" if not r.compared
                   else "no speculative server measured faster" if not r.fastest_speedup > 1.0 else "none faster by the fitted model")
            rows.append([where_text(r.batch_size, r.request_rate), "target-only (no speculation)", "–", f"1× ({why})", "", "",
                         str(r.server)])
            continue
        noise = "" if r.is_clear else ", within noise"
        rows.append([where_text(r.batch_size, r.request_rate), str(r.method), str(r.steps),
                     speedup_text(r.speedup, r.speedup_ci_low, r.speedup_ci_high) + noise,
                     num(r.acceptance_rate, 2), num(r.acceptance_length, 3), str(r.server)])
    rates = data.recommendation["request_rate"] if "request_rate" in data.recommendation else pd.Series(dtype=float)
    place = "request rate (cap in flight)" if rates.notna().any() else "batch size"
    return _table(rows, [place, "use", "g", "speedup (95% CI)", "acceptance rate", "tokens / round", "server"],
                  [True, False, True, True, True, True, False], [False, True, False, True, False, False, True])


def tunable(data: ReportData) -> bool:
    """Static speculative cells beside target-only: what spectune tune needs (adaptive servers' steps move in a cell)."""
    cells = data.cells
    if data.speedups.empty or cells.empty:
        return False
    static = cells["is_speculative"].astype(bool) & (cells["num_speculative_tokens"].fillna(0) > 0)
    if "adaptive_config" in cells:
        static &= cells["adaptive_config"].isna()
    return bool(static.any())


def headline(data: ReportData) -> str:
    """One sentence: where speculation pays and with what."""
    rec = data.recommendation
    if data.per_cell.empty and not data.flagged.empty:
        return (f"No cell finished: all {len(data.flagged)} failed or were cut short; their causes are under Details, "
                "Flagged cells.")
    if rec.empty:
        return "No recommendation: the run has no target-only and speculative cells measured on the same traffic."
    wins = rec[rec["method"] != "target-only"]
    losses = rec[rec["method"] == "target-only"]
    if data.speedups.empty:
        if drafting := undeclared_drafting(data):
            names = ", ".join(drafting)
            return (f"Nothing to compare: {names} drafted tokens (acceptance rate "
                    f"{', '.join(f'{a:.2f}' for a in drafting.values())}), and no target-only server ran beside it. To know "
                    "what speculation gains, sweep it beside a target-only server, its [[servers]] table saying what it runs "
                    "(method, num_speculative_tokens).")
        return "Only target-only servers were measured: add speculative servers to the plan to compare against them."
    slower, unmeasured = losses[losses["compared"].astype(bool)], losses[~losses["compared"].astype(bool)]
    def sizes(frame: pd.DataFrame) -> str:
        rates = frame["request_rate"] if "request_rate" in frame else pd.Series(math.nan, index=frame.index)
        places = ", ".join(where_text(b, r) for b, r in zip(frame["batch_size"], rates))
        return places if rates.notna().any() else f"batch size{'s' if len(frame) > 1 else ''} {places}"
    parts = []
    for (method, steps), group in wins.groupby(["method", "steps"], sort=False):
        parts.append(f"{method} with g={steps} at {sizes(group)} (up to {group['speedup'].max():.2f}× target-only)")
    if parts:
        text = "Use " + "; ".join(parts) + "."
        if not (unclear := wins[~wins["is_clear"].astype(bool)]).empty:
            text += f" At {sizes(unclear)} the gain is within run-to-run noise."
        if not slower.empty:
            text += f" At {sizes(slower)}, serve without speculation."
    else:  # only where a speculative server was measured is "serve without it" an answer
        measured = ", ".join(str(b) for b in slower["batch_size"])
        text = f"Speculative decoding did not beat target-only at any batch size it was measured at ({measured}): serve without it." if measured else ""
    if not unmeasured.empty:
        text += f" At {sizes(unmeasured)} no speculative server was measured: target-only until one is."
    return text.strip()


def latency_table(data: ReportData) -> Table:
    if data.per_cell.empty:  # no cell finished
        return _table([], [], [])
    metrics = [m for m, _ in (("ttft_ms", ""), ("tpot_ms", ""), ("icl_ms", "")) if f"{m}_p50" in data.per_cell]
    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "icl_ms": "ICL"}
    headers = ["server", "batch size"] + [f"{names[m]} {p} (ms)" for m in metrics for p in ("p50", "p90", "p99")]
    rows = [[str(r["server"]), str(int(r["batch_size"]))] + [num(r.get(f"{m}_{p}")) for m in metrics for p in ("p50", "p90", "p99")]
            for _, r in data.per_cell.sort_values(["server", "batch_size"]).iterrows()]
    return _table(rows, headers, [False] + [True] * (len(headers) - 1), [True] + [False] * (len(headers) - 1))


def memory_table(data: ReportData) -> Table:
    if data.cells.empty or "mem_peak_mb" not in data.cells:
        return _table([], [], [])
    what = {"nvml": "GPU (NVML)", "rss": "host RSS"}
    grouped = data.cells.groupby("server", sort=True)
    rows = []
    for server, frame in grouped:
        source = frame["mem_source"].dropna().iloc[0] if "mem_source" in frame and frame["mem_source"].notna().any() else None
        rows.append([str(server), num(frame["mem_peak_mb"].max(), 4), num(frame.get("mem_mean_mb", pd.Series(dtype=float)).mean(), 4),
                     what.get(str(source), str(source or "not measured"))])
    return _table(rows, ["server", "peak (MiB)", "mean (MiB)", "measured as"], [False, True, True, False], [True, False, False, False])


def tuning_table(data: ReportData) -> Table:
    t = data.tuning
    if t is None:
        return _table([], [], [])
    rows = [[r.label, str(r.policy), f"{r.speedup:.3f}×" if num(r.speedup) else "", pct(r.gain, signed=True)]
            for r in t.comparisons.itertuples()]
    return _table(rows, ["policy", "as configured", "speedup over target-only", "gain over target-only"],
                  [False, False, True, True], [False, False, False, False])


def verdict_table(data: ReportData) -> Table:
    """The measured verdict per batch size: the tuned config's mean gain over each config it was measured against."""
    t = data.tuning
    if t is None or t.verdict_by_batch_size.empty:
        return _table([], [], [])
    names = {"sglang-default": "vs SGLang's default", "static": "vs the best static g", "target": "vs target-only"}
    cols = [c for c in names if c in t.verdict_by_batch_size]
    def cell(r: dict, c: str) -> str:
        if c == "sglang-default" and r.get("alike"):
            return "0 (its own slots)"
        return f"{r[c]:+.1f}%" if num(r[c]) else ""

    rows = [[str(int(r["batch_size"]))] + [cell(r, c) for c in cols] for r in t.verdict_by_batch_size.sort_values("batch_size").to_dict("records")]
    return _table(rows, ["batch size"] + [names[c] for c in cols], [True] * (len(cols) + 1), [False] * (len(cols) + 1))


def holdout_table(data: ReportData) -> Table:
    """The cost model's error on cells its fit did not see (spectune.holdout), per way of holding out and method."""
    t = data.tuning
    if t is None or t.holdout.empty:
        return _table([], [], [])
    names = {"step_count": "one step count (g) left out", "batch_size": "one batch size left out",
             "step_count_inside": "one step count (g) left out, inside the measured range",
             "batch_size_inside": "one batch size left out, inside the measured range"}
    rows = [[names.get(str(r["holdout"]), str(r["holdout"])), str(r["method"]), str(int(r["cells"]))]
            + [f"{num(r.get(f'{m}_mean_abs_pct'), 2)}% / {num(r.get(f'{m}_max_abs_pct'), 2)}%" for m in ("tpot", "throughput", "speedup")]
            for r in t.holdout.to_dict("records")]
    return _table(rows, ["held out", "method", "cells", "TPOT error mean / max", "tok/s error mean / max", "speedup error mean / max"],
                  [False, False, True, True, True, True], [True, False, False, False, False, False])


def holdout_noise(data: ReportData) -> str:
    """Sentences under the held-out table: a way of holding out it lacks and why, its noise floor
    (spectune.holdout.noise_floor) and, where it was smoothed, target-only's anchor; empty where none applies."""
    t = data.tuning
    if t is None:
        return ""
    done = set(t.holdout["holdout"]) if "holdout" in t.holdout else set()
    missing = " ".join(f"{HOLDOUT_NAMES[h].capitalize()}: not computed ({NOT_COMPUTED[h]})." for h in HOLDOUTS if done and h not in done)
    if none_inside(done, t.holdout_split):
        missing = f"{missing} {HOLDOUT_NAMES['step_count_inside'].capitalize()}: {NONE_INSIDE}.".strip()
    anchor = f"Here {ANCHOR_NOTE}." if t.holdout_anchor_smoothed else ""
    floor = ""
    if not math.isnan(t.holdout_noise_pct):
        note = f" Here {ONE_LAUNCH_NOTE}." if t.holdout_one_launch else ""
        floor = f"Noise floor: {t.holdout_noise_pct:.1f}%. {NOISE_FLOOR_MEANING[0].upper()}{NOISE_FLOOR_MEANING[1:]}.{note}"
    return naming_run(" ".join(part for part in (missing, floor, anchor) if part), data.results_dir)


def method_tables(data: ReportData) -> list[tuple[str, str, Table]]:
    """Per method: a heading, a one-line finding, and its table."""
    out = []
    for m in data.methods:
        single = f"tok/s with g={m.single_g} everywhere"
        rows = [[str(r.batch_size), str(r.best_g), num(r.best_tps), f"{r.best_speedup:.2f}×" if num(r.best_speedup) else "",
                 num(r.single_tps), pct(r.single_loss)] for r in m.table.itertuples()]
        table = _table(rows, ["batch size", "best g", "tok/s at best g", "speedup vs target-only", single, "lost by one g"],
                       [True] * 6)
        if len(m.steps) < 2:
            finding = f"Only g={m.steps[0]} was measured: nothing to choose between."
        elif m.max_loss == 0:
            finding = (f"One g for every batch size costs nothing: g={m.single_g} was the fastest measured g at every batch size "
                       f"(g measured: {', '.join(map(str, m.steps))}).")
        elif m.max_loss < 0.005:
            finding = (f"One g for every batch size costs almost nothing: g={m.single_g} everywhere loses at most "
                       f"{m.max_loss:.1%} of output throughput (g measured: {', '.join(map(str, m.steps))}).")
        else:
            finding = (f"Running g={m.single_g} at every batch size instead of the best g per batch size loses "
                       f"{m.mean_loss:.1%} of output throughput on average (up to {m.max_loss:.1%}; g measured: "
                       f"{', '.join(map(str, m.steps))}).")
        out.append((m.method, finding, table))
    return out


def flagged_table(data: ReportData) -> Table:
    rows = [[str(r.server), str(r.batch_size), str(r.repeat), str(r.status), pct(r.failure_rate), str(r.why)]
            for r in data.flagged.itertuples()]
    return _table(rows, ["server", "batch size", "repeat", "status", "failed requests", "why"],
                  [False, True, True, False, True, False], [True, False, False, False, False, False])


def clip(text: object, limit: int = 400) -> str:
    """Model text for display: no leading or trailing blank lines, no runs of blank lines, at most `limit` chars."""
    text = re.sub(r"\n\s*\n(\s*\n)+", "\n\n", str(text).strip("\n").rstrip())
    return text if len(text) <= limit else text[:limit] + " …"


def samples_table(data: ReportData) -> Table:
    same = {True: "yes", False: "NO: differs"}
    rows = [[str(r.server), same.get(r.same_as_target, "(reference)" if r.same_as_target is None else ""), clip(r.output)]
            for r in data.samples.itertuples()]
    table = _table(rows, ["server", "same output as target-only", "output"], [False] * 3, [True, True, False])
    table.pre = [False, False, True]
    return table


DETAIL_COLUMNS = [  # (column, header, digits)
    ("output_throughput_tps", "tok/s", 4),
    ("tpot_ms_p50", "TPOT p50 (ms)", 3),
    ("ttft_ms_p50", "TTFT p50 (ms)", 3),
    ("icl_ms_p50", "ICL p50 (ms)", 3),
    ("tokens_per_chunk_mean", "tokens/chunk", 3),
    ("acceptance_rate", "accept. rate", 2),
    ("acceptance_length", "accept. length", 3),
    ("goodput_rps", "goodput (req/s)", 3),
    ("queue_delay_ms_p50", "queue delay p50 (ms)", 3),
    ("mem_peak_mb", "peak MiB", 4),
    ("failure_rate", "failed", 0),
]


def detail_table(data: ReportData) -> Table:
    frame = data.per_cell
    if frame.empty:
        return _table([], [], [])
    cols = [(c, h, d) for c, h, d in DETAIL_COLUMNS if c in frame and frame[c].notna().any()]
    headers = ["server", "batch size", "g", "repeats"] + [h for _, h, _ in cols]
    rows = []
    for _, r in frame.sort_values(["server", "batch_size"]).iterrows():
        rows.append([str(r["server"]), str(int(r["batch_size"])), str(int(r.get("num_speculative_tokens", 0) or 0)),
                     str(int(r.get("num_repeats", 1)))] + [pct(r[c]) if d == 0 else num(r[c], d) for c, _, d in cols])
    return _table(rows, headers, [False] + [True] * (len(headers) - 1), [True] + [False] * (len(headers) - 1))


def header_items(data: ReportData) -> list[tuple[str, str]]:
    m, plan = data.manifest, data.manifest.get("plan", {})
    hw = m.get("hardware", {}) or {}
    progress = m.get("progress", {}) or {}
    status = str(m.get("status", "unknown"))
    if progress:
        status += (f": {progress.get('done', '?')} of {progress.get('total', '?')} cells measured"
                   f", {progress.get('failed', 0)} failed, {progress.get('partial', 0)} interrupted")
    gpus = hw.get("gpus") or []
    versions = sorted({str(e.get("version")) for e in (m.get("engines") or {}).values() if isinstance(e, dict) and e.get("version")})
    items = [
        ("workload", str(plan.get("workload", ""))),
        ("batch sizes", ", ".join(str(b) for b in plan.get("batch_sizes", []))),
        ("repeats", _repeats(plan, m)),
        ("output tokens / request", str(plan.get("max_tokens", ""))),
        ("status", status),
        ("hardware", f"{hw.get('cpu_count', '?')} CPUs, {hw.get('memory_gb', '?')} GiB RAM, "
                     + (f"GPUs: {', '.join(map(str, gpus))}" if gpus else "no GPU")),
        ("engines", ", ".join(versions)),
        ("measured", _when(m.get("started_at"), m.get("finished_at") or m.get("updated_at"))
                     + (f" from start to end, resumed {len(m['resumed_at'])}x" if m.get("resumed_at") else "")
                     + (" from the first run's start to the last's end" if m.get("merged_from") else "")),
        ("merged from", _merged(m.get("merged_from") or [])),
        ("guided sweep", guided_text(m.get("guided") or {})),
        ("spectune", f"{m.get('spectune_version', '')} (git {str(m.get('git_sha') or 'unknown')[:10]})"),
    ]
    return [(k, v) for k, v in items if v.strip()]


def _repeats(plan: dict, manifest: dict) -> str:
    """'6 (2 at the start, more added on resume)' where spectune sweep --resume --repeats added some."""
    added = manifest.get("repeats_added") or []
    text = str(plan.get("repeats", ""))
    return f"{text} ({added[0].get('from')} at the start, more added on resume)" if added else text


def _merged(runs: list[dict]) -> str:
    """'2 runs (spectune merge): grid-a (2026-12-04 16:20 UTC, 8.0 min; repeats 0-1), ...'."""
    if not runs:
        return ""
    parts = [f"{Path(str(r.get('path', '?'))).name} ({_when(r.get('started_at'), r.get('finished_at'))}; repeats "
             f"{r['repeats'][0]}-{r['repeats'][1]})" for r in runs]
    return f"{len(runs)} runs (spectune merge): " + ", ".join(parts)


def guided_text(guided: dict) -> str:
    """'28 of 114 (server, batch size) cells measured (budget 0.25: ...)' for a run of spectune sweep --budget."""
    if not guided:
        return ""
    text = (f"{len(guided.get('measured', []))} of {guided.get('total_cells', '?')} (server, batch size) cells measured "
            f"(budget {guided.get('budget', '?')}: seed cells, then {guided.get('rounds', 0)} chosen by the cost model); "
            "the answer is the best measured cell at each batch size; ")
    if guided.get("stopped") == "stable":
        return text + "stopped when no unmeasured cell could beat it"
    better = guided.get("expected_better") or []
    text += "stopped at the budget"
    if guided.get("unseeded_methods"):
        text += (f"; no cell of {', '.join(guided['unseeded_methods'])} was measured (the budget was smaller than the "
                 f"{guided.get('seed_cells', '?')} seed cells)")
    if better:
        text += ("; the model expects these unmeasured cells to be faster: "
                 + ", ".join(f"batch {b['batch_size']}: {b['server']} {b['predicted_tps'] / b['best_tps'] - 1:+.0%} over {b['best_server']}"
                             for b in better)
                 + " (spectune sweep --resume with a larger --budget measures on)")
    return text


def _when(start: object, end: object) -> str:
    """'2026-11-30 20:58 UTC, 20 s' from the manifest's ISO times; whatever is there when they do not parse."""
    import datetime as dt

    try:
        a, b = dt.datetime.fromisoformat(str(start)), dt.datetime.fromisoformat(str(end))
    except ValueError:
        return str(start or "")
    seconds = (b - a).total_seconds()
    took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
    return f"{a.astimezone(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {took}"


def definitions(data: ReportData) -> list[tuple[str, str, str]]:
    extra = [(k, u, t) for k, u, t in OPTIONAL_DEFINITIONS if any(c.startswith(k) for c in data.cells.columns)]
    return METRIC_DEFINITIONS + extra


# --- the two writers ---------------------------------------------------------------------------------------


def context(data: ReportData, plots: list[Plot]) -> dict:
    tuning = data.tuning
    return {
        "title": data.title,
        "results_dir": str(data.results_dir),
        "header": header_items(data),
        "headline": headline(data),
        "recommendation": recommendation_table(data),
        "pick_notes": (pick_notes(data.recommendation) if not data.recommendation.empty else []) + data.model_notes,
        "tuning": tuning,
        "deploy": tuning.deploy if tuning else [],
        "tunable": tunable(data),
        "plots": {p.name: p for p in plots},
        "latency": latency_table(data),
        "memory": memory_table(data),
        "tuning_table": tuning_table(data),
        "holdout": holdout_table(data),
        "holdout_noise": holdout_noise(data),
        "verdict_table": verdict_table(data),
        "methods": method_tables(data),
        "flagged": flagged_table(data),
        "samples": samples_table(data),
        "prompt": clip(data.samples["prompt"].iloc[0]) if not data.samples.empty else "",
        "detail": detail_table(data),
        "definitions": definitions(data),
        "notes": data.notes,
        "engine_names": {"sglang": "SGLang", "vllm": "vLLM", "llamacpp": "llama.cpp"},
        "open_loop": bool(open_loop(data.cells).any()),  # rows are request rates, speedup a TPOT ratio
    }


def _env(markdown: bool):
    import jinja2

    if markdown:
        return jinja2.Environment(loader=jinja2.PackageLoader("spectune.report", "templates"), autoescape=False,
                                  finalize=md_escape, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    return jinja2.Environment(loader=jinja2.PackageLoader("spectune.report", "templates"), autoescape=True,
                              trim_blocks=True, lstrip_blocks=True)


def render_html(data: ReportData, plots: list[Plot]) -> str:
    env = _env(markdown=False)
    env.filters["b64"] = lambda png: base64.b64encode(png).decode()
    return env.get_template("report.html").render(**context(data, plots))


def render_markdown(data: ReportData, plots: list[Plot]) -> str:
    env = _env(markdown=True)
    env.filters["verbatim"] = Verbatim
    env.filters["fence"] = fence
    env.filters["code"] = code_span
    return env.get_template("report.md").render(**context(data, plots))


_MD_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_[]<>|&~"})


def md_escape(value: object) -> str:
    """Markdown-safe text of one template value: backslash-escape what Markdown or its embedded HTML would read as
    syntax (so `<script>` shows as text and no HTML entity appears), and keep it on one line (table cells)."""
    if value is None:
        return ""
    if isinstance(value, Verbatim):
        return str(value)
    return " ".join(str(value).split()).translate(_MD_SPECIAL)


def code_span(text: object) -> Verbatim:
    """Inline code: backslashes mean nothing inside it, so the delimiter is a backtick run the text lacks."""
    text = " ".join(str(text).split())
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return Verbatim(f"{ticks}{pad}{text}{pad}{ticks}")


def fence(text: str) -> Verbatim:
    """A fenced code block around text, with a fence longer than any backtick run inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return Verbatim(f"{ticks}\n{text}\n{ticks}")
