"""The request-level replay (spectune.simulate.simulate_requests) on hand-built traffic whose answer is worked
out by hand from the embedded engine's loop: a step prefills the newly admitted requests or decodes all running
ones, admission is first come first served within max_num_seqs and the prefill token budget, the client keeps at
most max_concurrency in flight and times each request from its arrival (and, beside it, from its send)."""

from __future__ import annotations

import numpy as np
import pytest

from spectune.adaptive import AdaptiveConfig, AdaptivePolicy, SlotConfig
from spectune.costmodel import AcceptanceProfile, PositionalAcceptance, RoundCost, ServingCost
from spectune.errors import SpectuneError
from spectune.simulate import (
    AcceptanceDraws,
    AdaptiveConfigPolicy,
    OraclePolicy,
    SchedulePolicy,
    StaticPolicy,
    Traffic,
    draw_acceptance,
    simulate_requests,
)

# decode: 10 ms plain, + 2 ms + 1 ms per draft when speculating, whatever the batch size
FLAT = RoundCost(batch_sizes=(1,), target_ms=(10.0,), draft_fixed_ms=(2.0,), per_step_ms=(1.0,))


def serving(prefill_fixed: float = 0.0, per_token: float = 1.0, overhead: float = 0.0, decode: RoundCost = FLAT) -> ServingCost:
    return ServingCost(decode=decode, prefill_fixed_ms=prefill_fixed, prefill_per_token_ms=per_token, request_overhead_ms=overhead)


def traffic(arrivals, prompts, outputs, max_concurrency=None, groups=None) -> Traffic:
    return Traffic(
        name="hand",
        arrival_ms=np.array(arrivals, dtype=float),
        prompt_tokens=np.array(prompts),
        output_tokens=np.array(outputs),
        groups=tuple(groups or ["g"] * len(arrivals)),
        max_concurrency=max_concurrency,
    )


def every_round_accepts(n: int, drafts: int, horizon: int, positions: int = 64) -> AcceptanceDraws:
    return AcceptanceDraws(horizon=horizon, accepted=np.full((n, positions), drafts))


def test_one_request_on_an_idle_engine():
    # Sent at 100, reaches the engine at 101, prefill 5 + 0.1 x 50 = 10 ms -> first token at 111; one decode round
    # at g = 2 accepts both drafts: 3 tokens (all that is left of 4) in 10 + 2 + 2 = 14 ms -> done at 125.
    result = simulate_requests(traffic([100], [50], [4]), StaticPolicy(2), serving(5.0, 0.1, 1.0), every_round_accepts(1, 2, 2),
                               max_num_seqs=4)
    r = result.requests.iloc[0]
    assert (r.send_ms, r.first_token_ms, r.finish_ms) == pytest.approx((100, 111, 125))
    assert (r.ttft_ms, r.e2e_ms, r.tpot_ms) == pytest.approx((11, 25, 14 / 3))
    assert r.decode_rounds == 1
    assert result.steps[["kind", "batch_size", "steps", "tokens"]].values.tolist() == [["prefill", 1, 0, 1], ["decode", 1, 2, 3]]
    assert result.tokens_per_s == pytest.approx(4 * 1000 / 25)


def test_slots_cap_the_prefill_and_the_rest_waits_for_a_finish():
    # max_num_seqs 2: r0 and r1 prefill together, padded to the longer: 2 x 20 = 40 ms; one plain round (10 ms)
    # finishes both; then r2 prefills alone (30 ms) and decodes (10 ms).
    result = simulate_requests(traffic([0, 0, 0], [10, 20, 30], [2, 2, 2]), StaticPolicy(0), serving(), every_round_accepts(3, 0, 1),
                               max_num_seqs=2)
    assert result.requests["ttft_ms"].tolist() == pytest.approx([40, 40, 80])
    assert result.requests["e2e_ms"].tolist() == pytest.approx([50, 50, 90])
    assert result.steps["kind"].tolist() == ["prefill", "decode", "prefill", "decode"]
    assert result.steps["batch_size"].tolist() == [2, 2, 1, 1]


