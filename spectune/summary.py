"""The closing summary of `spectune sweep`: the measured recommendation per batch size, what each engine's config
runs, and every file written. A rich table on a terminal, aligned plain text otherwise."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

COLUMNS = ("batch size", "method", "steps", "speedup", "95% CI", "clear?", "acceptance", "accept. length")
RESULT_FILES = ("run.json", "cells.parquet", "requests.parquet", "summary.parquet", "study.db")
RESULT_DIRS = ("cells", "requests", "rounds", "logs")


@dataclass(slots=True)
class Summary:
    rows: list[tuple[str, ...]]  # COLUMNS, formatted
    deploy: list[tuple[str, str, str]]  # engine, method, file
    files: list[str]  # every file or folder written, absolute; folders with their file count
    notes: list[str] = field(default_factory=list)  # where the pick is not the server measured fastest, or the fit missed
    open_loop: bool = False  # trace or poisson: the speedup is a TPOT ratio (analysis.speedup_table)


def build_summary(results: Path, report_files: list[Path] = ()) -> Summary:
    from spectune.analysis import OPEN_LOOP_NOTE, open_loop, recommendation_table
    from spectune.drain import request_speeds
    from spectune.guided import model_fit, trusted_tps, untrusted_notes
    from spectune.store import first_target, load_run

    run = load_run(results)
    rows, notes = [], []
    opened = not run.cells.empty and bool(open_loop(run.cells).any())
    if not run.cells.empty:
        fit = model_fit(run.cells, request_speeds(run.requests))
        table = recommendation_table(run.cells, run.manifest.get("plan", {}).get("max_failure_rate", 0.05),
                                     first_target(run.manifest, run.cells), trusted_tps(fit))
        rows = [_row(r) for r in table.itertuples(index=False)]
        notes = pick_notes(table) + untrusted_notes(fit) + ([OPEN_LOOP_NOTE] if opened else [])
    return Summary(rows=rows, deploy=_deploy(results / "tuned" / "tuning.json"), files=_files(Path(results), report_files),
                   notes=notes, open_loop=opened)


def pick_notes(table: pd.DataFrame) -> list[str]:
    """One line per batch size where the pick is not the server measured fastest (recommendation_table)."""
    notes = []
    differs = table["fastest_measured"].notna() & (table["server"] != table["fastest_measured"]) & (table["fastest_speedup"] > 1.0)
    for r in table[differs].itertuples():
        pick = "target-only" if r.method == "target-only" else f"{r.server} ({r.speedup:.2f}x measured, {r.expected_speedup:.2f}x fitted)"
        fitted = f"{r.fastest_expected:.2f}x" if _finite(r.fastest_expected) else "not fitted"
        notes.append(f"batch {r.batch_size}: {pick}, not {r.fastest_measured}, measured fastest ({r.fastest_speedup:.2f}x) "
                     f"but {fitted} by the cost model fitted on every cell")
    return notes


def _row(r) -> tuple[str, ...]:
    from spectune.analysis import where_text

    ci = f"[{r.speedup_ci_low:.2f}, {r.speedup_ci_high:.2f}]" if _finite(r.speedup_ci_low) else "-"
    is_target = r.method == "target-only"
    clear = "yes" if r.is_clear else ("no CI" if not _finite(r.speedup_ci_low) and not is_target
                                      else "within noise" if r.compared else "not compared")
    return (where_text(r.batch_size, r.request_rate), str(r.method), str(r.steps), f"{r.speedup:.2f}x", ci, clear,
            f"{r.acceptance_rate:.2f}" if _finite(r.acceptance_rate) else "-",
            f"{r.acceptance_length:.2f}" if _finite(r.acceptance_length) else "-")


def _deploy(tuning: Path) -> list[tuple[str, str, str]]:
    from spectune.deploy_engines import ENGINE_NAMES

    if not tuning.is_file():
        return []
    entries = json.loads(tuning.read_text()).get("deploy", [])
    return [(ENGINE_NAMES.get(d["engine"], d["engine"]), d.get("method") or "no equivalent (see deploy.md)", d.get("file") or "-")
            for d in entries]


def _files(results: Path, report_files: list[Path]) -> list[str]:
    root = results.resolve()
    out = [str(root / name) for name in RESULT_FILES if (root / name).is_file()]
    for name in RESULT_DIRS:
        if (root / name).is_dir():
            count = sum(1 for p in (root / name).iterdir() if p.is_file())
            out.append(f"{root / name}/ ({count} files)")
    tuned = root / "tuned"
    if tuned.is_dir():
        out += sorted(str(p) for p in tuned.iterdir() if p.is_file() and not p.name.startswith("."))
    for folder in dict.fromkeys(Path(p).resolve().parent for p in report_files):  # the report and its plots
        out += sorted(str(p) for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return out


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x)) and not pd.isna(x)


TITLE = ("Recommendation per batch size (of the static servers measured faster than target-only, the one the cost model "
         "fitted on every cell expects fastest; target-only where none)")
CAPTION = ("speedup: output tokens/s vs target-only at that batch size, geometric mean over repeats, with its 95% CI; "
           "clear?: the CI excludes 1; acceptance: accepted / proposed drafts; accept. length: tokens per verify round")


def columns(summary: Summary) -> tuple[str, ...]:
    """COLUMNS; in an open loop a row is a request rate and its cap on requests in flight (as in the report)."""
    return ("request rate (cap in flight)", *COLUMNS[1:]) if summary.open_loop else COLUMNS


def title(summary: Summary) -> str:
    return TITLE.replace("per batch size", "per request rate") if summary.open_loop else TITLE


def caption(summary: Summary) -> str:
    text = CAPTION
    if summary.open_loop:
        text = text.replace("speedup: output tokens/s vs target-only at that batch size", "speedup: target-only's TPOT / the "
                            "server's on the same arrivals (they set tok/s)")
    if any(r[5] == "not compared" for r in summary.rows):
        return text + "; not compared: no speculative server was measured at that batch size"
    return text


def plain_text(summary: Summary) -> str:
    lines = [title(summary), caption(summary)]
    if summary.rows:
        widths = [max(len(c), *(len(r[i]) for r in summary.rows)) for i, c in enumerate(columns(summary))]
        lines.append("  ".join(c.ljust(w) for c, w in zip(columns(summary), widths)).rstrip())
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in summary.rows]
    else:
        lines.append("(no target-only cell finished: nothing to recommend)")
    lines += summary.notes
    if summary.deploy:
        lines.append("Deploy (each engine's config runs the fastest measured method it can; why: tuned/deploy.md):")
        width = max(len(e) for e, _, _ in summary.deploy)
        lines += [f"  {e.ljust(width)}  {m}: {f}" for e, m, f in summary.deploy]
    lines.append("Files written:")
    lines += [f"  {f}" for f in summary.files]
    return "\n".join(lines)


def print_rich(summary: Summary, console) -> None:
    from rich.table import Table

    table = Table(title=title(summary), caption=caption(summary), title_justify="left", caption_justify="left")
    for i, c in enumerate(columns(summary)):
        table.add_column(c, justify="right" if i in (0, 2, 3, 6, 7) else "left")
    for r in summary.rows:
        table.add_row(*r)
    if summary.rows:
        console.print(table)
    else:
        console.print("(no target-only cell finished: nothing to recommend)")
    for note in summary.notes:
        console.print(note, highlight=False, markup=False, soft_wrap=True)
    if summary.deploy:
        deploy = Table(title="Deploy (each engine's config runs the fastest measured method it can; why: tuned/deploy.md)",
                       title_justify="left")
        for c in ("engine", "method", "file"):
            deploy.add_column(c, overflow="fold")
        for row in summary.deploy:
            deploy.add_row(*row)
        console.print(deploy)
    console.print("Files written:", highlight=False)
    for f in summary.files:
        console.print(f"  {f}", highlight=False, markup=False, soft_wrap=True)
