"""The trace simulator: token accounting, policy semantics (static, vLLM schedule, SGLang adaptive, oracle)
and traces from round logs (censoring) or synthesised from per-position acceptance."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from spectune.adaptive import AdaptiveConfig, SlotConfig
from spectune.costmodel import AcceptanceProfile, RoundCost
from spectune.errors import SpectuneError
from spectune.simulate import (
    WINDOW_ROUNDS,
    AdaptiveConfigPolicy,
    OraclePolicy,
    Phase,
    SchedulePolicy,
    StaticPolicy,
    lift_trace,
    phase_shifting_trace,
    simulate,
    survival_by_steps,
    synthesize_trace,
    trace_from_round_log,
    trace_from_rows,
    window_profiles,
)

COST = RoundCost(batch_sizes=(1, 4, 16), target_ms=(10.0, 12.0, 20.0), draft_fixed_ms=(1.0, 1.5, 3.0), per_step_ms=(1.0, 2.0, 8.0))
HIGH = AcceptanceProfile((0.95,))
LOW = AcceptanceProfile((0.2,))


def adaptive(ladders: dict[int, list[int]], initial: int, **tuning) -> AdaptiveConfigPolicy:
    cfg = AdaptiveConfig({bound: SlotConfig(candidate_steps=steps, **tuning) for bound, steps in ladders.items()})
    return AdaptiveConfigPolicy(cfg, initial_steps=initial, cuda_graph_bs=())


def test_static_policy_caps_accepted_drafts_and_charges_the_round_cost():
    trace = trace_from_rows("tiny", 5, [[0, 3, 5], [2, 2], [5]])
    result = simulate(trace, StaticPolicy(2), COST)
    # Each request gains min(accepted, 2) + 1 tokens.
    assert list(result.timeline["tokens"]) == [1 + 3 + 3, 3 + 3, 3] and list(result.timeline["steps"]) == [2, 2, 2]
    ms = COST.t_round(3, 2) + COST.t_round(2, 2) + COST.t_round(1, 2)
    assert result.timeline["round_ms"].sum() == pytest.approx(ms)
    # One window: its work (tokens at horizon 5) done at the policy's rate there.
    assert result.work_tokens == (1 + 4 + 6) + (3 + 3) + 6
    assert result.tokens_per_s == pytest.approx(16 * 1000 / ms)
    assert result.time_ms == pytest.approx(23 * ms / 16)
    assert result.mean_tpot_ms == pytest.approx((3 * COST.t_round(3, 2) + 2 * COST.t_round(2, 2) + COST.t_round(1, 2)) / 16)


def test_figures_conserve_work_per_window_instead_of_counting_rounds():
    # Window 1: 32 rounds at batch 1 where every draft would be accepted; window 2: 32 rounds at batch 16, none.
    trace = trace_from_rows("two windows", 4, [[4]] * WINDOW_ROUNDS + [[0] * 16] * WINDOW_ROUNDS)
    work_1, work_2 = 5 * WINDOW_ROUNDS, 16 * WINDOW_ROUNDS
    drafting = simulate(trace, StaticPolicy(4), COST)
    assert drafting.time_ms == pytest.approx(WINDOW_ROUNDS * (COST.t_round(1, 4) + COST.t_round(16, 4)))
    plain = simulate(trace, StaticPolicy(0), COST)
    # Without drafts window 1 needs 5x the rounds for its work: speculation pays there although
    # each of its rounds is slower.
    assert plain.time_ms == pytest.approx(work_1 * COST.t_round(1, 0) + WINDOW_ROUNDS * COST.t_round(16, 0))
    assert drafting.work_tokens == plain.work_tokens == work_1 + work_2
    assert plain.tokens_per_s == pytest.approx((work_1 + work_2) * 1000 / plain.time_ms)


def test_zero_steps_yields_one_token_per_request_at_target_cost():
    trace = trace_from_rows("tiny", 5, [[5, 5, 5], [5]])
    result = simulate(trace, StaticPolicy(0), COST)
    assert list(result.timeline["tokens"]) == [3, 1]
    assert list(result.timeline["round_ms"]) == pytest.approx([np.interp(3, COST.batch_sizes, COST.target_ms), COST.target_ms[0]])


def test_schedule_follows_vllm_ranges_gaps_carry_and_last_runs_on():
    policy = SchedulePolicy(((1, 2, 3), (5, 8, 1)))
    assert [policy.steps_for_batch(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == [3, 3, 3, 3, 1, 1, 1, 1]
    trace = trace_from_rows("bs", 4, [[4], [4, 4, 4, 4, 4], [4, 4]])
    assert list(simulate(trace, policy, COST).timeline["steps"]) == [3, 1, 3]


def test_single_rung_adaptive_ladder_is_exactly_static():
    trace = phase_shifting_trace(HIGH, LOW, [1, 4], max_steps=6, seed=3, num_rounds=600)
    fixed = simulate(trace, StaticPolicy(3), COST)
    ladder = simulate(trace, adaptive({1: [3]}, initial=3), COST)
    assert ladder.timeline.equals(fixed.timeline) and ladder.tokens_per_s == fixed.tokens_per_s


def test_adaptive_policy_observes_drafts_capped_at_the_step_it_ran():
    # Every request would accept all 7 drafts. Launched at g=1 the server sees 1 accepted draft per request,
    # so its EMA climbs towards 1 and the first decision (batch 15 = warmup 10 + interval 5) moves one rung,
    # to 3, not straight to 7 (which an uncapped observation of 7 would do); then 3 -> 7.
    trace = trace_from_rows("perfect", 7, [[7, 7]] * 60)
    steps = simulate(trace, adaptive({1: [1, 3, 7]}, initial=1), COST).timeline["steps"].tolist()
    assert steps[:15] == [1] * 15 and steps[15] == 3 and steps[-1] == 7
    worthless = trace_from_rows("none", 7, [[0, 0]] * 60)
    assert simulate(worthless, adaptive({1: [1, 3, 7]}, initial=3), COST).timeline["steps"].iloc[-1] == 1


def test_adaptive_step_zero_rounds_yield_one_token_and_probe_back_up():
    trace = trace_from_rows("perfect", 3, [[3]] * 40)
    result = simulate(trace, adaptive({1: [0, 3]}, initial=0, warmup_batches=0, update_interval=2), COST)
    tl = result.timeline
    assert (tl.loc[tl["steps"] == 0, "tokens"] == 1).all()
    assert tl["steps"].iloc[0] == 0 and tl["steps"].iloc[-1] == 3


def test_simulation_is_pure_and_rejects_steps_beyond_the_trace_horizon():
    trace = phase_shifting_trace(HIGH, LOW, [1, 4, 16], max_steps=7, seed=1, num_rounds=900)
    policy = adaptive({1: [1, 3, 7], 8: [0, 1]}, initial=3)
    first, second = simulate(trace, policy, COST), simulate(trace, policy, COST)
    assert first.tokens_per_s == second.tokens_per_s and first.timeline.equals(second.timeline)
    with pytest.raises(SpectuneError, match="max_steps"):
        simulate(trace, StaticPolicy(8), COST)


def test_oracle_is_the_exact_optimum_of_per_round_choices():
    trace = trace_from_rows("small", 4, [[4, 0], [1], [0, 0, 0, 3]])
    candidates = (0, 1, 2, 4)
    for objective in ("throughput", "latency"):
        oracle = simulate(trace, OraclePolicy(candidates, objective), COST)
        best = None
        for choice in itertools.product(candidates, repeat=trace.num_rounds):
            steps = np.array(choice)
            tokens = (trace.batch_sizes + np.minimum(trace.accepted, steps[:, None]).sum(1)).sum()
            ms = COST.t_round(trace.batch_sizes, steps)
            score = tokens / ms.sum() if objective == "throughput" else -(trace.batch_sizes * ms).sum() / tokens
            best = score if best is None else max(best, score)
        got = oracle.tokens_per_s / 1000 if objective == "throughput" else -oracle.mean_tpot_ms  # one window
        assert got == pytest.approx(best, rel=1e-12)


def test_oracle_beats_every_other_policy_on_a_phase_shifting_trace():
    trace = phase_shifting_trace(HIGH, LOW, [1, 4, 16], max_steps=7, seed=2)
    oracle = simulate(trace, OraclePolicy(), COST).tokens_per_s
    others = [StaticPolicy(g) for g in range(8)] + [SchedulePolicy(((1, 3, 5), (4, 15, 2), (16, 16, 0))),
                                                     adaptive({1: [0, 1, 3, 5, 7]}, initial=3)]
    for policy in others:
        assert simulate(trace, policy, COST).tokens_per_s < oracle


def test_round_log_trace_continues_only_censored_requests(tmp_path):
    log = tmp_path / "draft.jsonl"
    rounds = [
        # request 0 accepted all of 2 drafts: censored; 1 rejected the 2nd draft: exact; 2 was offered only 1 draft: exact
        {"t_s": 0.1, "batch_size": 3, "num_steps": 2, "proposed": [2, 2, 1], "accepted": [2, 1, 1], "round_ms": 5.0},
        {"t_s": 0.2, "batch_size": 1, "num_steps": 4, "proposed": [4], "accepted": [4], "round_ms": 6.0},
        {"t_s": 0.3, "batch_size": 0, "num_steps": 4, "proposed": [], "accepted": [], "round_ms": 0.0},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in rounds))
    bare = trace_from_round_log(log)
    assert bare.max_steps == 4 and bare.num_rounds == 2
    assert bare.accepted.tolist() == [[2, 1, 1], [4, 0, 0]]
    always = trace_from_round_log(log, acceptance=AcceptanceProfile((1.0,)))
    assert always.accepted.tolist() == [[4, 1, 1], [4, 0, 0]]
    never = trace_from_round_log(log, acceptance=AcceptanceProfile((0.0,)))
    assert never.accepted.tolist() == bare.accepted.tolist()
    wider = trace_from_round_log(log, max_steps=6, acceptance=AcceptanceProfile((1.0,)))
    assert wider.accepted.tolist() == [[6, 1, 1], [6, 0, 0]]


def test_round_log_continuation_follows_the_fitted_rates(tmp_path):
    log = tmp_path / "g1.jsonl"
    rows = [{"num_steps": 1, "proposed": [1] * 16, "accepted": [1] * 16} for _ in range(500)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    profile = AcceptanceProfile((0.5,))
    trace = trace_from_round_log(log, max_steps=5, acceptance=profile, seed=7)
    values = trace.accepted.ravel()
    # Known: 1 accepted. Then each further draft with probability 0.5 -> E[accepted] = 1 + 0.5 + 0.25 + 0.125 + 0.0625.
    assert values.min() == 1 and values.mean() == pytest.approx(1.9375, abs=0.05)
    assert np.array_equal(trace_from_round_log(log, max_steps=5, acceptance=profile, seed=7).accepted, trace.accepted)


def test_round_log_trace_skips_the_prefill_steps_the_engine_logs_between_rounds(tmp_path):
    log = tmp_path / "ngram.jsonl"
    lines = [
        {"t_s": 0.01, "prefill": True, "batch_size": 2, "prompt_tokens": [30, 12], "num_running": 0},
        {"t_s": 0.02, "batch_size": 2, "num_steps": 3, "proposed": [3, 0], "accepted": [1, 0], "round_ms": 4.0},
        {"t_s": 0.03, "prefill": True, "batch_size": 1, "prompt_tokens": [9], "num_running": 2},
        {"t_s": 0.04, "batch_size": 3, "num_steps": 3, "proposed": [3, 3, 2], "accepted": [3, 2, 0], "round_ms": 5.0},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    trace = trace_from_round_log(log)
    assert trace.batch_sizes.tolist() == [2, 3] and trace.accepted.tolist() == [[1, 0, 0], [3, 2, 0]]


def test_round_log_errors_name_the_file_and_line(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"num_steps": 2, "proposed": [2], "accepted": [1]}\n{"num_steps": 2}\n')
    with pytest.raises(SpectuneError, match=r"bad.jsonl:2"):
        trace_from_round_log(log)


def test_synthesized_trace_reproduces_per_position_acceptance():
    profile = AcceptanceProfile((0.9, 0.7, 0.5, 0.3))
    trace = synthesize_trace([Phase("a", 2000, 8, profile)], max_steps=4, seed=0)
    values = trace.accepted.ravel()
    survival = [(values >= i).mean() for i in range(1, 5)]
    np.testing.assert_allclose(survival, profile.survival(4), atol=0.01)
    (estimated,) = window_profiles(trace, window=2000)
    np.testing.assert_allclose(estimated.rates, profile.rates, atol=0.015)


def test_phase_shifting_trace_alternates_acceptance_out_of_step_with_batch_size():
    trace = phase_shifting_trace(HIGH, LOW, [1, 4, 16], max_steps=7, seed=0, phase_rounds=100, batch_rounds=150, num_rounds=900)
    assert trace.num_rounds == 900
    phases = np.array(trace.phases)
    assert phases[0] == "high" and phases[100] == "low" and phases[200] == "high"
    assert trace.batch_sizes[[0, 150, 300, 450, 600, 750]].tolist() == [1, 4, 16, 4, 1, 4]
    mean = lambda label: trace.accepted[phases == label].sum() / trace.batch_sizes[phases == label].sum()
    assert mean("high") > 5 * mean("low")


# --- acceptance by the step count a round runs at, output caps, per-request cost ------------------------------


def _survival(values: np.ndarray, g: int) -> list[float]:
    return [float((values >= i).mean()) for i in range(1, g + 1)]


def test_lifted_trace_gives_each_label_the_acceptance_measured_at_each_g():
    # Two phases drawn at horizon 6 with their own rates; what rounds at g = 2 accepted is higher for "code" only.
    hard, easy = AcceptanceProfile((0.5, 0.6)), AcceptanceProfile((0.9, 0.95))
    trace = synthesize_trace([Phase("code", 3000, 4, hard), Phase("quote", 3000, 4, easy)], max_steps=6, seed=1)
    ids = np.arange(trace.accepted.size).reshape(trace.accepted.shape)  # one request id per request-round
    labels = {int(i): ("code" if r < 3000 else "quote") for r, row in enumerate(ids) for i in row}
    trace = replace(trace, request_ids=ids)
    at_2 = np.array([0.7, 0.5])  # S_1, S_2 measured at g = 2 for code: above the horizon's 0.5, 0.3
    survival = {"code": {2: at_2, 6: hard.survival(6)}}
    lifted = lift_trace(trace, survival, seed=3, labels=labels)
    took = lifted.took()
    code, quote = slice(0, 3000), slice(3000, None)
    np.testing.assert_allclose(_survival(took[code, :, 2].ravel(), 2), at_2, atol=0.015)
    # the other phase has no survival of its own: left as cut; the horizon is the trace itself
    assert np.array_equal(took[quote, :, 2], np.minimum(trace.accepted[quote], 2))
    assert np.array_equal(took[:, :, 6], trace.accepted)
    # between measured step counts each position's rate is interpolated: g = 4 lies between g = 2 and g = 6
    s4 = _survival(took[code, :, 4].ravel(), 4)
    assert hard.survival(4)[0] + 0.02 < s4[0] < at_2[0] - 0.02
    # policies see the lifted acceptance: static g = 2 yields more than the cut trace on the code phase
    first = lambda t: replace(t, batch_sizes=t.batch_sizes[code], accepted=t.accepted[code], phases=t.phases[code], request_ids=None,
                              lifted=None if t.lifted is None else t.lifted[code])
    cut, more = simulate(first(trace), StaticPolicy(2), COST), simulate(first(lifted), StaticPolicy(2), COST)
    assert more.timeline["tokens"].sum() > 1.1 * cut.timeline["tokens"].sum()
    assert np.array_equal(lift_trace(trace, survival, seed=3, labels=labels).lifted, lifted.lifted)  # seeded


def test_lift_lowers_acceptance_where_g_measured_less():
    trace = synthesize_trace([Phase("a", 4000, 2, AcceptanceProfile((0.8,)))], max_steps=3, seed=0)
    lifted = lift_trace(trace, {"": {1: np.array([0.6])}}, seed=0)
    assert _survival(lifted.took()[:, :, 1].ravel(), 1)[0] == pytest.approx(0.6, abs=0.02)
    assert (lifted.took()[:, :, 1] <= np.minimum(trace.accepted, 1)).all()  # only drops acceptances


def test_survival_by_steps_reads_each_step_count_and_label_of_a_round_log(tmp_path):
    log = tmp_path / "adaptive.jsonl"
    rows = [
        {"prefill": True, "batch_size": 2, "prompt_tokens": [5, 5], "request_ids": [0, 1]},
        {"num_steps": 2, "proposed": [2, 2], "accepted": [2, 0], "request_ids": [0, 1]},
        {"num_steps": 2, "proposed": [2, 2], "accepted": [1, 1], "request_ids": [0, 1]},
        {"num_steps": 4, "proposed": [4], "accepted": [3], "request_ids": [1]},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_label = survival_by_steps(log, {0: "quote"})
    assert set(by_label) == {"quote", ""}
    np.testing.assert_allclose(by_label["quote"][2], [1.0, 0.5])
    np.testing.assert_allclose(by_label[""][2], [0.5, 0.0])
    np.testing.assert_allclose(by_label[""][4], [1.0, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(survival_by_steps(log)[""][2], [0.75, 0.25])


def test_round_log_trace_counts_only_the_tokens_a_request_had_left(tmp_path):
    # max_tokens 8: the prefill gives 1, then rounds of 4 + 1 and 4 + 1 tokens; the second has only 2 left.
    log = tmp_path / "g4.jsonl"
    rows = [
        {"prefill": True, "batch_size": 1, "prompt_tokens": [5], "request_ids": [7]},
        {"num_steps": 4, "proposed": [4], "accepted": [4], "request_ids": [7]},
        {"num_steps": 4, "proposed": [4], "accepted": [4], "request_ids": [7]},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = trace_from_round_log(log, output_tokens=8)
    assert trace.accepted.tolist() == [[4], [4]]  # what the engine accepted
    assert trace.cap.tolist() == [[6], [1]]
    result = simulate(trace, StaticPolicy(4), COST)
    assert result.timeline["tokens"].tolist() == [5, 2] and result.work_tokens == 7  # 8 - the prefill's token
    assert simulate(trace, StaticPolicy(1), COST).timeline["tokens"].tolist() == [2, 2]
    assert trace_from_round_log(log).cap is None


def test_per_request_cost_is_paid_per_token_so_a_trace_reproduces_ms_per_token():
    cost = RoundCost(batch_sizes=(1, 8), target_ms=(10.0, 20.0), draft_fixed_ms=(2.0, 4.0), per_step_ms=(1.0, 3.0), request_ms=(3.0, 8.0))
    trace = trace_from_rows("steady", 4, [[2] * 8] * 64)  # every request accepts 2 drafts: 3 tokens per round at g >= 2
    for g, tokens in ((0, 1), (2, 3), (4, 3)):
        result = simulate(trace, StaticPolicy(g), cost)
        assert 1000.0 * 8 / result.tokens_per_s == pytest.approx(cost.ms_per_token(8, g, tokens))
    bare = replace(cost, request_ms=())
    assert simulate(trace, StaticPolicy(4), bare).tokens_per_s > simulate(trace, StaticPolicy(4), cost).tokens_per_s


def test_synthesized_trace_follows_the_profiles_trend_in_g():
    profile = AcceptanceProfile((0.8, 0.7), trend=-0.05, trend_ref_g=2.0)
    trace = synthesize_trace([Phase("a", 3000, 4, profile)], max_steps=5, seed=2)
    took = trace.took()
    for g in (1, 3, 5):
        np.testing.assert_allclose(_survival(took[:, :, g].ravel(), g), profile.survival_at(g), atol=0.015)
    assert np.array_equal(took[:, :, 5], trace.accepted)
