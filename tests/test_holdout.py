"""Out-of-sample accuracy (spectune.holdout) and the model terms it checks, on SYNTHETIC cells from a known model."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from spectune.costmodel import JOINT_TERMS_LABEL, AcceptanceProfile, RoundCost, fit_sweep, recommend, server_factors
from spectune.holdout import NONE_INSIDE, holdout_lines, holdout_predictions, holdout_report, holdout_summary, noise_floor, one_launch
from synthetic_sweep import SHARE_COST as SHARE, SYNTHETIC_PROFILES, synthetic_cells


def test_exact_cells_are_predicted_exactly_out_of_sample():
    cells = synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)
    predictions = holdout_predictions(cells)
    assert set(predictions["holdout"]) == {"step_count", "batch_size"}
    # every static cell is held out once per way; the smallest and largest batch size are extrapolated
    assert len(predictions) == 2 * 6 * 5
    for metric in ("throughput", "speedup"):
        assert predictions[f"{metric}_abs_pct_error"].max() < 3.0, predictions.sort_values(f"{metric}_abs_pct_error").tail()


def test_noise_shows_in_the_held_out_error_and_the_summary_has_every_metric():
    cells = synthetic_cells(profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=2, noise=0.05, seed=2)
    summary = holdout_summary(holdout_predictions(cells))
    both = summary[summary["method"] == "all"].set_index("holdout")
    assert set(both.index) == {"step_count", "batch_size", "step_count_inside", "batch_size_inside"}
    assert (both["throughput_mean_abs_pct"] > 0.5).all()  # 5% noise per cell cannot be predicted away
    assert (both["throughput_max_abs_pct"] >= both["throughput_mean_abs_pct"]).all()
    lines = holdout_lines(holdout_report(cells))
    assert len(lines) == 6 and all("tpot" in line and "speedup" in line for line in lines[:4])
    assert "leave one batch size out, inside the measured range" in lines[1]
    assert lines[4].startswith("anchor: target-only's ms per token")  # six batch sizes: smoothed, and said so


def test_noise_floor_is_the_error_of_a_cells_mean_half_the_gap_of_two_repeats_and_is_printed_beside_the_held_out_error():
    cells = synthetic_cells(profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=2, noise=0.05, seed=2)
    spec = cells[cells["is_speculative"].astype(bool)]
    cell = spec.groupby(["server", "batch_size"])["output_throughput_tps"]
    expected = float((100 * (cell.max() - cell.min()) / (cell.max() + cell.min())).mean())
    assert noise_floor(cells) == pytest.approx(expected) and 0.5 < expected < 10  # 5% noise per cell
    lines = holdout_lines(holdout_report(cells))
    assert lines[-1].startswith(f"noise floor: {expected:.1f}%")
    once = synthetic_cells(profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.05, seed=2)
    assert noise_floor(once) is None
    assert holdout_lines(holdout_report(once))[-1].startswith("noise floor: not known")
    # more repeats of the same 5% noise: the mean is known better, and the floor is the expected error of a 4-repeat mean
    four = noise_floor(synthetic_cells(profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=4, noise=0.05, seed=2))
    assert four < expected and four == pytest.approx(100 * np.sqrt(2 / np.pi) * 0.05 / 2, rel=0.2)
    # a tuning.json written before the noise floor was reported prints the held-out lines only
    old = {k: v for k, v in holdout_report(cells).items() if not k.startswith("noise_floor")}
    assert not any(line.startswith("noise floor") for line in holdout_lines(old))


def test_noise_floor_says_when_every_repeat_ran_on_one_launch_of_its_server():
    """A launch's own speed is shared by all its repeats, so their spread leaves it out: said where the cells'
    server_pid show one launch per server, not where each repeat had its own (relaunch = true) or none is recorded."""
    cells = synthetic_cells(profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=2, noise=0.05, seed=2)
    servers = {name: 1000 + i for i, name in enumerate(sorted(cells["server"].unique()))}
    one = cells.assign(server_pid=cells["server"].map(servers))
    fresh = cells.assign(server_pid=cells["server"].map(servers) * 10 + cells["repeat"])
    assert one_launch(one) is True and one_launch(fresh) is False and one_launch(cells) is None
    assert "relaunch = true" in holdout_lines(holdout_report(one))[-1]
    for other in (fresh, cells):
        line = holdout_lines(holdout_report(other))[-1]
        assert line.startswith("noise floor:") and "relaunch" not in line


def test_the_held_out_values_inside_the_measured_range_are_summarised_apart_from_the_extrapolated_ends():
    cells = synthetic_cells(profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=2, noise=0.05, seed=3)
    predictions = holdout_predictions(cells)
    by_bs = predictions[predictions["holdout"] == "batch_size"]
    assert set(by_bs.loc[by_bs["extrapolated"], "batch_size"]) == {int(cells["batch_size"].min()), int(cells["batch_size"].max())}
    summary = holdout_summary(predictions).set_index(["holdout", "method"])
    for holdout in ("batch_size", "step_count"):
        inside = predictions[(predictions["holdout"] == holdout) & ~predictions["extrapolated"]]
        row = summary.loc[(f"{holdout}_inside", "all")]
        assert 0 < row["cells"] == len(inside) < summary.loc[(holdout, "all"), "cells"]
        assert row["throughput_mean_abs_pct"] == pytest.approx(inside["throughput_abs_pct_error"].mean())
        assert row["speedup_max_abs_pct"] == pytest.approx(inside["speedup_abs_pct_error"].max())
    assert not any(h.endswith("_inside") for h, m in summary.index if m != "all")  # the split is over all methods only


def test_held_out_error_is_reported_as_not_computed_with_one_step_count():
    cells = synthetic_cells(steps=(2,), profiles={"quote": SYNTHETIC_PROFILES["quote"]})
    cells = cells[cells["batch_size"] == 4]
    lines = holdout_lines(holdout_report(cells))
    assert lines[0].startswith("held-out error, leave one step count out: not computed (no method measured at two step counts")
    assert lines[1].startswith("held-out error, leave one batch size out: not computed (no method measured at three batch sizes")


def test_a_guided_sweeps_seeds_are_held_out_only_where_the_fit_keeps_what_predicts_them():
    # the seeds of a guided sweep: two step counts at the smallest batch size, the lower one again at the largest
    cells = synthetic_cells(steps=(1, 2, 3), profiles={"quote": SYNTHETIC_PROFILES["quote"]})
    spec = cells["is_speculative"].astype(bool)
    seeds = ((cells["batch_size"] == 1) & cells["num_speculative_tokens"].isin([1, 3])) | ((cells["batch_size"] == 16) & (cells["num_speculative_tokens"] == 1))
    cells = cells[~spec | seeds]
    held = holdout_predictions(cells)
    # two batch sizes: leaving one out would carry batch 16's draft terms to batch 1 (or back); not held out that way
    assert "batch_size" not in set(held["holdout"])
    # g = 1 held out keeps g = 3 at batch 1 but nothing at batch 16: only its batch-1 cell is a step count held out
    by_g = held[held["holdout"] == "step_count"]
    assert sorted(zip(by_g["g"], by_g["batch_size"])) == [(1, 1), (3, 1)]
    lines = holdout_lines(holdout_report(cells))
    assert lines[0].startswith("held-out error, leave one batch size out: not computed")
    assert any(line.startswith("held-out error, leave one step count out (2 cells)") for line in lines)
    # a third batch size measured: leave one batch size out is computed again
    full = synthetic_cells(steps=(1, 2, 3), profiles={"quote": SYNTHETIC_PROFILES["quote"]})
    third = full[full["is_speculative"].astype(bool) & (full["batch_size"] == 4) & (full["num_speculative_tokens"] == 1)]
    assert "batch_size" in set(holdout_predictions(pd.concat([cells, third], ignore_index=True))["holdout"])


def test_acceptance_interval_widens_with_spread_and_brackets_the_speedup():
    cells = synthetic_cells(profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=3, noise=0.03, seed=5)
    rng = np.random.default_rng(0)
    for col in [c for c in cells if c.startswith("accept_pos_")]:  # counted acceptance varies from cell to cell
        cells[col] = (cells[col] * (1 + 0.03 * rng.standard_normal(len(cells)))).clip(0, 1)
    fit = fit_sweep(cells)
    assert fit.pooled.survival_se and all(se > 0 for se in fit.pooled.survival_se[:4])
    low, high = fit.pooled.expected_tokens_interval(4)
    assert low < fit.pooled.expected_tokens(4) < high
    rec = recommend(fit)
    assert (rec["speedup_low"] <= rec["speedup"]).all() and (rec["speedup"] <= rec["speedup_high"]).all()
    assert AcceptanceProfile((0.8,)).expected_tokens_interval(3) == pytest.approx((AcceptanceProfile((0.8,)).expected_tokens(3),) * 2)


def test_round_cost_extrapolates_batch_size_along_the_nearest_line():
    cost = RoundCost(batch_sizes=(4, 8), target_ms=(5.0, 7.0), draft_fixed_ms=(1.0, 2.0), per_step_ms=(0.5, 1.0))
    assert cost.t_round(16, 0) == pytest.approx(11.0)  # 7 + (7 - 5) / 4 * 8
    assert cost.t_round(1, 2) == pytest.approx(3.5 + 0.25 + 0.125 * 2)
    assert cost.t_round(0.01, 1) >= 0.0


def test_draft_terms_are_overheads_and_shares_of_target_only_fitted_over_batch_sizes_when_the_cells_allow_it():
    cells = synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=2, noise=0.03, seed=4)
    fit = fit_sweep(cells)
    assert (fit.table["draft_terms"] == JOINT_TERMS_LABEL).all()
    table = fit.table.set_index("batch_size")
    assert table["per_step_ms"].to_numpy() == pytest.approx(SHARE.per_step_ms, rel=0.1, abs=0.05)
    for g in (1, 4, 8):
        assert fit.cost.t_round(np.array(SHARE.batch_sizes), g) == pytest.approx(SHARE.t_round(np.array(SHARE.batch_sizes), g), rel=0.05)
    # a cost far from that form (SYNTHETIC_COST's per-step share grows 0.12 -> 0.45, convex in log batch size) keeps
    # one line in g per batch size
    assert "draft_terms" not in fit_sweep(synthetic_cells(noise=0.01, seed=1)).table


def test_each_workload_is_predicted_with_its_own_acceptance():
    cells = synthetic_cells(repeats=1, noise=0.01, seed=6)  # "quote" easy to draft, "random" hard: pooled would miss both
    predictions = holdout_predictions(cells)
    assert set(predictions["workload"]) == {"quote", "random"}
    assert predictions["throughput_abs_pct_error"].mean() < 5.0


def _paying_per_request(cells, cost: RoundCost, request_ms: dict[int, float], tokens_per_request: int = 32):
    """SYNTHETIC: the cells as a closed loop measures them when each slot pays request_ms[bs] per output token once per
    request (its wait for a prefill, the client's turnaround) and rounds cost cost.t_round(bs, g) - request_ms[bs]:
    ms per token = (t_round - h) / E + h, TTFT + (N - 1) TPOT = N x ms per token."""
    cells = cells.copy()
    h = cells["batch_size"].map(request_ms).to_numpy(float)
    tokens = cells["acceptance_length"].where(cells["is_speculative"], 1.0).to_numpy(float)
    t = np.array([cost.t_round(b, g) for b, g in zip(cells["batch_size"], cells["num_speculative_tokens"])])
    ms = (t - h) / tokens + h
    n = tokens_per_request
    cells["output_throughput_tps"] = 1000.0 * cells["batch_size"] / ms
    cells["output_tokens_total"] = cells["num_requests"] * n
    cells["tpot_ms_mean"] = (ms - h) * n / (n - 1)
    cells["itl_ms_mean"] = cells["tpot_ms_mean"] * tokens
    return cells


def test_a_per_request_cost_is_paid_once_per_token_not_once_per_round():
    request_ms = {1: 0.8, 2: 1.0, 4: 1.4, 8: 2.2, 16: 3.8}  # about a third of SHARE's target_ms
    cells = _paying_per_request(synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0),
                                SHARE, request_ms)
    fit = fit_sweep(cells)
    assert fit.cost.request_ms == pytest.approx(tuple(request_ms.values()))
    held = holdout_predictions(cells)
    by_g = held[held["holdout"] == "step_count"]
    assert by_g["throughput_abs_pct_error"].max() < 1.0, by_g.sort_values("throughput_abs_pct_error").tail()
    # Without the cells' TTFT/TPOT split (no output token counts) the term is unknown and every ms counts per round:
    # the line in g through the other step counts misses g = 1, where tokens per round are fewest.
    blind = holdout_predictions(cells.drop(columns="output_tokens_total"))
    blind = blind[(blind["holdout"] == "step_count") & (blind["g"] == 1)]
    assert blind["throughput_abs_pct_error"].mean() > 3.0


def test_acceptance_that_falls_with_the_step_count_is_predicted_at_a_held_out_one():
    # SYNTHETIC: a round at step count g accepts each position with S_i x (1 - 0.02 (g - 4)), as correlated acceptance
    # makes it (rounds at large g start after a rejection more often)
    falling = AcceptanceProfile(SYNTHETIC_PROFILES["quote"].rates, trend=-0.02, trend_ref_g=4.0)
    cells = synthetic_cells(cost=SHARE, profiles={"quote": falling}, repeats=1, noise=0.0)
    fit = fit_sweep(cells)
    assert fit.pooled.trend == pytest.approx(-0.02, rel=0.1)
    for g in (1, 4, 8):
        assert fit.pooled.expected_tokens(g) == pytest.approx(falling.expected_tokens(g), rel=0.01)
    held = holdout_predictions(cells)
    by_g = held[held["holdout"] == "step_count"]
    assert by_g["throughput_abs_pct_error"].max() < 2.0, by_g.sort_values("throughput_abs_pct_error").tail()
    # acceptance constant in g fits no trend
    assert fit_sweep(synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)).pooled.trend == pytest.approx(0.0, abs=1e-9)


def test_each_batch_size_is_predicted_with_the_acceptance_of_its_own_traffic():
    # SYNTHETIC: batch size 16 sends other prompts, which draft worse
    cells = synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)
    harder = AcceptanceProfile(tuple(0.8 * r for r in SYNTHETIC_PROFILES["quote"].rates))
    at16 = synthetic_cells(cost=SHARE, profiles={"quote": harder}, repeats=1, noise=0.0)
    cells = pd.concat([cells[cells["batch_size"] != 16], at16[at16["batch_size"] == 16]], ignore_index=True)
    fit = fit_sweep(cells)
    assert fit.profile("quote", 16).expected_tokens(4) == pytest.approx(harder.expected_tokens(4), rel=0.01)
    assert fit.profile("quote", 4).expected_tokens(4) == pytest.approx(SYNTHETIC_PROFILES["quote"].expected_tokens(4), rel=0.01)
    assert fit.profile("quote").expected_tokens(4) < fit.profile("quote", 4).expected_tokens(4)  # pooled over both
    held = holdout_predictions(cells)
    assert held[held["holdout"] == "step_count"]["throughput_abs_pct_error"].max() < 1.0


def test_a_batch_size_without_speculative_cells_takes_the_acceptance_of_its_measured_neighbours():
    # SYNTHETIC: batch sizes 1 and 2 send the same few prompts (a closed loop's min_prompts), which draft better than
    # the larger batch sizes' prompts
    easy = SYNTHETIC_PROFILES["quote"]
    harder = AcceptanceProfile(tuple(0.8 * r for r in easy.rates))
    small = synthetic_cells(cost=SHARE, profiles={"quote": easy}, repeats=1, noise=0.0)
    large = synthetic_cells(cost=SHARE, profiles={"quote": harder}, repeats=1, noise=0.0)
    cells = pd.concat([small[small["batch_size"] <= 2], large[large["batch_size"] > 2]], ignore_index=True)
    spec = cells["is_speculative"].astype(bool)
    without_1 = fit_sweep(cells[~(spec & (cells["batch_size"] == 1))])
    assert without_1.profile("quote", 1).expected_tokens(4) == pytest.approx(easy.expected_tokens(4), rel=1e-6)
    without_4 = fit_sweep(cells[~(spec & (cells["batch_size"] == 4))])  # halfway between 2 and 8 in log batch size
    assert without_4.profile("quote", 4).expected_tokens(4) == pytest.approx(
        (easy.expected_tokens(4) + harder.expected_tokens(4)) / 2, rel=1e-6)
    assert without_1.profile("quote").expected_tokens(4) < 0.9 * easy.expected_tokens(4)  # the workload's: mostly harder prompts
    held = holdout_predictions(cells)
    by_bs = held[(held["holdout"] == "batch_size") & (held["batch_size"] == 1)]
    assert len(by_bs) == 6 and by_bs["throughput_abs_pct_error"].max() < 1.0, by_bs  # with the whole workload's: 34% off


def test_a_server_that_ran_slow_at_every_batch_size_is_predicted_slow_where_held_out():
    # SYNTHETIC: the g = 3 server ran 20% slower at every batch size (launched while the machine was slower)
    cells = synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)
    slow = cells["server"] == "draft-g3-quote"
    cells.loc[slow, "output_throughput_tps"] /= 1.2
    cells.loc[slow, "tpot_ms_mean"] *= 1.2
    fit = fit_sweep(cells)
    factors = server_factors(fit, cells)
    assert factors["draft-g3-quote"] > 1.1 and factors.drop("draft-g3-quote").between(0.95, 1.05).all()
    held = holdout_predictions(cells)
    by_bs = held[(held["holdout"] == "batch_size") & (held["server"] == "draft-g3-quote")]
    assert by_bs["throughput_abs_pct_error"].max() < 5.0  # 20% without its factor
    by_g = held[(held["holdout"] == "step_count") & (held["server"] == "draft-g3-quote")]
    assert by_g["throughput_abs_pct_error"].min() > 10.0  # a held-out server has no factor: its slowness is unknowable


def test_tpot_share_of_a_held_out_batch_size_is_interpolated_in_log_batch_size():
    """Batch sizes go in powers of two; a decode share falling by the same step per doubling is predicted exactly
    between measured ones (interpolating in batch size itself would put batch 4 a third of the way from 2 to 8)."""
    from spectune.costmodel import ms_per_token

    cells = synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)
    spec = cells["is_speculative"].astype(bool)
    share = 0.95 - 0.15 * np.log2(cells["batch_size"].astype(float))
    cells.loc[spec, "tpot_ms_mean"] = ms_per_token(cells)[spec] * share[spec]
    held = holdout_predictions(cells)
    inside = held[(held["holdout"] == "batch_size") & held["batch_size"].isin([2, 4, 8])]
    assert set(inside["batch_size"]) == {2, 4, 8}
    ms_error = 100 * (inside["measured_throughput"] / inside["predicted_throughput"] - 1).abs()  # predicted ms / measured ms
    assert (inside["tpot_abs_pct_error"] - ms_error).abs().max() < 0.5


def _slowed_target_at(cells: pd.DataFrame, batch_size: int, factor: float) -> pd.DataFrame:
    """SYNTHETIC cells with target-only's cell at one batch size `factor` slower, the speculative cells there not."""
    hit = (cells["batch_size"] == batch_size) & ~cells["is_speculative"].astype(bool)
    return cells.assign(output_throughput_tps=cells["output_throughput_tps"].where(~hit, cells["output_throughput_tps"] / factor),
                        tpot_ms_mean=cells["tpot_ms_mean"].where(~hit, cells["tpot_ms_mean"] * factor))


def _batch_size_errors(cells: pd.DataFrame) -> pd.Series:
    p = holdout_predictions(cells)
    return p[p["holdout"] == "batch_size"].groupby("batch_size")["throughput_abs_pct_error"].mean()


def test_a_slow_target_only_cell_is_smoothed_away_from_the_anchor(monkeypatch):
    """Every prediction at a batch size is anchored on target-only's ms per token there. Its cell at one batch size is one
    closed loop whose noise the speculative cells there do not share (side by side too: benchmarks/README.md); as
    measured, a slow target-only cell at batch 4 would carry into every prediction at 4 (and the opposite into 2 and 8,
    whose draft terms are fitted against it). Smoothed over batch sizes it is gone."""
    import spectune.holdout as holdout

    cells = synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)
    slow = _slowed_target_at(cells, 4, 1.15)
    smoothed = _batch_size_errors(slow)
    with monkeypatch.context() as m:  # the anchor as measured, for the comparison: no smoothing
        m.setattr(holdout, "smoothed_target", lambda cells: None)
        as_measured = _batch_size_errors(slow)
    assert as_measured[4] > 5 and as_measured[[2, 8]].min() > 2.5, as_measured  # and the opposite sign at 2 and 8
    assert smoothed.max() < 2.5 and smoothed.mean() < as_measured.mean() / 3, smoothed
    # tuning.json and the console say the anchor was smoothed; with fewer than four batch sizes there is nothing to smooth
    assert holdout_report(slow)["anchor_smoothed"] is True
    assert any(line.startswith("anchor: target-only's ms per token") for line in holdout_lines(holdout_report(slow)))
    three = slow[slow["batch_size"].isin([1, 2, 4])]
    assert holdout_report(three)["anchor_smoothed"] is False
    assert not any(line.startswith("anchor:") for line in holdout_lines(holdout_report(three)))
    # the measured speedup stays over target-only as measured: the slow anchor makes every cell at 4 look faster
    p = holdout_predictions(slow)
    at4 = p[(p["holdout"] == "batch_size") & (p["batch_size"] == 4)]
    clean = holdout_predictions(cells)
    clean4 = clean[(clean["holdout"] == "batch_size") & (clean["batch_size"] == 4)]
    assert (at4["measured_speedup"].to_numpy() > 1.1 * clean4["measured_speedup"].to_numpy()).all()