def test_prefill_token_budget_admits_the_first_request_and_then_only_prompts_that_fit():
    # Budget 25: r0 (10) goes first and leaves 15; r1 (20) does not fit, so the step prefills r0 alone. The next
    # step admits r1 (a step's first request always goes) and leaves 5: r2 (3) fits, r3 (10) does not.
    result = simulate_requests(traffic([0] * 4, [10, 20, 3, 10], [1] * 4), StaticPolicy(0), serving(), every_round_accepts(4, 0, 1),
                               max_num_seqs=8, max_prefill_tokens=25)
    assert result.steps["batch_size"].tolist() == [1, 2, 1]
    assert result.steps["ms"].tolist() == pytest.approx([10, 2 * 20, 10])
    assert result.requests["ttft_ms"].tolist() == pytest.approx([10, 50, 50, 60])  # output 1: TTFT = e2e
    assert result.requests["e2e_ms"].tolist() == result.requests["ttft_ms"].tolist()


def test_a_request_arriving_during_decoding_is_prefilled_at_the_next_step_and_stalls_the_running_one():
    # r0: prefill 0-10, decode 10-20 (2 tokens). r1 arrives at 15: the step at 20 prefills it (20-30), which
    # stalls r0; the step at 30 decodes both: r0 gets its 3rd token, r1 its 2nd, both done at 40.
    result = simulate_requests(traffic([0, 15], [10, 10], [3, 2]), StaticPolicy(0), serving(), every_round_accepts(2, 0, 1),
                               max_num_seqs=4)
    assert result.requests["ttft_ms"].tolist() == pytest.approx([10, 15])
    assert result.requests["e2e_ms"].tolist() == pytest.approx([40, 25])
    assert result.requests["tpot_ms"].tolist() == pytest.approx([15, 10])
    assert result.steps["kind"].tolist() == ["prefill", "decode", "prefill", "decode"]


def test_the_client_cap_holds_requests_back_and_their_clock_starts_at_arrival():
    # One in flight: r1 arrives at 5 but is sent when r0 finishes (prefill 10 + one round 10 = 20): it waited 15 ms
    # in the client, which its TTFT and e2e count (from its arrival) and the from-send figures do not.
    result = simulate_requests(traffic([0, 5], [10, 10], [2, 2], max_concurrency=1), StaticPolicy(0), serving(),
                               every_round_accepts(2, 0, 1), max_num_seqs=4)
    assert result.requests["send_ms"].tolist() == pytest.approx([0, 20])
    assert result.requests["queue_delay_ms"].tolist() == pytest.approx([0, 15])
    assert result.requests["ttft_ms"].tolist() == pytest.approx([10, 25])
    assert result.requests["e2e_ms"].tolist() == pytest.approx([20, 35])
    assert result.requests["ttft_from_send_ms"].tolist() == pytest.approx([10, 10])
    assert result.requests["e2e_from_send_ms"].tolist() == pytest.approx([20, 20])
    assert result.requests["tpot_ms"].tolist() == pytest.approx([10, 10])  # the same from either clock


def test_overloading_the_client_cap_grows_ttft_from_arrival_and_the_objective_sees_it():
    # 6 requests due at 0 ms, 2 in flight: three waves of 30 ms each (a prefill of 2 x 10 padded tokens, 20 ms, and
    # one round, 10 ms). From the arrival each wave waits 30 ms longer; from the send every request takes 20 ms.
    overloaded = traffic([0] * 6, [10] * 6, [2] * 6, max_concurrency=2)
    result = simulate_requests(overloaded, StaticPolicy(0), serving(), every_round_accepts(6, 0, 1), max_num_seqs=2)
    assert result.requests["ttft_ms"].tolist() == pytest.approx([20, 20, 50, 50, 80, 80])
    assert result.requests["ttft_from_send_ms"].tolist() == pytest.approx([20] * 6)
    assert result.requests["queue_delay_ms"].tolist() == pytest.approx([0, 0, 30, 30, 60, 60])
    assert result.ttft_ms == pytest.approx(50) and result.e2e_ms == pytest.approx(60)  # what the replay objectives score
    roomy = simulate_requests(traffic([0] * 6, [10] * 6, [2] * 6, max_concurrency=6), StaticPolicy(0), serving(),
                              every_round_accepts(6, 0, 1), max_num_seqs=2)
    assert roomy.ttft_ms == pytest.approx(result.ttft_ms)  # the queue moved into the engine: the user waits as long


