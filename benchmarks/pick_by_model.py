"""The answer's pick per batch size, measured fastest vs the cost model's, scored on runs it was not taken from.

    python benchmarks/pick_by_model.py RUN RUN [RUN ...] [--guided GUIDED ...]

RUNs are sweeps of one plan at different times (every server launched again). Each run's recommendation
(spectune.analysis.recommendation_table) is taken twice: as measured (the server measured fastest at each batch size)
and as `spectune sweep` takes it, by the cost model fitted on every cell of that run (spectune.guided.expected_tps).
Each pick is scored by the mean output tokens/s of the other runs: gap = 1 - their tok/s of the pick / their best at
that batch size (0: the pick is what the other runs measured fastest). A GUIDED run (`spectune sweep PLAN --budget B`
of the same plan) is scored by the mean of all the RUNs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectune.analysis import recommendation_table  # noqa: E402
from spectune.drain import request_speeds  # noqa: E402
from spectune.guided import expected_tps  # noqa: E402
from spectune.store import Run, first_target, load_run  # noqa: E402
from guided_sweep import mean_tps, truth_gaps  # noqa: E402  (beside this script)


def picks(run: Run, by_model: bool) -> pd.DataFrame:
    expected = expected_tps(run.cells, request_speeds(run.requests)) if by_model else None
    limit = run.manifest.get("plan", {}).get("max_failure_rate", 0.05)
    return recommendation_table(run.cells, limit, first_target(run.manifest, run.cells), expected)[["batch_size", "server"]]


def row(name: str, scored_by: str, run: Run, truth: pd.Series) -> str:
    measured, model = picks(run, False), picks(run, True)
    a, b = truth_gaps(measured, truth), truth_gaps(model, truth)
    differ = (measured.set_index("batch_size")["server"] != model.set_index("batch_size")["server"]).sum()
    return f"| {name} | {scored_by} | {a.mean():.2%} / {a.max():.2%} | {b.mean():.2%} / {b.max():.2%} | {differ} of {len(a)} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--guided", type=Path, nargs="*", default=[])
    args = ap.parse_args()
    if len(args.runs) < 2:
        ap.error("give two runs of one plan or more: each is scored by the others")
    runs = {p: load_run(p) for p in args.runs}
    means = {p: mean_tps(r.cells) for p, r in runs.items()}
    print("| pick from | scored by (mean tok/s of) | measured fastest: mean / max gap | cost model's pick: mean / max gap | batch sizes where they differ |")
    print("|---|---|---|---|---|")
    for path, run in runs.items():
        others = [p for p in runs if p != path]
        truth = pd.concat([means[p] for p in others], axis=1).mean(axis=1)
        print(row(path.name, ", ".join(p.name for p in others), run, truth))
    everything = pd.concat(list(means.values()), axis=1).mean(axis=1)
    for path in args.guided:
        print(row(f"{path.name} (guided)", ", ".join(p.name for p in runs), load_run(path), everything))


if __name__ == "__main__":
    main()
