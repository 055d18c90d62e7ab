"""Out-of-sample accuracy (spectune.holdout) and the model terms it checks, on SYNTHETIC cells from a known model."""

from __future__ import annotations

import numpy as np
import pytest

from spectune.costmodel import AcceptanceProfile, RoundCost, fit_sweep, recommend, step_units
from spectune.holdout import holdout_lines, holdout_predictions, holdout_report, holdout_summary
from synthetic_sweep import SYNTHETIC_PROFILES, synthetic_cells

# Verify cost linear in batch size (tokens) beyond the measured range: the truth below is exactly linear in bs.
LINEAR = RoundCost(batch_sizes=(1, 2, 4, 8, 16), target_ms=(3.0, 3.5, 4.5, 6.5, 10.5), draft_fixed_ms=(1.0, 1.2, 1.6, 2.4, 4.0),
                   per_step_ms=(0.3, 0.5, 0.9, 1.7, 3.3))


def test_exact_cells_are_predicted_exactly_out_of_sample():
    cells = synthetic_cells(cost=LINEAR, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)
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
    assert set(both.index) == {"step_count", "batch_size"}
    assert (both["throughput_mean_abs_pct"] > 0.5).all()  # 5% noise per cell cannot be predicted away
    assert (both["throughput_max_abs_pct"] >= both["throughput_mean_abs_pct"]).all()
    lines = holdout_lines(holdout_report(cells))
    assert len(lines) == 2 and all("tpot" in line and "speedup" in line for line in lines)


def test_held_out_error_is_reported_as_not_computed_with_one_step_count():
    cells = synthetic_cells(steps=(2,), profiles={"quote": SYNTHETIC_PROFILES["quote"]})
    cells = cells[cells["batch_size"] == 4]
    assert holdout_lines(holdout_report(cells))[0].startswith("held-out error: not computed")


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


def test_round_cost_extrapolates_batch_size_along_the_nearest_line_and_steps_by_exponent():
    cost = RoundCost(batch_sizes=(4, 8), target_ms=(5.0, 7.0), draft_fixed_ms=(1.0, 2.0), per_step_ms=(0.5, 1.0))
    assert cost.t_round(16, 0) == pytest.approx(11.0)  # 7 + (7 - 5) / 4 * 8
    assert cost.t_round(1, 2) == pytest.approx(3.5 + 0.25 + 0.125 * 2)
    assert cost.t_round(0.01, 1) >= 0.0
    assert step_units(np.array([1, 3]), 1.0).tolist() == [1.0, 3.0]
    concave = step_units(np.array([1, 2, 6]), 0.5)
    assert concave[0] == pytest.approx(1.0) and concave[2] < 6.0 and np.all(np.diff(concave) > 0)


def test_step_exponent_is_recovered_from_concave_round_costs():
    truth = RoundCost(batch_sizes=(1, 4, 16), target_ms=(3.0, 5.0, 12.0), draft_fixed_ms=(1.0, 1.5, 3.0), per_step_ms=(1.0, 2.0, 6.0),
                      step_exponent=0.5)
    cells = synthetic_cells(cost=truth, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)
    fit = fit_sweep(cells)
    assert fit.cost.step_exponent == pytest.approx(0.5)
    two_steps = cells[cells["num_speculative_tokens"].isin([0, 2, 4])]
    assert fit_sweep(two_steps).cost.step_exponent == 1.0  # too few step counts to tell a curve from a line
