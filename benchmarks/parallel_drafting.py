"""Parallel vs autoregressive drafting, measured on the embedded engine (issue 11): the EAGLE head and the dflash
head at K = 1..8, batch sizes 1-32, on the quote and code workloads (configs/parallel-drafting.toml).

    flock /tmp/spectune-cpu.lock python benchmarks/parallel_drafting.py run [--out results/parallel-drafting] [--budget-s 840]
    python benchmarks/parallel_drafting.py report [--out results/parallel-drafting] [--markdown FILE]

`run` sweeps (or resumes) one results directory per workload, OUT/<workload>, and stops the sweep with SIGINT
once `--budget-s` has passed (the cell in flight is re-run on the next call): repeat it, under the CPU lock, until
it says every cell is done. `report` prints, per workload and drafter:

- the round cost fitted per batch size (spectune.costmodel.fit_sweep): target_ms + draft_fixed_ms + per_step_ms x K,
  where per_step_ms is what one more draft position costs (drafting it, ~0 for a parallel drafter, plus verifying it);
- acceptance per draft position: a_k = P(draft k accepted | drafts 1..k-1 accepted), pooled over batch sizes;
- output-throughput speedup over target-only at every K and batch size (geometric mean over repeats, 95% CI);
- the best K per batch size, and the throughput lost by running one K at every batch size (the K that loses
  least, as a geometric mean over batch sizes) instead of the best K at each: "less tuning" as a number.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.analysis import speedup_table
from spectune.costmodel import fit_sweep
from spectune.store import load_run

REPO = Path(__file__).resolve().parent.parent
PLAN = REPO / "configs" / "parallel-drafting.toml"
WORKLOADS = ("quote", "code")
DRAFTERS = ("eagle", "dflash")


def run(out: Path, workloads: list[str], budget_s: float) -> bool:
    """Sweep or resume each workload's directory until the budget is spent; True when every cell is done."""
    deadline = time.monotonic() + budget_s
    for workload in workloads:
        root = out / workload
        left = deadline - time.monotonic()
        if left < 30:
            return False
        args = ["--resume", str(root)] if (root / "run.json").exists() else [str(PLAN), "--workload", workload, "--out", str(root)]
        command = [sys.executable, "-m", "spectune.cli", "sweep", *args]
        print("$ " + " ".join(command[1:]), flush=True)
        # SIGINT restored to its default in the child: a shell starts background jobs with it ignored, and a
        # Python started so never sees Ctrl-C (the sweep would then run past the budget).
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            code = process.wait(timeout=left)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)  # the sweep saves what it finished and exits 130
            process.wait()
            print(f"budget spent; run again to resume {root}", flush=True)
            return False
        if code != 0:
            print(f"sweep of {workload} exited {code}; its failed cells are listed in {root}/cells", flush=True)
    return True


def drafter_tables(cells: pd.DataFrame, workload: str) -> dict[str, pd.DataFrame | str]:
    """The tables for one workload's cells (see the module docstring)."""
    speed = speedup_table(cells)
    method = cells.groupby("server")["method"].first()
    speed["drafter"] = speed["server"].map(method)
    out: dict[str, pd.DataFrame | str] = {}
    fits = {}
    for drafter in DRAFTERS:
        fits[drafter] = fit_sweep(cells, engine="embedded", method=drafter)
    cost = pd.concat([fit.table.assign(drafter=name) for name, fit in fits.items()])
    out["cost"] = cost[["drafter", "batch_size", "target_ms", "draft_fixed_ms", "draft_fixed_se_ms", "per_step_ms",
                        "per_step_se_ms", "rmse_ms"]]
    out["acceptance"] = pd.DataFrame(
        {name: pd.Series(fit.profile(workload).rates, index=[f"a{i + 1}" for i in range(len(fit.profile(workload).rates))])
         for name, fit in fits.items()}).T
    for name, fit in fits.items():
        out["acceptance"].loc[name, "E(K=8)"] = fit.profile(workload).expected_tokens(8)
    out["speedup"] = speed.pivot_table(index=["drafter", "num_speculative_tokens"], columns="batch_size", values="speedup")
    out["speedup_ci"] = speed
    best_rows, loss_rows = [], []
    for drafter in DRAFTERS:
        grid = out["speedup"].loc[drafter]  # [K, batch size]
        best = grid.max()  # per batch size
        for bs in grid.columns:
            k = int(grid[bs].idxmax())
            row = speed[(speed["drafter"] == drafter) & (speed["batch_size"] == bs) & (speed["num_speculative_tokens"] == k)].iloc[0]
            best_rows.append({"drafter": drafter, "batch_size": int(bs), "best_k": k, "speedup": row["speedup"],
                              "ci_low": row["speedup_ci_low"], "ci_high": row["speedup_ci_high"]})
        share = grid / best  # throughput of K relative to the best K, per batch size
        mean_share = np.exp(np.log(share).mean(axis=1))  # per K, geometric mean over batch sizes
        k_single = int(mean_share.idxmax())
        loss_rows.append({"drafter": drafter, "best_single_k": k_single,
                          "mean_loss": 1.0 - float(mean_share[k_single]),
                          "worst_loss": 1.0 - float(share.loc[k_single].min()),
                          "worst_at_batch_size": int(share.loc[k_single].idxmin())})
    out["best_k"] = pd.DataFrame(best_rows)
    out["single_k"] = pd.DataFrame(loss_rows)
    return out