def test_idle_engine_waits_for_the_next_arrival_and_the_overhead_delays_it():
    result = simulate_requests(traffic([0, 1000], [10, 10], [1, 1]), StaticPolicy(0), serving(overhead=3.0), every_round_accepts(2, 0, 1),
                               max_num_seqs=4)
    assert result.steps["start_ms"].tolist() == pytest.approx([3, 1003])
    assert result.requests["ttft_ms"].tolist() == pytest.approx([13, 13])


def test_chain_drafting_accepts_min_of_the_horizon_draw_and_g_and_cuts_at_the_output_length():
    # Drawn at horizon 5, every round would accept 4 drafts; at g = 2 it accepts 2 and gains 3 tokens. Output 8:
    # 1 token from the prefill, then 3 + 3 + 1 (cut: 1 was left). At g = 5 it accepts 4: 5, then the 2 left.
    draws = every_round_accepts(1, 4, 5)
    result = simulate_requests(traffic([0], [10], [8]), StaticPolicy(2), serving(), draws, max_num_seqs=1)
    assert result.steps.loc[result.steps["kind"] == "decode", "tokens"].tolist() == [3, 3, 1]
    assert result.requests["decode_rounds"].item() == 3
    five = simulate_requests(traffic([0], [10], [8]), StaticPolicy(5), serving(), draws, max_num_seqs=1)
    assert five.steps.loc[five.steps["kind"] == "decode", "tokens"].tolist() == [5, 2]


def test_acceptance_is_read_at_the_requests_output_position():
    # Position p (output tokens so far) decides the draw: the round at p = 1 accepts 0, the one at p = 2 accepts 3.
    accepted = np.zeros((1, 16), dtype=np.int64)
    accepted[0, 2] = 3
    result = simulate_requests(traffic([0], [10], [7]), StaticPolicy(3), serving(), AcceptanceDraws(3, accepted), max_num_seqs=1)
    assert result.steps.loc[result.steps["kind"] == "decode", "tokens"].tolist() == [1, 4, 1]


def test_schedule_policy_picks_g_by_the_running_batch_size():
    # g = 3 alone, g = 0 from two running requests on: the first round (both running) is plain, the last (r0 alone) is not.
    policy = SchedulePolicy(((1, 1, 3), (2, 8, 0)))
    result = simulate_requests(traffic([0, 0], [10, 10], [3, 6]), policy, serving(), every_round_accepts(2, 3, 3), max_num_seqs=4)
    decode = result.steps[result.steps["kind"] == "decode"]
    assert list(zip(decode["batch_size"], decode["steps"])) == [(2, 0), (2, 0), (1, 3)]


