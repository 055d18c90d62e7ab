"""A closed-loop cell's drain (spectune.drain): the fluid closed loop, and the held-out check with it, on SYNTHETIC cells
from a known model whose measured throughput includes the drain."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from spectune.drain import closed_loop, fit_steady, request_speeds
from spectune.guided import predict_unmeasured
from spectune.holdout import holdout_predictions
from synthetic_sweep import SHARE_COST as SHARE, SYNTHETIC_PROFILES, synthetic_cells


def test_requests_in_lockstep_or_one_slot_lose_nothing_to_the_drain():
    assert closed_loop(np.full(12, 2.3), 4, lambda b: 5.0).share == pytest.approx(1.0)
    assert closed_loop(np.full(12, 2.3), 4, lambda b: 5.0).occupancy == pytest.approx(1.0)
    assert closed_loop(np.array([1.0, 3.0, 2.0]), 1, lambda b: 5.0).share == 1.0


def test_a_tail_costs_its_idle_slots_unless_a_round_costs_in_proportion_to_the_batch():
    # two requests on two slots, one twice as fast: half of the window runs one request
    drain = closed_loop(np.array([1.0, 2.0]), 2, lambda b: 1.0)
    assert (drain.share, drain.occupancy) == pytest.approx((0.75, 0.75))
    # a round costing in proportion to the batch: one request alone goes twice as fast, and no throughput is lost, but
    # one slot stands idle for the last third of the window (2.5 request-ms of 3 slot-ms)
    drain = closed_loop(np.array([1.0, 2.0]), 2, lambda b: float(b))
    assert drain.share == pytest.approx(1.0) and drain.occupancy == pytest.approx(2.5 / 3.0)


def test_request_speeds_are_tokens_per_chunk_after_the_first_in_send_order():
    requests = pd.DataFrame({"cell": ["a", "a", "a", "b"], "index": [1, 0, 2, 0], "output_tokens": [9, 17, 9, 5],
                             "num_chunks": [5, 5, 1, 3], "error": [None, None, None, None]})
    speeds = request_speeds(requests)
    assert list(speeds) == ["a", "b"]
    assert speeds["a"].tolist() == [4.0, 2.0]  # index 0 then 1; index 2 streamed one chunk and says nothing
    assert speeds["b"].tolist() == [2.0]


def drained_cells() -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """Synthetic cells whose tok/s is the known steady figure times each cell's simulated drain: every prompt has its
    own speed (the same prompt by index in every cell, as a closed loop sends them), target-only runs in lockstep."""
    cells = synthetic_cells(cost=SHARE, profiles={"quote": SYNTHETIC_PROFILES["quote"]}, repeats=1, noise=0.0)
    cells = cells[cells["status"] == "ok"].copy()
    cells["cell"] = [f"{s}__bs{b}__r{r}" for s, b, r in zip(cells["server"], cells["batch_size"], cells["repeat"])]
    relative = np.tile([1.5, 0.6, 1.2, 0.8, 1.0, 0.7, 1.3, 0.9], 8)
    speeds = {}
    for i in cells.index[cells["is_speculative"].astype(bool)]:
        g, bs = int(cells.at[i, "num_speculative_tokens"]), int(cells.at[i, "batch_size"])
        speeds[cells.at[i, "cell"]] = relative[: int(cells.at[i, "num_requests"])] * (1.0 + g / 2)
        cells.at[i, "output_throughput_tps"] *= closed_loop(speeds[cells.at[i, "cell"]], bs, lambda b: SHARE.t_round(b, g)).share
    return cells, speeds


def test_the_fit_on_steady_throughput_gets_the_known_round_cost_back():
    cells, speeds = drained_cells()
    steady, _ = fit_steady(cells, speeds)
    for bs in (2, 4, 8):
        for g in (1, 4):
            assert steady.cost.t_round(bs, g) == pytest.approx(SHARE.t_round(bs, g), rel=1e-3)


def test_a_held_out_batch_size_is_predicted_with_its_own_drain():
    cells, speeds = drained_cells()
    with_drain = holdout_predictions(cells, speeds)
    without = holdout_predictions(cells)
    inside = lambda p: p[(p["holdout"] == "batch_size") & ~p["extrapolated"]]["throughput_abs_pct_error"]
    assert inside(with_drain).max() < 0.5  # the drain of batch 2, 4 and 8 simulated, not interpolated
    assert inside(without).mean() > 3 * inside(with_drain).mean()


def test_the_guided_sweeps_predictions_of_unmeasured_cells_carry_their_drain():
    cells, speeds = drained_cells()
    spec = cells["is_speculative"].astype(bool)
    grid = cells.drop_duplicates(["server", "batch_size"])[["server", "method", "num_speculative_tokens", "batch_size"]]
    grid = grid.rename(columns={"num_speculative_tokens": "g"}).assign(method=lambda d: d["method"].where(d["g"] > 0, None))
    held = spec & (cells["batch_size"] == 4)  # batch 4's speculative cells not measured: its drain is not interpolated
    measured = cells[~held]
    pairs = set(zip(measured["server"], measured["batch_size"].astype(int)))
    truth = cells[held].set_index("server")["output_throughput_tps"]
    error = lambda p: ((p.set_index("server")["predicted_tps"] - truth) / truth).abs()
    with_drain = predict_unmeasured(measured, grid, pairs, {c: s for c, s in speeds.items() if c in set(measured["cell"])})
    without = predict_unmeasured(measured, grid, pairs)
    assert set(with_drain["batch_size"]) == {4} and len(with_drain) == held.sum()
    assert error(with_drain).max() < 0.005
    assert error(without).mean() > 3 * error(with_drain).mean()


def test_a_held_out_batch_size_s_tpot_follows_its_simulated_occupancy():
    cells, speeds = drained_cells()
    for i in cells.index[cells["is_speculative"].astype(bool)]:  # TPOT: a request's time per token, 90% of it decode
        g, bs = int(cells.at[i, "num_speculative_tokens"]), int(cells.at[i, "batch_size"])
        window_ms = 1000.0 * bs / cells.at[i, "output_throughput_tps"]
        cells.at[i, "tpot_ms_mean"] = 0.9 * window_ms * closed_loop(speeds[cells.at[i, "cell"]], bs, lambda b: SHARE.t_round(b, g)).occupancy
    with_drain = holdout_predictions(cells, speeds)
    without = holdout_predictions(cells)
    inside = lambda p: p[(p["holdout"] == "batch_size") & ~p["extrapolated"]]["tpot_abs_pct_error"]
    assert inside(with_drain).max() < 0.5
    assert inside(without).mean() > 3 * inside(with_drain).mean()
