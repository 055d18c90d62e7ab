"""The exhaustive grid over SGLang's policy space (spectune.exhaustive): its vectorised slot simulation decides
exactly as spectune.adaptive (itself checked against SGLang's released code), it holds the tuned config, and on the
tuning bench it never scores below the Optuna search."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from spectune.adaptive import AdaptiveConfig, SlotState
from spectune.comparisons import compare, proxy_rounds
from spectune.costmodel import RoundCost
from spectune.exhaustive import (
    CONTINUOUS,
    Rounds,
    continuous_grid,
    grid_search,
    ladders,
    make_candidates,
    partitions,
    rounds_from_accepted,
    simulate_slots,
)
from spectune.scoring import make_bench
from spectune.search import CEILINGS
from spectune.store import load_run
from spectune.tune import TuneOptions, tune
from synthetic_sweep import write_synthetic_results


def _random_rounds(seed: int, num_rounds: int = 300, horizon: int = 5) -> tuple[Rounds, np.ndarray]:
    """Rounds of random batch sizes and acceptance (a property check of the decisions, not a measurement), two runs."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 9, num_rounds)
    accepted = rng.integers(0, horizon + 1, (num_rounds, 8)) * (rng.random((num_rounds, 8)) < 0.6)
    cost = RoundCost(batch_sizes=(1, 8), target_ms=(2.0, 9.0), draft_fixed_ms=(0.5, 1.0), per_step_ms=(0.2, 1.5))
    first = rounds_from_accepted(sizes[:200], accepted[:200], None, cost, 0, horizon)
    second = rounds_from_accepted(sizes[200:], accepted[200:], None, cost, 1, horizon)
    return Rounds(*(np.concatenate([getattr(first, f), getattr(second, f)]) for f in ("batch_size", "tokens", "ms", "obs", "run", "window"))), accepted


@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_slots_decide_exactly_as_the_policy_round_by_round(seed):
    rounds, accepted = _random_rounds(seed)
    options = [(lad, c) for lad in ladders(5) for c in (CEILINGS if len(lad) > 1 else (0.0,))]
    grid = continuous_grid()
    picked = [grid[i] for i in np.random.default_rng(seed).choice(len(grid), 8, replace=False)]
    cands = make_candidates(options, picked)
    mask = rounds.batch_size >= 3  # the rounds a slot with bound 3 (and none above) is routed
    _, chosen = simulate_slots(cands, rounds, mask)
    routed = np.flatnonzero(mask)
    for i in range(len(cands)):
        state, run = None, None
        for k, r in enumerate(routed):
            if run != rounds.run[r]:  # each run starts a fresh policy
                state, run = SlotState.start(cands.slot(i), launch_steps=-1), rounds.run[r]
            assert chosen[i, k] == state.steps, f"candidate {cands.slot(i)} round {k}"
            state.observe([int(min(a, state.steps)) for a in accepted[r, : rounds.batch_size[r]]])


def test_grid_enumerates_every_ladder_ceiling_and_slot_partition():
    assert len(ladders(3)) == 10 + 3  # 10 contiguous runs of 0..3, 3 with an every-other-rung form (0-2, 0-3, 1-3)
    assert (0, 2, 3) in ladders(3) and (0, 1, 2, 3) in ladders(3)
    bounds = partitions((1, 4, 16))
    assert sorted(bounds) == [(1,), (1, 4), (1, 4, 16), (1, 16)]
    assert len(continuous_grid()) == int(np.prod([len(v) for v in CONTINUOUS.values()]))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return write_synthetic_results(tmp_path_factory.mktemp("synthetic") / "synthetic-run")


def test_on_the_tuning_bench_the_grid_holds_the_tuned_config_and_never_scores_below_the_search(synthetic, tmp_path, monkeypatch):
    # A smaller continuous grid keeps this test short; the tuned config's own values are added to it either way.
    monkeypatch.setattr("spectune.exhaustive.CONTINUOUS", {"ema_alpha": (0.2, 0.5), "update_interval": (1, 5), "warmup_batches": (10,),
                                                          "down_hysteresis": (-0.25,), "up_hysteresis": (0.0,)})
    results = Path(shutil.copytree(synthetic, tmp_path / "run"))
    tune(TuneOptions(results_dir=results, trials=25, seed=0, draft_model="models/draft"), log=lambda _: None)
    report = json.loads((results / "tuned" / "tuning.json").read_text())
    tuned = AdaptiveConfig.from_dict(report["policies"]["tuned_adaptive"])
    exhaustive = report["exhaustive"]
    assert exhaustive["best_speedup"] >= exhaustive["tuned_speedup"] - 1e-12
    assert exhaustive["tuned_speedup"] == pytest.approx(next(c["speedup"] for c in report["comparisons"] if c["name"] == "tuned_adaptive"))
    assert 0 < exhaustive["search_share"] <= 1 + 1e-9
    assert "the search found" in exhaustive["text"] and "hindsight oracle" in exhaustive["text"]
    # Every slot of the tuned config is a point of the grid: its ladder and ceiling among the options, its continuous
    # values among the combinations, its bounds among the partitions.
    run = load_run(results)
    bench = make_bench(run, "throughput", 0)
    options = {(lad, c) for lad in ladders(bench.fit.max_steps) for c in (CEILINGS if len(lad) > 1 else (0.0,))}
    for slot in tuned.slots.values():
        assert (tuple(slot.candidate_steps), slot.ceiling_coeff) in options
    assert tuple(sorted(tuned.slots)) in partitions(bench.fit.cost.batch_sizes)


def test_grid_search_rescores_its_best_on_the_bench_and_includes_the_tuned_config(synthetic):
    bench = make_bench(load_run(synthetic), "throughput", 0)
    summary, policies = compare(bench, _two_slot_config())
    tuned = _two_slot_config()
    scored = []

    def score(cfg):
        scored.append(cfg)
        return bench.score(bench.adaptive(cfg)).speedup

    small = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10, "down_hysteresis": -0.25, "up_hysteresis": 0.0}
    import spectune.exhaustive as ex

    saved = ex.CONTINUOUS
    ex.CONTINUOUS = {k: (v,) for k, v in small.items()}
    try:
        result = grid_search(proxy_rounds(bench, tuned), bench.fit.cost.batch_sizes, bench.fit.max_steps, score, tuned, top_exact=5)
    finally:
        ex.CONTINUOUS = saved
    assert any(c.to_dict() == tuned.to_dict() for c in scored)
    assert result.best_speedup == pytest.approx(max(result.exact["speedup"]))
    assert result.best_speedup >= bench.score(bench.adaptive(tuned)).speedup - 1e-12
    # The proxy ranks: its first pick scores at least as well as the presets of SGLang.
    assert result.exact.iloc[0]["speedup"] >= summary.set_index("name").loc["sglang_default", "speedup"] - 1e-9


def _two_slot_config() -> AdaptiveConfig:
    return AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 2, 3]}, "8": {"candidate_steps": [0, 1]}})
