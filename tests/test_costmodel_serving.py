"""Step costs and acceptance for the request-level replay, fitted from hand-written engine round logs (known walls)
and request-rounds (known acceptance)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from spectune.costmodel import (
    MIN_BUCKET_ROUNDS,
    MIN_STEP_LINES,
    POSITION_BUCKET_TOKENS,
    fit_positional_acceptance,
    fit_round_acceptance,
    fit_serving_cost,
    read_step_log,
)
from spectune.errors import SpectuneError

# Truth: decode wall = target(bs) + [g > 0] (fixed(bs) + per_step(bs) g); prefill wall = 1 + 0.1 x padded tokens.
TARGET, FIXED, PER_STEP = {1: 2.0, 4: 4.0}, {1: 0.0, 4: 1.0}, {1: 1.0, 4: 0.5}
PREFILL_FIXED, PREFILL_PER_TOKEN = 1.0, 0.1


def decode_wall(bs: int, g: int) -> float:
    return TARGET[bs] + (FIXED[bs] + PER_STEP[bs] * g if g else 0.0)


def write_log(path, steps: list[tuple[float, dict]]) -> None:
    """Lines as the engine writes them: t_s at the end of each step, wall by wall."""
    t, lines = 0.0, []
    for wall_ms, line in steps:
        t += wall_ms / 1000.0
        lines.append({"t_s": round(t, 9), **line})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def decode_line(bs: int, g: int) -> tuple[float, dict]:
    return decode_wall(bs, g), {"batch_size": bs, "num_steps": g, "proposed": [g] * bs, "accepted": [0] * bs, "round_ms": 1.0}


def prefill_line(prompts: list[int], running: int, idle_ms: float = 0.0) -> tuple[float, dict]:
    wall = PREFILL_FIXED + PREFILL_PER_TOKEN * len(prompts) * max(prompts)
    return idle_ms + wall, {"prefill": True, "batch_size": len(prompts), "prompt_tokens": prompts, "num_running": running}


def test_serving_cost_fit_recovers_known_walls_and_ignores_idle_gaps(tmp_path):
    method, target = tmp_path / "ngram.jsonl", tmp_path / "target.jsonl"
    steps = []
    for bs in (1, 4):
        for g in (1, 3):
            steps += [decode_line(bs, g)] * MIN_STEP_LINES
    steps += [decode_line(4, 2)] * (MIN_STEP_LINES - 1)  # too few lines to trust: left out (it would fit the same line anyway)
    steps += [prefill_line([50, 20], running=3), prefill_line([80], running=1), prefill_line([10, 40, 30], running=2)]
    steps += [prefill_line([60], running=0, idle_ms=500.0)]  # after an idle engine: its gap is not its wall
    write_log(method, steps)
    write_log(target, [prefill_line([7], running=0)] + [decode_line(bs, 0) for bs in (1, 4) for _ in range(MIN_STEP_LINES)])
    first = pd.DataFrame({"prompt_tokens": [20, 40, 60], "ttft_ms": [3.0 + PREFILL_FIXED + PREFILL_PER_TOKEN * p for p in (20, 40, 60)]})

    log = read_step_log(method)
    assert log["kind"].value_counts().to_dict() == {"decode": 4 * MIN_STEP_LINES + MIN_STEP_LINES - 1, "prefill": 4}
    assert np.isnan(log["wall_ms"].iloc[-1]) and log["padded_tokens"].iloc[-2] == 3 * 40

    cost = fit_serving_cost(log, read_step_log(target), (1, 4), first)
    assert cost.decode.batch_sizes == (1, 4)
    for bs in (1, 4):
        for g in (0, 1, 2, 3, 5):
            assert cost.decode.t_round(bs, g) == pytest.approx(decode_wall(bs, g), abs=1e-6)
    assert (cost.prefill_fixed_ms, cost.prefill_per_token_ms) == pytest.approx((PREFILL_FIXED, PREFILL_PER_TOKEN), abs=1e-6)
    assert cost.t_prefill([10, 30]) == pytest.approx(PREFILL_FIXED + PREFILL_PER_TOKEN * 60)
    assert cost.request_overhead_ms == pytest.approx(3.0)


def test_serving_cost_fit_needs_logged_prefills_and_target_steps(tmp_path):
    old = tmp_path / "old.jsonl"
    write_log(old, [decode_line(1, 1)] * 3)  # written before the engine logged prefill steps
    with pytest.raises(SpectuneError, match="no prefill steps logged; sweep again"):
        read_step_log(old)
    method, target = tmp_path / "m.jsonl", tmp_path / "t.jsonl"
    write_log(method, [decode_line(1, 1)] * MIN_STEP_LINES + [prefill_line([5], running=1)] * 3)
    write_log(target, [prefill_line([5], running=0)] + [decode_line(4, 0)] * MIN_STEP_LINES)  # g = 0 only at batch 4
    none = pd.DataFrame({"prompt_tokens": [], "ttft_ms": []})
    with pytest.raises(SpectuneError, match="no batch size has 10\\+ logged decode steps of both"):
        fit_serving_cost(read_step_log(method), read_step_log(target), (1, 4), none)


def test_round_acceptance_pools_survival_over_rounds_that_ran_each_position():
    # g = 1 rounds say nothing about draft 2. S_1 = 6/8 over all rounds, S_2 = 2/4 over the g = 2 rounds.
    accepted = np.array([1, 1, 1, 0, 2, 2, 1, 0])
    steps = np.array([1, 1, 1, 1, 2, 2, 2, 2])
    profile = fit_round_acceptance(accepted, steps)
    assert profile.rates == pytest.approx((6 / 8, (2 / 4) / (6 / 8)))


def test_positional_acceptance_follows_the_output_and_falls_back_on_thin_stretches():
    rng = np.random.default_rng(0)
    n = 3 * MIN_BUCKET_ROUNDS
    # Stretch 0 (output tokens 0-7) never accepts, stretch 1 always does; stretch 2 has too few rounds to stand alone.
    positions = np.concatenate([rng.integers(0, 8, n), rng.integers(8, 16, n), rng.integers(16, 24, MIN_BUCKET_ROUNDS - 1)])
    accepted = np.where(positions < 8, 0, 2)
    steps = np.full(len(positions), 2)
    fitted = fit_positional_acceptance(accepted, steps, positions)
    assert fitted.bucket_tokens == POSITION_BUCKET_TOKENS and len(fitted.by_bucket) == 3
    assert fitted.by_bucket[0].rates[0] == 0.0 and fitted.by_bucket[1].rates == pytest.approx((1.0, 1.0))
    assert fitted.by_bucket[2] == fit_round_acceptance(accepted, steps)  # the whole output's
    rates = fitted.rate_matrix(40, 3)  # [P, H]: positions past the last stretch keep the last one's rates
    assert rates.shape == (40, 3) and (rates[:8, 0] == 0).all() and (rates[8:16] == 1).all()
    np.testing.assert_array_equal(rates[39], rates[16])