def test_adaptive_policy_is_fed_the_accepted_drafts_after_every_verify_as_the_engine_does():
    cfg = AdaptiveConfig(slots={1: SlotConfig(candidate_steps=[1, 2, 3], warmup_batches=0, update_interval=1, ema_alpha=0.5)})
    rng = np.random.default_rng(3)
    accepted = rng.integers(0, 4, size=(3, 64))
    draws = AcceptanceDraws(3, accepted)
    result = simulate_requests(traffic([0, 0, 0], [10, 12, 14], [30, 40, 50]), AdaptiveConfigPolicy(cfg, initial_steps=2, cuda_graph_bs=()),
                               serving(), draws, max_num_seqs=4)
    # Replay the same decode steps by hand: the batch's accepted drafts at the step the policy chose, in order.
    live = AdaptivePolicy.from_config(cfg, 2, cuda_graph_bs=[])
    generated = np.ones(3, dtype=np.int64)
    outputs = np.array([30, 40, 50])
    chosen = []
    for _ in range(len(result.steps[result.steps["kind"] == "decode"])):
        running = np.flatnonzero(generated < outputs)
        g = live.steps_for_batch(len(running))
        chosen.append(g)
        got = np.minimum(accepted[running, generated[running]], g)
        generated[running] += np.minimum(got + 1, outputs[running] - generated[running])
        live.on_verify_complete(got.tolist(), len(running))
    assert result.steps.loc[result.steps["kind"] == "decode", "steps"].tolist() == chosen
    assert len(set(chosen)) > 1  # the policy did switch: the comparison is not vacuous


def test_oracle_of_a_replay_takes_each_steps_most_tokens_per_ms():
    # Accepting 3 of 3 drafts: g = 3 gives 4 tokens in 15 ms, g = 0 one in 10 ms -> g = 3. Accepting none:
    # g = 0 (1 token in 10 ms) beats every g > 0 (1 token in 13+ ms).
    full = simulate_requests(traffic([0], [10], [9]), OraclePolicy(), serving(), every_round_accepts(1, 3, 3), max_num_seqs=1)
    assert set(full.steps.loc[full.steps["kind"] == "decode", "steps"]) == {3}
    none = simulate_requests(traffic([0], [10], [9]), OraclePolicy(), serving(), every_round_accepts(1, 0, 3), max_num_seqs=1)
    assert set(none.steps.loc[none.steps["kind"] == "decode", "steps"]) == {0}


def test_a_policy_stepping_past_the_drawn_horizon_is_an_error():
    with pytest.raises(SpectuneError, match="drawn up to 2 steps but static g=4 chose 4"):
        simulate_requests(traffic([0], [10], [4]), StaticPolicy(4), serving(), every_round_accepts(1, 2, 2), max_num_seqs=1)


def test_draws_are_seeded_follow_each_groups_acceptance_and_positions():
    easy, hard = AcceptanceProfile((0.9,)), AcceptanceProfile((0.1,))
    ramp = PositionalAcceptance((hard, easy), bucket_tokens=8)  # hard for the first 8 output tokens, easy after
    t = traffic([0] * 400, [10] * 400, [32] * 400, groups=["easy"] * 200 + ["ramp"] * 200)
    profiles = {"easy": PositionalAcceptance((easy,)), "ramp": ramp}
    first, again, other = (draw_acceptance(t, profiles, 4, seed) for seed in (7, 7, 8))
    assert np.array_equal(first.accepted, again.accepted) and not np.array_equal(first.accepted, other.accepted)
    mean = lambda rows, cols: first.accepted[rows][:, cols].mean()
    expected = lambda a: sum(a**i for i in range(1, 5))  # E[accepted of 4 drafts] at a constant rate a
    assert mean(slice(0, 200), slice(0, 32)) == pytest.approx(expected(0.9), rel=0.05)
    assert mean(slice(200, 400), slice(0, 8)) == pytest.approx(expected(0.1), rel=0.2)
    assert mean(slice(200, 400), slice(8, 32)) == pytest.approx(expected(0.9), rel=0.05)
    with pytest.raises(SpectuneError, match="no acceptance for group"):
        draw_acceptance(t, {"easy": profiles["easy"]}, 4, 0)


def test_replay_is_deterministic_and_speculation_shortens_a_quiet_requests_e2e():
    t = traffic(np.arange(20) * 200.0, [40] * 20, [32] * 20, max_concurrency=4)
    draws = draw_acceptance(t, {"g": PositionalAcceptance((AcceptanceProfile((0.8,)),))}, 4, seed=1)
    one, two = (simulate_requests(t, StaticPolicy(4), serving(), draws, max_num_seqs=4) for _ in range(2))
    assert one.requests.equals(two.requests) and one.steps.equals(two.steps)
    plain = simulate_requests(t, StaticPolicy(0), serving(), draws, max_num_seqs=4)
    # Requests never overlap here: 3.4 tokens per 16 ms round beat 1 per 10 ms, and the prefill is the same.
    assert one.e2e_ms < plain.e2e_ms and one.ttft_ms == pytest.approx(plain.ttft_ms)


