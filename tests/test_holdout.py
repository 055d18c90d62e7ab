"""Out-of-sample accuracy (spectune.holdout) and the model terms it checks, on SYNTHETIC cells from a known model."""

from __future__ import annotations

import numpy as np
import pytest

from spectune.costmodel import AcceptanceProfile, RoundCost, fit_sweep, recommend
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


def test_round_cost_extrapolates_batch_size_along_the_nearest_line():
    cost = RoundCost(batch_sizes=(4, 8), target_ms=(5.0, 7.0), draft_fixed_ms=(1.0, 2.0), per_step_ms=(0.5, 1.0))
    assert cost.t_round(16, 0) == pytest.approx(11.0)  # 7 + (7 - 5) / 4 * 8
    assert cost.t_round(1, 2) == pytest.approx(3.5 + 0.25 + 0.125 * 2)
    assert cost.t_round(0.01, 1) >= 0.0


def test_draft_terms_are_one_line_in_batch_size_when_the_cells_allow_it():
    cells = synthetic_cells(cost=LINEAR, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=2, noise=0.03, seed=4)
    fit = fit_sweep(cells)
    assert (fit.table["draft_terms"] == "joint line in batch size").all()
    per_step = fit.table.set_index("batch_size")["per_step_ms"]
    assert np.allclose(np.diff(per_step.to_numpy()) / np.diff(per_step.index.to_numpy(float)), (per_step[16] - per_step[1]) / 15)
    assert per_step.to_numpy() == pytest.approx(LINEAR.per_step_ms, rel=0.1, abs=0.05)
    # a cost far from linear in batch size (SYNTHETIC_COST's per-step term) keeps one line in g per batch size
    assert "draft_terms" not in fit_sweep(synthetic_cells(noise=0.01, seed=1)).table


def test_each_workload_is_predicted_with_its_own_acceptance():
    cells = synthetic_cells(repeats=1, noise=0.01, seed=6)  # "quote" easy to draft, "random" hard: pooled would miss both
    predictions = holdout_predictions(cells)
    assert set(predictions["workload"]) == {"quote", "random"}
    assert predictions["throughput_abs_pct_error"].mean() < 5.0
