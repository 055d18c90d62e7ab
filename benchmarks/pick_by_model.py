"""The answer's pick per batch size, measured fastest vs the cost model's, scored on runs it was not taken from.

    python benchmarks/pick_by_model.py RUN RUN [RUN ...] [--guided GUIDED ...]

RUNs are sweeps of one plan at different times (every server launched again). Each run's recommendation
(spectune.analysis.recommendation_table) is taken twice: as measured (the server measured fastest at each batch size)
and as `spectune sweep` takes it, by the cost model fitted on every cell of that run (spectune.guided.expected_tps).
Each pick is scored by the mean output tokens/s of the other runs: gap = 1 - their tok/s of the pick / their best at
that batch size (0: the pick is what the other runs measured fastest). A GUIDED run (`spectune sweep PLAN --budget B`
of the same plan) is scored by the mean of all the RUNs.

Then the guided run against each full grid's recommendation (the model's pick, what `spectune sweep` answers): both
scored by the mean tok/s of the other RUNs, neither of which either pick was taken from, gap = 1 - their tok/s of the
guided pick / their tok/s of the grid's pick (below 0: the guided pick measured faster). The best by the scoring runs'
mean is the largest of many noisy means and sits above every pick; the grid's recommendation is scored as the guided
one is.

Last, how far that best sits above any measured pick: each batch size's fastest by the mean of k runs, scored by the
mean of the others (every split of the RUNs, k up to half of them). Where even a pick by several runs' mean lands 2-4%
below the best of the rest, that gap is launch noise, and a single run's pick (guided or not) cannot close it.
"""

from __future__ import annotations

import argparse
import itertools
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


def row(name: str, scored_by: str, run: Run, model: pd.DataFrame, truth: pd.Series) -> str:
    measured = picks(run, False)
    a, b = truth_gaps(measured, truth), truth_gaps(model, truth)
    differ = (measured.set_index("batch_size")["server"] != model.set_index("batch_size")["server"]).sum()
    return f"| {name} | {scored_by} | {a.mean():.2%} / {a.max():.2%} | {b.mean():.2%} / {b.max():.2%} | {differ} of {len(a)} |"


def split_gaps(means: dict[Path, pd.Series], k: int) -> pd.Series:
    """Per split of the runs into k and the rest: the mean gap over batch sizes of the fastest by the k runs' mean tok/s,
    scored by the rest's mean."""
    out = {}
    for chosen in itertools.combinations(means, k):
        picked = pd.concat([means[p] for p in chosen], axis=1).mean(axis=1)
        truth = pd.concat([means[p] for p in means if p not in chosen], axis=1).mean(axis=1)
        fastest = picked.groupby(level=0).idxmax().map(lambda key: key[1]).rename("server").reset_index()
        out[" + ".join(p.name for p in chosen)] = truth_gaps(fastest, truth).mean()
    return pd.Series(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--guided", type=Path, nargs="*", default=[])
    args = ap.parse_args()
    if len(args.runs) < 2:
        ap.error("give two runs of one plan or more: each is scored by the others")
    runs = {p: load_run(p) for p in args.runs}
    means = {p: mean_tps(r.cells) for p, r in runs.items()}
    others = {p: [o for o in runs if o != p] for p in runs}
    truth = {p: pd.concat([means[o] for o in others[p]], axis=1).mean(axis=1) for p in runs}  # a run scored by the rest
    guided = {path: load_run(path) for path in args.guided}
    model = {p: picks(r, True) for p, r in (runs | guided).items()}  # the model's pick: one fit a run
    print("| pick from | scored by (mean tok/s of) | measured fastest: mean / max gap | cost model's pick: mean / max gap | batch sizes where they differ |")
    print("|---|---|---|---|---|")
    for path, run in runs.items():
        print(row(path.name, ", ".join(p.name for p in others[path]), run, model[path], truth[path]))
    everything = pd.concat(list(means.values()), axis=1).mean(axis=1)
    for path, run in guided.items():
        print(row(f"{path.name} (guided)", ", ".join(p.name for p in runs), run, model[path], everything))
    if guided:
        print("\n| guided run | against the recommendation of | scored by (mean tok/s of) | gap to it: mean / max | batch sizes where the picks differ |")
        print("|---|---|---|---|---|")
    for path in guided:
        mine = model[path].set_index("batch_size")["server"]
        for grid in runs:
            theirs = model[grid].set_index("batch_size")["server"].reindex(mine.index)
            scored = truth[grid]
            gap = pd.Series({bs: 1.0 - scored.get((bs, mine[bs]), float("nan")) / scored.get((bs, theirs[bs]), float("nan"))
                             for bs in mine.index})
            print(f"| {path.name} | {grid.name} | {', '.join(p.name for p in others[grid])} | {gap.mean():.2%} / {gap.max():.2%} | "
                  f"{int((mine != theirs).sum())} of {len(mine)} |")
    print("\n| fastest by the mean of | scored by the mean of | splits | gap to the best of the rest: mean (min, max over splits) |")
    print("|---|---|---|---|")
    for k in range(1, len(runs) // 2 + 1):
        gaps = split_gaps(means, k)
        print(f"| {k} run{'s' * (k > 1)} | the other {len(runs) - k} | {len(gaps)} | {gaps.mean():.2%} ({gaps.min():.2%}, {gaps.max():.2%}) |")


if __name__ == "__main__":
    main()