def markdown(tables: dict[str, dict], machine: str) -> str:
    lines = [f"Machine: {machine}.", ""]
    for workload, t in tables.items():
        lines += [f"#### Workload `{workload}`", "",
                  "Round cost fitted per batch size (ms; `spectune.costmodel.fit_sweep`): "
                  "t_round = target_ms + draft_fixed_ms + per_step_ms x K, ± standard errors.", "",
                  "| drafter | batch | target_ms | draft_fixed_ms | per_step_ms | fit rmse |", "|---|---|---|---|---|---|"]
        for r in t["cost"].itertuples():
            lines.append(f"| {r.drafter} | {r.batch_size} | {r.target_ms:.2f} | {r.draft_fixed_ms:.2f} ± {_num(r.draft_fixed_se_ms)} | "
                         f"{r.per_step_ms:.2f} ± {_num(r.per_step_se_ms)} | {r.rmse_ms:.2f} |")
        acc = t["acceptance"]
        cols = list(acc.columns)
        lines += ["", "Acceptance per draft position (a_k = P(draft k accepted | drafts 1..k-1 accepted), from the per-position "
                  "counters of the servers with K >= k, pooled over batch sizes; E(K=8) = expected tokens per round).", "",
                  "| drafter | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, row in acc.iterrows():
            lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
        grid = t["speedup"]
        sizes = list(grid.columns)
        lines += ["", "Output-throughput speedup over target-only (geometric mean over repeats; best K per batch size in bold).", "",
                  "| drafter | K | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---|---" + "|---" * len(sizes) + "|"]
        for (drafter, k), row in grid.iterrows():
            best = grid.loc[drafter].max()
            cells = [f"**{v:.2f}**" if v == best[b] else f"{v:.2f}" for b, v in row.items()]
            lines.append(f"| {drafter} | {k} | " + " | ".join(cells) + " |")
        lines += ["", "Best K per batch size (speedup, 95% CI over repeats):", "",
                  "| drafter | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for drafter, group in t["best_k"].groupby("drafter", sort=False):
            cells = [f"K={r.best_k}: {r.speedup:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]" for r in group.itertuples()]
            lines.append(f"| {drafter} | " + " | ".join(cells) + " |")
        lines += ["", "One K for every batch size instead of the best K at each (throughput lost; mean = geometric mean over "
                  "batch sizes):", "", "| drafter | best single K | mean loss | worst loss (at batch) |", "|---|---|---|---|"]
        for r in t["single_k"].itertuples():
            lines.append(f"| {r.drafter} | {r.best_single_k} | {r.mean_loss:.1%} | {r.worst_loss:.1%} (batch {r.worst_at_batch_size}) |")
        lines.append("")
    return "\n".join(lines)


def _num(value: float) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def report(out: Path, workloads: list[str], markdown_file: Path | None) -> None:
    tables, machine = {}, ""
    for workload in workloads:
        results = load_run(out / workload)
        if results.cells.empty:
            print(f"{out / workload}: no finished cells yet; run `python benchmarks/parallel_drafting.py run` first")
            continue
        hardware = results.manifest.get("hardware") or {}
        machine = ", ".join(f"{k} {v}" for k, v in hardware.items() if v not in ("", None) and not isinstance(v, dict | list)) or "unknown"
        tables[workload] = drafter_tables(results.cells, workload)
    text = markdown(tables, machine)
    print(text)
    if markdown_file is not None:
        markdown_file.write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "report"))
    parser.add_argument("--out", type=Path, default=REPO / "results" / "parallel-drafting")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--budget-s", type=float, default=840.0, help="run: stop after this many seconds (resume later)")
    parser.add_argument("--markdown", type=Path, default=None, help="report: also write the tables here")
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    if args.command == "run":
        done = run(args.out, workloads, args.budget_s)
        print("every cell done; now: python benchmarks/parallel_drafting.py report" if done else "not finished: run again")
    else:
        report(args.out, workloads, args.markdown)


if __name__ == "__main__":
    main()
