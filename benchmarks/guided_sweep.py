"""Guided sweep vs the full grid (issue 12), and the cost model's held-out error.

    python benchmarks/guided_sweep.py GRID_RESULTS [--guided GUIDED_RESULTS ...] [--seeds 0-9] [--budget 0.25]
        [--truth GRID_RESULTS GRID_RESULTS ...]

GRID_RESULTS is a full sweep of a plan (e.g. configs/predict-grid.toml). For each seed the guided loop
(spectune.guided.guide) is replayed on the grid: "measuring" a cell selects the grid's already-measured rows for it,
so every seed costs nothing but the fits. Each --guided directory is a real `spectune sweep PLAN --budget B` run: its
cells and wall time are its own, its pick per batch size is scored by the grid's measurement of that cell.

Gap: per batch size, 1 - grid tok/s of the guided pick / grid tok/s of the grid's best cell (0 = same cell or a tie).
A pick is the measured cell the cost model, fitted on every cell the run measured, expects fastest (as `spectune
sweep` answers since 6 December 2026: spectune.guided.expected_tps); the grid's best is the cell it measured fastest.
Where the budget ran out, the cells the sweep named as expected faster (not measured) are counted, with how many of
them the grid measured faster than the pick, and the gap had they been taken.

--truth: several full grids of the same plan, measured at other times. Picks are then also scored by the mean of
those grids (what a cell gives on this host, not what one launch of it measured), and two more tables say how far
measurement noise alone takes a pick: each grid's own picks scored by the mean of the others, and, per seed, the
full grid and the guided loop replayed with each cell's rows drawn from one of the grids at random (a cell measured
in a launch of its own at another moment, as a real guided sweep's rounds are), both scored by the mean of all.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectune.costmodel import parse_gammas  # noqa: E402
from spectune.drain import request_speeds  # noqa: E402
from spectune.guided import best_measured, expected_tps, guide, plan_grid  # noqa: E402
from spectune.plan import plan_from_dict  # noqa: E402
from spectune.store import load_run  # noqa: E402


def gaps(picks: pd.DataFrame, grid_cells: pd.DataFrame) -> pd.Series:
    """Per batch size: 1 - grid tok/s of the picked server / the grid's best."""
    return truth_gaps(picks, mean_tps(grid_cells))


def mean_tps(cells: pd.DataFrame) -> pd.Series:
    """Mean output tokens/s per (batch size, server) over a run's successful cells."""
    return cells[cells["status"] == "ok"].groupby(["batch_size", "server"])["output_throughput_tps"].mean()


def model_picks(cells: pd.DataFrame, speeds) -> pd.DataFrame:
    """The picks `spectune sweep` answers with: per batch size, the measured cell the cost model fitted on every cell
    expects fastest."""
    return best_measured(cells, expected_tps(cells, speeds))


def truth_gaps(picks: pd.DataFrame, truth: pd.Series) -> pd.Series:
    """gaps() against a (batch size, server) -> tok/s series, e.g. the mean of several grids."""
    best = truth.groupby(level=0).max()
    got = pd.Series({int(r.batch_size): truth.get((r.batch_size, r.server), float("nan")) for r in picks.itertuples()})
    return 1.0 - got / best.reindex(got.index)


def taken_picks(recommendation: pd.DataFrame, expected_better: pd.DataFrame) -> pd.DataFrame:
    """The measured picks with the guided sweep's expected-better cells (not measured) in their place."""
    picks = recommendation.set_index("batch_size")["server"].copy()
    picks.update(expected_better.set_index("batch_size")["server"])
    return picks.rename("server").reset_index()