def test_with_two_step_counts_the_lines_say_every_held_out_step_count_was_extrapolated():
    """Two step counts leave one: each held-out g is its method's smallest or largest, so no "_inside" row exists and a
    line says why (a plan of g = 2 and 4, as the default once was: its leave-one-g-out error is all extrapolation)."""
    cells = synthetic_cells(steps=(2, 4), profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=2, noise=0.05, seed=2)
    report = holdout_report(cells)
    assert "step_count" in {r["holdout"] for r in report["summary"]}
    assert "step_count_inside" not in {r["holdout"] for r in report["summary"]}
    lines = holdout_lines(report)
    at = next(i for i, line in enumerate(lines) if line.startswith("held-out error, leave one step count out ("))
    assert lines[at + 1] == f"held-out error, leave one step count out, inside the measured range: {NONE_INSIDE}"
    # three step counts: the middle one is held out inside the range, its own line, and no such sentence
    three = holdout_lines(holdout_report(synthetic_cells(steps=(1, 2, 3), profiles={"quote": SYNTHETIC_PROFILES["quote"]})))
    assert not any(NONE_INSIDE in line for line in three)
    assert any(line.startswith("held-out error, leave one step count out, inside the measured range (") for line in three)
    # a tuning.json from before held-out cells were marked extrapolated had no "_inside" rows at all: nothing is said
    old = {**report, "cells": [{k: v for k, v in c.items() if k != "extrapolated"} for c in report["cells"]]}
    assert not any(NONE_INSIDE in line for line in holdout_lines(old))
