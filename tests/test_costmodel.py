"""The alpha / cost model: the reference document's tables, and fits that recover a known (synthetic) model."""

from __future__ import annotations

import subprocess

import numpy as np
import pandas as pd
import pytest

from spectune.costmodel import (
    _fit_round_cost,
    _joint_fit,
    _joint_table,
    AcceptanceProfile,
    RoundCost,
    breakeven_batch_size,
    expected_tokens,
    expected_tokens_per_pos,
    fit_sweep,
    parse_gammas,
    prediction_vs_measurement,
    recommend,
    speedup,
)
from spectune.errors import SpectuneError
from synthetic_sweep import SHARE_COST, SYNTHETIC_COST, SYNTHETIC_PROFILES, SYNTHETIC_STEPS, synthetic_cells

# /work/shared/reference/003 (ch. 4): the spec, copied as printed. E[tokens per round] by alpha, g = 2, 4, 7, 10.
DOC_EXPECTED_TOKENS = {
    0.5: ("1.75", "1.94", "1.99", "2.00"),
    0.6: ("1.96", "2.31", "2.46", "2.49"),
    0.7: ("2.19", "2.77", "3.14", "3.27"),
    0.8: ("2.44", "3.36", "4.16", "4.57"),
    0.9: ("2.71", "4.10", "5.70", "6.86"),
}
# Same document: speedup E / (g*c + 1) with c = 0.05.
DOC_SPEEDUP_C005 = {
    0.6: ("1.78", "1.92", "1.82", "1.66"),
    0.7: ("1.99", "2.31", "2.33", "2.18"),
    0.8: ("2.22", "2.80", "3.08", "3.05"),
    0.9: ("2.46", "3.41", "4.22", "4.57"),
}
DOC_GAMMAS = (2, 4, 7, 10)


@pytest.mark.parametrize("alpha", sorted(DOC_EXPECTED_TOKENS))
def test_expected_tokens_matches_reference_table(alpha):
    assert tuple(f"{expected_tokens(alpha, g):.2f}" for g in DOC_GAMMAS) == DOC_EXPECTED_TOKENS[alpha]


@pytest.mark.parametrize("alpha", sorted(DOC_SPEEDUP_C005))
def test_speedup_matches_reference_table(alpha):
    assert tuple(f"{speedup(alpha, g, 0.05):.2f}" for g in DOC_GAMMAS) == DOC_SPEEDUP_C005[alpha]


def test_closed_form_limits_and_per_position_form():
    assert expected_tokens(1.0, 7) == 8.0
    assert expected_tokens(0.0, 7) == 1.0
    for alpha in (0.3, 0.75, 0.99):
        assert expected_tokens_per_pos([alpha] * 6) == pytest.approx(expected_tokens(alpha, 6))
    # Per position: 1 + a1 + a1*a2 + a1*a2*a3.
    assert expected_tokens_per_pos([0.9, 0.5, 0.2]) == pytest.approx(1 + 0.9 + 0.45 + 0.09)


def test_cli_model_prints_both_reference_tables(spectune_cmd):
    out = subprocess.run([*spectune_cmd, "model", "--alpha", "0.5,0.6,0.7,0.8,0.9", "--cost", "0.05", "--gamma", "2,4,7,10"],
                         capture_output=True, text=True, check=True).stdout
    printed = {}
    for line in out.splitlines()[1:]:
        alpha, g, tokens, gain = line.split()
        printed[(float(alpha), int(g))] = (tokens, gain)
    assert len(printed) == 20
    for alpha, row in DOC_EXPECTED_TOKENS.items():
        assert tuple(printed[(alpha, g)][0] for g in DOC_GAMMAS) == row
    for alpha, row in DOC_SPEEDUP_C005.items():
        assert tuple(printed[(alpha, g)][1] for g in DOC_GAMMAS) == row