def test_the_server_takes_a_burst_in_one_request_at_a_time_so_the_first_is_prefilled_alone():
    # Three sent at 0, 2 ms of intake each: they reach the engine at 2, 4 and 6. The engine wakes at 2 and
    # prefills r0 (5 ms, to 7); by then r1 and r2 are in: one prefill of both (10 ms, to 17).
    result = simulate_requests(traffic([0, 0, 0], [5, 5, 5], [1, 1, 1]), StaticPolicy(0), serving(overhead=2.0),
                               every_round_accepts(3, 0, 1), max_num_seqs=4)
    assert result.steps["batch_size"].tolist() == [1, 2]
    assert result.requests["ttft_ms"].tolist() == pytest.approx([7, 17, 17])


def test_a_proposer_that_offers_fewer_drafts_caps_what_is_accepted_and_what_is_verified():
    # Two requests, g = 3 asked: one is offered 1 draft, the other 2, and each would accept all 3 at the horizon. The
    # first gains 2 tokens, the second 3, and the step verifies 2 drafts (the most offered): 10 + 2 + 2 = 14 ms.
    accepted = np.full((2, 16), 3)
    offered = np.stack([np.full(16, 1), np.full(16, 2)])
    draws = AcceptanceDraws(3, np.minimum(accepted, offered), offered=offered)
    result = simulate_requests(traffic([0, 0], [10, 10], [4, 4]), StaticPolicy(3), serving(), draws, max_num_seqs=2)
    first = result.steps[result.steps["kind"] == "decode"].iloc[0]
    assert (first.batch_size, first.tokens, first.ms) == (2, 5, pytest.approx(14.0))


def test_drawn_acceptance_never_passes_the_drafts_drawn_as_offered():
    # Every draft offered is accepted; the second draft is offered half the time, the third never.
    profile = PositionalAcceptance((AcceptanceProfile((1.0, 1.0, 1.0)),), offered=(0.5, 0.0))
    draws = draw_acceptance(traffic([0] * 200, [10] * 200, [8] * 200), {"g": profile}, horizon=3, seed=0)
    assert set(np.unique(draws.offered)) == {1, 2}
    assert (draws.accepted == draws.offered).all()
    assert 0.4 < (draws.offered == 2).mean() < 0.6
    plain = draw_acceptance(traffic([0] * 5, [10] * 5, [8] * 5), {"g": PositionalAcceptance((AcceptanceProfile((1.0, 1.0, 1.0)),))},
                            horizon=3, seed=0)
    assert plain.offered is None and (plain.accepted == 3).all()


def test_stream_ends_slow_the_next_decode_step_not_a_prefill():
    # finish_ms = 5 per request that finished at the step before, fitted on decode steps. r0 finishes at 30; the step
    # after it prefills r2 (10 ms, not 15: its tensor work leaves the interpreter free for the stream end); r2 then
    # finishes at 50 and the decode after it pays 10 + 5.
    cost = ServingCost(decode=FLAT, prefill_fixed_ms=0.0, prefill_per_token_ms=1.0, request_overhead_ms=0.0, finish_ms=5.0)
    result = simulate_requests(traffic([0, 0, 25], [10, 10, 10], [2, 4, 2]), StaticPolicy(0), cost, every_round_accepts(3, 0, 1),
                               max_num_seqs=4)
    assert result.steps[["kind", "ms"]].values.tolist() == [["prefill", 20.0], ["decode", 10.0], ["prefill", 10.0], ["decode", 10.0],
                                                            ["decode", 15.0]]