def noise_table(runs: list, truth: pd.Series, grid: pd.DataFrame, seeds: list[int], budget: float) -> pd.DataFrame:
    """Per seed: the full grid and the guided loop on cells drawn at random from the runs (one run per (server,
    batch size), all repeats from it), picks scored by `truth` (the mean of all the runs)."""
    speeds = [request_speeds(r.requests) for r in runs]
    rows = []
    for seed in seeds:
        rng = np.random.default_rng(1000 + seed)
        source = {(s, int(b)): int(rng.integers(len(runs))) for s, b in grid[["server", "batch_size"]].itertuples(index=False)}

        def rows_of(pairs):
            drawn, drawn_speeds = [], {}
            for server, bs in pairs:
                k = source[(server, bs)]
                cells = runs[k].cells[(runs[k].cells["server"] == server) & (runs[k].cells["batch_size"] == bs)]
                drawn.append(cells)
                drawn_speeds |= {c: speeds[k][c] for c in cells["cell"] if c in speeds[k]}
            return pd.concat(drawn, ignore_index=True), drawn_speeds

        full = truth_gaps(model_picks(*rows_of(list(source))), truth)
        chosen: list[tuple[str, int]] = []

        def measure(pairs):
            chosen.extend(pairs)
            return rows_of(chosen)

        guided = truth_gaps(guide(grid, measure, budget, seed, log=lambda _: None).recommendation, truth)
        rows.append({"seed": seed, "grid_mean_gap": full.mean(), "grid_max_gap": full.max(),
                     "guided_mean_gap": guided.mean(), "guided_max_gap": guided.max(), "guided_cells": len(chosen)})
    return pd.DataFrame(rows)


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
    ap.add_argument("--truth", type=Path, nargs="*", default=[], help="full grids of the same plan at other times (GRID "
                    "included or not): also score by their mean, and replay with each cell drawn from one of them")
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
        better = result.expected_better
        taken = gaps(taken_picks(result.recommendation, better), cells)
        truth = mean_tps(cells)
        faster = sum(truth.get((r.batch_size, r.server), 0.0) > truth.get((r.batch_size, r.best_server), 0.0) for r in better.itertuples())
        rows.append({"run": f"replay seed {seed}", "cells": len(result.measured), "share": len(result.measured) / len(grid),
                     "stopped": result.stopped, "rounds": result.rounds, "mean_gap": g.mean(), "max_gap": g.max(), "wall_s": None,
                     "expected": len(better), "faster": faster, "taken_gap": taken.mean()})
    for path in args.guided:
        real = load_run(path)
        info = real.manifest.get("guided", {})
        picks = model_picks(real.cells, request_speeds(real.requests))
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
    print(f"expected better, not measured (the budget ran out): {replay['expected'].sum()} cells over the seeds, "
          f"{replay['faster'].sum()} of them faster than the pick in the grid; mean gap with them taken {replay['taken_gap'].mean():.2%}")
    if not args.truth:
        return
    grids = {args.grid: run} | {p: load_run(p) for p in args.truth if p != args.grid}
    means = {p: mean_tps(r.cells) for p, r in grids.items()}
    truth = pd.concat(means.values(), axis=1).mean(axis=1)
    print(f"\nscored by the mean of {len(grids)} grids ({', '.join(p.name for p in grids)}): mean gap / max gap")
    for path, r in grids.items():
        others = pd.concat([m for p, m in means.items() if p != path], axis=1).mean(axis=1)
        g = truth_gaps(model_picks(r.cells, request_speeds(r.requests)), others)
        print(f"| grid {path.name}, its picks scored by the mean of the others | {g.mean():.2%} | {g.max():.2%} |")
    for path in args.guided:
        real = load_run(path)
        g = truth_gaps(model_picks(real.cells, request_speeds(real.requests)), truth)
        print(f"| measured {path.name} | {g.mean():.2%} | {g.max():.2%} |")
    noisy = noise_table(list(grids.values()), truth, grid, parse_gammas(args.seeds), args.budget)
    print(f"\neach cell drawn from one of the {len(grids)} grids at random, per seed, scored by their mean:")
    print(f"| full grid | mean gap {noisy['grid_mean_gap'].mean():.2%} ({noisy['grid_mean_gap'].min():.2%}-{noisy['grid_mean_gap'].max():.2%} by seed) "
          f"| worst max gap {noisy['grid_max_gap'].max():.2%} |")
    print(f"| guided, budget {args.budget:g} | mean gap {noisy['guided_mean_gap'].mean():.2%} ({noisy['guided_mean_gap'].min():.2%}-"
          f"{noisy['guided_mean_gap'].max():.2%}) | worst max gap {noisy['guided_max_gap'].max():.2%} | cells {noisy['guided_cells'].min()}-"
          f"{noisy['guided_cells'].max()} |")


if __name__ == "__main__":
    main()