def test_cli_model_accepts_a_range_and_rejects_garbage_with_exit_2(spectune_cmd):
    out = subprocess.run([*spectune_cmd, "model", "--alpha", "0.8", "--gamma", "1-10"], capture_output=True, text=True, check=True).stdout
    assert [int(line.split()[1]) for line in out.splitlines()[1:]] == list(range(1, 11))
    bad = subprocess.run([*spectune_cmd, "model", "--alpha", "0.8", "--gamma", "two"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--gamma" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    # an option below its minimum is a usage error: exit 2 and click's message, not a traceback
    below = subprocess.run([*spectune_cmd, "model", "--alpha", "0.8", "--cost", "-1"], capture_output=True, text=True)
    assert below.returncode == 2 and "Invalid value for '--cost'" in below.stderr and "Traceback" not in below.stderr
    assert parse_gammas("1-3,7") == [1, 2, 3, 7]
    with pytest.raises(SpectuneError):
        parse_gammas("-2")


def test_fit_recovers_synthetic_round_cost_with_honest_uncertainty():
    fit = fit_sweep(synthetic_cells(noise=0.02, seed=1))
    assert (fit.engine, fit.method, fit.max_steps) == ("embedded", "draft_model", max(SYNTHETIC_STEPS))
    table = fit.table.set_index("batch_size")
    assert tuple(table.index) == SYNTHETIC_COST.batch_sizes
    for i, bs in enumerate(SYNTHETIC_COST.batch_sizes):
        row = table.loc[bs]
        assert row["target_ms"] == pytest.approx(SYNTHETIC_COST.target_ms[i], rel=0.02)
        assert abs(row["per_step_ms"] - SYNTHETIC_COST.per_step_ms[i]) <= 4 * row["per_step_se_ms"]
        assert abs(row["draft_fixed_ms"] - SYNTHETIC_COST.draft_fixed_ms[i]) <= 4 * row["draft_fixed_se_ms"]
        assert 0 < row["per_step_se_ms"] < 0.1 * SYNTHETIC_COST.per_step_ms[i]
    # The failing cells (nonsense TPOT) are excluded, listed with their reason, and did not bend the fit.
    assert sorted(fit.excluded["reason"]) == ["failure_rate > 0.05", "status failed"]


def test_one_step_count_at_a_batch_size_is_split_as_the_nearest_line_in_g_was():
    # a block drafter (SYNTHETIC): one pass drafts the block, so most of its cost is fixed, 4 positions' worth everywhere
    block = RoundCost(batch_sizes=(1, 2, 4, 8, 16), target_ms=(10.0, 10.6, 11.8, 14.5, 20.0),
                      draft_fixed_ms=(4.0, 4.8, 6.4, 9.6, 16.0), per_step_ms=(1.0, 1.2, 1.6, 2.4, 4.0))
    cells = synthetic_cells(cost=block, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, noise=0.0)
    g, bs = cells["num_speculative_tokens"], cells["batch_size"]
    # a guided sweep's seeds: g = 1 and 3 at the smallest batch size, g = 1 again at the largest
    seeds = ~cells["is_speculative"].astype(bool) | ((bs == 1) & g.isin([1, 3])) | ((bs == 16) & (g == 1))
    fit = fit_sweep(cells[seeds & (cells["status"] == "ok")])
    row = fit.table.set_index("batch_size").loc[16]
    assert row["draft_fixed_ms"] == pytest.approx(16.0, rel=0.01) and row["per_step_ms"] == pytest.approx(4.0, rel=0.01)
    # so g = 3 at batch 16 costs what it does; all per step, as before, it was charged 3 x 20 ms of drafting
    assert fit.cost.t_round(16, 3) == pytest.approx(block.t_round(16, 3), rel=0.01)
    # with no line in g anywhere, all of it stays per step
    only_one = cells[seeds & (cells["status"] == "ok") & ~((bs == 1) & (g == 3))]
    assert fit_sweep(only_one).table.set_index("batch_size").loc[16, "draft_fixed_ms"] == pytest.approx(0.0, abs=1e-9)


def test_a_batch_size_only_the_speculative_server_ran_is_anchored_between_target_onlys_neighbours():
    """An open loop: on the same arrivals EAGLE ran 2 sequences at once where target-only ran 1 and 4 (it finishes
    sooner). Its cells at 2 were dropped (no target-only there), so the tuned config never saw that batch size."""
    cells = synthetic_cells(noise=0.0)
    ok = cells[cells["status"] == "ok"]
    target = ~ok["is_speculative"].astype(bool)
    kept = ok[~(target & (ok["batch_size"] == 2))]
    table = fit_sweep(kept).table.set_index("batch_size")
    assert 2 in table.index
    assert table.loc[2, "target_ms"] == pytest.approx(float(np.interp(2, [1, 4], [SYNTHETIC_COST.target_ms[0], SYNTHETIC_COST.target_ms[2]])))
    assert table.loc[2, "per_step_ms"] == pytest.approx(SYNTHETIC_COST.per_step_ms[1], rel=0.05)
    # nothing to read between at the ends: a batch size past target-only's measured ones is still left out
    beyond = kept[kept["is_speculative"].astype(bool) | (kept["batch_size"] != 1)]
    assert 1 not in fit_sweep(beyond).table["batch_size"].tolist()


def test_rounds_growing_faster_than_a_line_in_g_are_fitted_with_a_square_term_not_a_negative_fixed_cost():
    # SYNTHETIC: at batch 16 the draft cost is 2 g + 1.25 g^2 ms (26 ms at g = 2, 46 at g = 4 over target-only's 16,
    # as EAGLE's rounds on a new user's sweep); measured at g = 2 and 4 only, as the default plan once did
    convex = RoundCost(batch_sizes=(1, 4, 16, 32), target_ms=(3.4, 6.3, 16.0, 33.0), draft_fixed_ms=(0.2, 0.7, 0.0, 0.0),
                       per_step_ms=(1.2, 1.8, 2.0, 4.0), per_step_sq_ms=(0.0, 0.0, 1.25, 2.0))
    cells = synthetic_cells(cost=convex, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, steps=(2, 4), noise=0.0)
    fit = fit_sweep(cells[cells["status"] == "ok"])
    row = fit.table.set_index("batch_size").loc[16]
    assert row["draft_fixed_ms"] == 0.0 and row["per_step_sq_ms"] > 0
    for g in (2, 4):  # the cells it was fitted on, as measured; the line floored at a fixed cost of 0 charged g = 2 40% more
        assert fit.cost.t_round(16, g) == pytest.approx(convex.t_round(16, g), rel=0.01)
    line = np.polyfit([2, 4], [convex.t_round(16, 2), convex.t_round(16, 4)], 1)
    assert line[1] < convex.target_ms[2]  # the line through them crosses below target-only's round at g = 0
    assert convex.target_ms[2] < fit.cost.t_round(16, 1) == pytest.approx(convex.t_round(16, 1), rel=0.01)
    assert fit.table.set_index("batch_size").loc[4, "per_step_sq_ms"] == 0.0  # a line where the rounds are one


def test_the_joint_draft_terms_replace_a_batch_sizes_square_term_with_its_line():
    # SYNTHETIC: a local fit whose batch 16 is convex in g; where Akaike's criterion takes the joint terms instead,
    # they are the whole draft cost there (a square term kept beside them charged it twice)
    convex = RoundCost(batch_sizes=(1, 4, 16, 32), target_ms=(3.4, 6.3, 16.0, 33.0), draft_fixed_ms=(0.2, 0.7, 0.0, 0.0),
                       per_step_ms=(1.2, 1.8, 2.0, 4.0), per_step_sq_ms=(0.0, 0.0, 1.25, 2.0))
    cells = synthetic_cells(cost=convex, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, steps=(2, 4), noise=0.0)
    ok = cells[cells["status"] == "ok"]
    target, spec = ok[~ok["is_speculative"]], ok[ok["is_speculative"]]
    local = _fit_round_cost(target, spec)
    assert local.set_index("batch_size").loc[16, "per_step_sq_ms"] > 0
    joint = _joint_table(local, target, _joint_fit(target, spec)[0])
    assert (joint["per_step_sq_ms"] == 0.0).all()


def test_the_drafters_overhead_in_ms_is_fitted_only_where_the_cells_measured_three_points_a_term():
    # SYNTHETIC: 10 (batch size, g) points keep the shares alone (4 terms: 5 through the default plan's 6-8 points
    # followed their noise); 30 add the overhead per round and per step (5)
    for steps, terms in (((2, 4), 4), (SYNTHETIC_STEPS, 5)):
        cells = synthetic_cells(cost=SHARE_COST, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, steps=steps, noise=0.0)
        ok = cells[cells["status"] == "ok"]
        coef, _ = _joint_fit(ok[~ok["is_speculative"]], ok[ok["is_speculative"]])
        assert len(coef) == terms


def test_fit_defaults_to_the_method_that_measured_fastest_not_the_most_measured():
    cells = synthetic_cells(noise=0.0)
    # a second method with fewer cells, twice as fast as the first at every step count and batch size
    fast = cells[cells["num_speculative_tokens"].isin([1, 2]) & (cells["status"] == "ok")].copy()
    fast["method"], fast["server"] = "ngram", "ngram-" + fast["server"]
    fast["output_throughput_tps"] *= 2
    both = pd.concat([cells, fast], ignore_index=True)
    assert (fast["num_speculative_tokens"] > 0).sum() < (cells["num_speculative_tokens"] > 0).sum()
    assert fit_sweep(both).method == "ngram"
    assert fit_sweep(both, method="draft_model").method == "draft_model"


def test_fit_names_the_methods_there_are_when_asked_for_another():
    with pytest.raises(SpectuneError, match="for ngram .found: embedded/draft_model.; choose one of those"):
        fit_sweep(synthetic_cells(), method="ngram")


def test_fit_on_target_only_cells_says_there_is_nothing_to_fit():
    cells = synthetic_cells()
    with pytest.raises(SpectuneError, match="no static speculative cell measured ok .* sweep speculative servers"):
        fit_sweep(cells[~cells["is_speculative"].astype(bool)])


def test_fit_with_target_only_on_another_engine_names_both_engines_and_the_fix():
    cells = synthetic_cells()  # an attached target-only server declared engine "openai", the speculative ones "embedded"
    cells.loc[~cells["is_speculative"].astype(bool), "engine"] = "openai"
    with pytest.raises(SpectuneError, match="no target-only server on 'embedded' measured ok .target-only on: openai.*"
                                            'give the target-only server engine = "embedded"'):
        fit_sweep(cells)


def test_fit_recovers_per_position_acceptance_per_workload():
    fit = fit_sweep(synthetic_cells(noise=0.0))
    assert set(fit.acceptance) == set(SYNTHETIC_PROFILES)
    for workload, truth in SYNTHETIC_PROFILES.items():
        got = fit.acceptance[workload]
        assert got.source == "per_position"
        np.testing.assert_allclose(got.rates, truth.rates, atol=1e-9)


def _methods_whose_traffic_at_batch_4_is_easier(methods: dict[str, float]) -> pd.DataFrame:
    """SYNTHETIC cells of draft_model and the given other methods, one workload; each other method's batch-4 traffic
    has every survival times its factor (draft_model's too, by 1.3), as if that batch size's prompts were easier."""
    plain = {"random": SYNTHETIC_PROFILES["random"]}
    frames = []
    for method, factor in {"draft_model": 1.3, **methods}.items():
        rates = plain["random"].rates
        easier = {"random": AcceptanceProfile((rates[0] * factor,) + rates[1:])}
        cells = pd.concat([synthetic_cells(profiles=plain, noise=0.0).query("batch_size != 4"),
                           synthetic_cells(profiles=easier, noise=0.0).query("batch_size == 4")], ignore_index=True)
        cells = cells[cells["status"] == "ok"]
        if method != "draft_model":
            cells = cells[cells["num_speculative_tokens"] > 0].assign(method=method, server=method + "-" + cells["server"])
        frames.append(cells)
    return pd.concat(frames, ignore_index=True)


@pytest.mark.parametrize(("others", "carried"), [
    ({"ngram": 1.3, "eagle": 1.3}, True),   # two other methods found batch 4's traffic easier: it is the traffic's
    ({"ngram": 1.3}, False),                # one alone might be that drafter's own
    ({"ngram": 1.3, "eagle": 0.8}, False),  # they disagree
])
def test_a_batch_size_without_a_methods_cells_takes_the_traffic_effect_other_methods_agree_on(others, carried):
    cells = _methods_whose_traffic_at_batch_4_is_easier(others)
    held_out = cells.drop(index=cells.index[(cells["method"] == "draft_model") & (cells["batch_size"] == 4)])
    fit = fit_sweep(held_out, method="draft_model")
    truth = AcceptanceProfile((SYNTHETIC_PROFILES["random"].rates[0] * 1.3,) + SYNTHETIC_PROFILES["random"].rates[1:])
    between = fit_sweep(held_out[~held_out["method"].isin(list(others))], method="draft_model").profile("random", 4)
    assert between.expected_tokens(4) < 0.95 * truth.expected_tokens(4)  # the neighbours alone miss it
    got = fit.profile("random", 4)
    for g in SYNTHETIC_STEPS:
        if carried:
            assert got.expected_tokens(g) == pytest.approx(truth.expected_tokens(g), rel=0.01)
        else:
            assert got.expected_tokens(g) == pytest.approx(between.expected_tokens(g), rel=1e-9)
    # where draft_model measured batch 4 itself, its own cells count, whatever the others say
    assert fit_sweep(cells, method="draft_model").profile("random", 4).expected_tokens(4) == pytest.approx(truth.expected_tokens(4), rel=1e-6)


def test_fit_falls_back_to_constant_alpha_without_per_position_counters():
    truth = {"steady": AcceptanceProfile((0.72,)), "hard": AcceptanceProfile((0.3,))}
    fit = fit_sweep(synthetic_cells(profiles=truth, noise=0.0, with_accept_pos=False))
    for workload, profile in truth.items():
        assert fit.acceptance[workload].source == "constant"
        assert fit.acceptance[workload].rates[0] == pytest.approx(profile.rates[0], abs=1e-6)


def test_recommend_picks_the_true_best_g_and_finds_where_speculation_stops_paying():
    fit = fit_sweep(synthetic_cells(noise=0.0))
    rec = recommend(fit)
    steps = np.arange(max(SYNTHETIC_STEPS) + 1)
    for row in rec.itertuples():
        truth = SYNTHETIC_PROFILES[row.workload]
        tpot = [SYNTHETIC_COST.t_round(row.batch_size, g) / truth.expected_tokens(int(g)) for g in steps]
        assert row.best_g == int(np.argmin(tpot))
        assert row.speedup == pytest.approx(tpot[0] / min(tpot), rel=1e-6)
    assert (rec == recommend(fit, objective="latency")).all().all()  # one batch size: the same g
    assert breakeven_batch_size(rec, "quote") is None  # easy drafts pay even at batch 16
    random = rec[rec["workload"] == "random"].set_index("batch_size")["best_spec_speedup"]
    assert random[4] > 1 > random[8]
    assert 4 < breakeven_batch_size(rec, "random") < 8


def test_prediction_vs_measurement_has_small_error_on_every_usable_cell():
    cells = synthetic_cells(noise=0.02, seed=2)
    fit = fit_sweep(cells)
    pvm = prediction_vs_measurement(fit, cells)
    assert len(pvm) == len(cells) - 2  # every cell but the two failing ones
    assert pvm["tpot_rel_error"].abs().median() < 0.03
    assert pvm["tpot_rel_error"].abs().max() < 0.15
    spec = pvm[pvm["g"] > 0]
    assert np.corrcoef(spec["predicted_speedup"], spec["measured_speedup"])[0, 1] > 0.95
