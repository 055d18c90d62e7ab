"""Guided sweep vs the full grid (issue 12), and the cost model's held-out error.

    python benchmarks/guided_sweep.py GRID_RESULTS [--guided GUIDED_RESULTS ...] [--seeds 0-9] [--budget 0.25]

GRID_RESULTS is a full sweep of a plan (e.g. configs/predict-grid.toml). For each seed the guided loop
(spectune.guided.guide) is replayed on the grid: "measuring" a cell selects the grid's already-measured rows for it,
so every seed costs nothing but the fits. Each --guided directory is a real `spectune sweep PLAN --budget B` run: its
cells and wall time are its own, its pick per batch size is scored by the grid's measurement of that cell.

Gap: per batch size, 1 - grid tok/s of the guided pick / grid tok/s of the grid's best cell (0 = same cell or a tie).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectune.costmodel import parse_gammas  # noqa: E402
from spectune.drain import request_speeds  # noqa: E402
from spectune.guided import best_measured, guide, plan_grid  # noqa: E402
from spectune.plan import plan_from_dict  # noqa: E402
from spectune.store import load_run  # noqa: E402


def gaps(picks: pd.DataFrame, grid_cells: pd.DataFrame) -> pd.Series:
    """Per batch size: 1 - grid tok/s of the picked server / the grid's best."""
    mean = grid_cells[grid_cells["status"] == "ok"].groupby(["batch_size", "server"])["output_throughput_tps"].mean()
    best = mean.groupby(level=0).max()
    picked = pd.Series({int(r.batch_size): mean.get((r.batch_size, r.server), float("nan")) for r in picks.itertuples()})
    return 1.0 - picked / best.reindex(picked.index)


def sweep_seconds(manifest: dict) -> float:
    start = dt.datetime.fromisoformat(manifest["started_at"])
    end = dt.datetime.fromisoformat(manifest.get("finished_at") or manifest["updated_at"])
    return (end - start).total_seconds()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid", type=Path)
    ap.add_argument("--guided", type=Path, nargs="*", default=[])
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--grid-seconds", type=float, help="the grid's measuring wall time, where run.json's span includes a resume")
    ap.add_argument("--without-drain", action="store_true", help="replay with the model before spectune.drain (no requests' speeds)")
    args = ap.parse_args()

    run = load_run(args.grid)
    plan = plan_from_dict(run.manifest["plan"], source=str(args.grid / "run.json"))
    grid = plan_grid(plan)
    cells = run.cells
    speeds = {} if args.without_drain else request_speeds(run.requests)
    grid_s = args.grid_seconds or sweep_seconds(run.manifest)
    print(f"grid: {len(grid)} (server, batch size) cells x {plan.repeats} repeats, {grid_s:.0f} s wall")

    rows = []
    for seed in parse_gammas(args.seeds):
        chosen: set[tuple[str, int]] = set()

        def measure(pairs):
            chosen.update(pairs)
            keep = cells.apply(lambda r: (r["server"], int(r["batch_size"])) in chosen, axis=1)
            return cells[keep], {c: speeds[c] for c in cells[keep]["cell"] if c in speeds}

        result = guide(grid, measure, args.budget, seed, log=lambda _: None)
        g = gaps(result.recommendation, cells)
        rows.append({"run": f"replay seed {seed}", "cells": len(result.measured), "share": len(result.measured) / len(grid),
                     "stopped": result.stopped, "rounds": result.rounds, "mean_gap": g.mean(), "max_gap": g.max(), "wall_s": None})
    for path in args.guided:
        real = load_run(path)
        info = real.manifest.get("guided", {})
        picks = best_measured(real.cells)
        g = gaps(picks, cells)
        rows.append({"run": f"measured {path.name}", "cells": len(info.get("measured", [])),
                     "share": len(info.get("measured", [])) / len(grid), "stopped": info.get("stopped"), "rounds": info.get("rounds"),
                     "mean_gap": g.mean(), "max_gap": g.max(), "wall_s": sweep_seconds(real.manifest)})
    table = pd.DataFrame(rows)
    print("| run | cells (of %d) | share | stopped | guided rounds | mean gap | max gap | wall (s) |" % len(grid))
    print("|---|---|---|---|---|---|---|---|")
    for r in table.itertuples():
        wall = f"{r.wall_s:.0f} ({r.wall_s / grid_s:.0%} of grid)" if pd.notna(r.wall_s) else "—"
        print(f"| {r.run} | {r.cells} | {r.share:.0%} | {r.stopped} | {r.rounds} | {r.mean_gap:.2%} | {r.max_gap:.2%} | {wall} |")
    replay = table[table["run"].str.startswith("replay")]
    print(f"replays: {len(replay)} seeds, cells {replay['cells'].min()}-{replay['cells'].max()}, mean gap {replay['mean_gap'].mean():.2%}, "
          f"worst max gap {replay['max_gap'].max():.2%}")


if __name__ == "__main__":
    main()
