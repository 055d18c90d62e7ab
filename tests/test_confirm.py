"""The measured paired confirmation (spectune.confirm): its statistics (Student-t quantiles, alpha spending, the
stopping rule on per-pass data recorded from real confirmation runs) and the verdict's words."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import scipy.stats

from spectune.confirm import (
    ALPHA,
    COMPARED,
    NARROW_PCT,
    Difference,
    action_text,
    decide,
    look_alphas,
    look_schedule,
    mark_disturbed,
    spent_alpha,
    t_quantile,
    to_pct,
    verdict_text,
)
from spectune.errors import SpectuneError

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 12, 19, 40])
@pytest.mark.parametrize("p", [0.975, 0.99, 0.995, 0.9995, 0.99995])
def test_t_quantile_matches_scipy(p, df):
    assert t_quantile(p, df) == pytest.approx(scipy.stats.t.ppf(p, df), rel=2e-4)


def test_spending_function_is_obrien_fleming_type_and_spends_alpha_exactly_by_the_cap():
    assert spent_alpha(1.0) == pytest.approx(ALPHA)
    assert spent_alpha(0.25) < 1e-3 < spent_alpha(0.5) < spent_alpha(0.75) < ALPHA  # strict early, near nominal late
    looks = look_schedule(4, 20)
    assert looks == (5, 10, 15, 20)
    alphas = look_alphas(looks, 20)
    assert sum(alphas) == pytest.approx(ALPHA) and all(a > 0 for a in alphas)
    assert look_schedule(4, 6) == (4, 5, 6) and look_schedule(2, 2) == (2,)
    with pytest.raises(SpectuneError, match="min-passes"):
        look_schedule(5, 4)


def test_gain_to_percent_is_the_metrics_relative_improvement():
    # e2e 100 ms for the other server, 90 ms tuned: gain log(100/90), 10% lower latency
    assert to_pct(math.log(100 / 90), higher_is_better=False) == pytest.approx(10.0)
    # tokens/s 110 tuned vs 100: 10% more
    assert to_pct(math.log(110 / 100), higher_is_better=True) == pytest.approx(10.0)


def _recorded() -> dict[str, tuple[pd.DataFrame, bool]]:
    """Per-pass gains (log-ratios, > 0: tuned better) recorded from real `spectune confirm` runs (tests/data/README.md),
    and whether the run's metric is higher-is-better."""
    frame = pd.read_csv(DATA / "confirm_passes.csv")
    return {run: (g.set_index("pass")[list(COMPARED)], bool(g["higher_is_better"].iloc[0])) for run, g in frame.groupby("run")}


def test_recorded_runs_are_real_confirmations():
    runs = _recorded()
    assert runs and all(len(g) >= 4 for g, _ in runs.values())


@pytest.mark.parametrize("run", sorted(_recorded()))
def test_stopping_rule_on_recorded_passes_stops_only_at_looks_and_only_when_settled_or_capped(run):
    gains, higher = _recorded()[run]
    max_passes = len(gains)
    looks = look_schedule(4, max_passes)
    for n in range(2, max_passes + 1):
        decision = decide(gains.iloc[:n], COMPARED, higher, 4, max_passes)
        settled = all(d.excludes_zero or d.width_pct < NARROW_PCT for d in decision.differences)
        assert decision.stop == (n == max_passes or (n in looks and settled))
        for d in decision.differences:
            assert d.lo_pct <= d.mean_pct <= d.hi_pct
            # the interval is the t-interval at the level the look spends, in the metric's percent
            level = decision.differences[0].level
            g = gains[d.name].iloc[:n].to_numpy()
            half = scipy.stats.t.ppf(1 - (1 - level) / 2, n - 1) * g.std(ddof=1) / math.sqrt(n)
            assert d.lo_pct == pytest.approx(to_pct(g.mean() - half, higher), rel=1e-3, abs=1e-3)  # t_quantile: rel 2e-4
            assert d.hi_pct == pytest.approx(to_pct(g.mean() + half, higher), rel=1e-3, abs=1e-3)


@pytest.mark.parametrize("run", sorted(_recorded()))
def test_verdict_never_claims_a_win_when_the_interval_holds_zero(run):
    gains, higher = _recorded()[run]
    for n in range(2, len(gains) + 1):
        decision = decide(gains.iloc[:n], COMPARED, higher, 4, len(gains))
        text = verdict_text(decision.differences, "mean e2e latency", n, "measured", False, static_steps=2)
        by_name = {d.name: d for d in decision.differences}
        hardest_static = min((by_name["static"], by_name["target"]), key=lambda d: d.mean_pct)
        for d, label in ((by_name["sglang-default"], "SGLang's default"), (hardest_static, "the best static config")):
            if d.lo_pct <= 0 <= d.hi_pct:
                assert f"not distinguishable from {label}" in text and f"better than {label}" not in text
            elif d.lo_pct > 0:
                assert f"better than {label}" in text and f"by {abs(d.mean_pct):.1f}% [{d.lo_pct:.1f}, {d.hi_pct:.1f}]" in text
            else:
                assert f"worse than {label}" in text and "better than " + label not in text


def _diff(name: str, lo: float, hi: float) -> Difference:
    return Difference(name, COMPARED[name], 12, (lo + hi) / 2, lo, hi, 0.98)


def test_action_deploys_only_what_the_intervals_settle():
    better = (_diff("sglang-default", 1.0, 3.0), _diff("static", 4.0, 6.0), _diff("target", 0.5, 2.0))
    assert action_text(better, finished=False).startswith("Not settled yet")
    assert action_text(better, finished=True) == ("Deploy the tuned adaptive_spec.json: it measured better than SGLang's "
                                                  "default on this traffic.")
    noisy_static = (_diff("sglang-default", 1.0, 3.0), _diff("static", 4.0, 6.0), _diff("target", -1.0, 2.0))
    assert "against the best static config the difference is within noise" in action_text(noisy_static, finished=True)
    tie = (_diff("sglang-default", -1.0, 1.5), _diff("static", 4.0, 6.0), _diff("target", 1.0, 2.0))
    assert action_text(tie, finished=True).startswith("Either will do") and "Deploy" not in action_text(tie, finished=True)
    lost = (_diff("sglang-default", -3.0, -1.0), _diff("static", 4.0, 6.0), _diff("target", -6.0, -4.0), )
    assert action_text(lost, finished=True).startswith("Deploy target-only (no speculation)")  # it beat the tuned config by most
    lost_to_g = (_diff("sglang-default", -3.0, -1.0), _diff("static", -8.0, -4.0), _diff("target", 1.0, 2.0))
    assert action_text(lost_to_g, finished=True, static_steps=2).startswith("Deploy static g=2")
    lost_to_default = (_diff("sglang-default", -3.0, -1.0), _diff("static", 4.0, 6.0), _diff("target", -1.0, 2.0))
    assert action_text(lost_to_default, finished=True).startswith("Deploy SGLang's default config")


def test_a_tuned_config_running_the_best_static_steps_is_called_the_same_not_a_tie_with_noise():
    same = (_diff("sglang-default", 7.3, 10.8), _diff("static", 0.0, 0.0), _diff("target", 30.0, 40.0))
    text = verdict_text(same, "output tokens/s", 1000, "simulated", False, static_steps=4)
    assert "better than SGLang's default" in text
    assert "the same as the best static config (static g=4) on this traffic (+0.0%, no spread" in text
    assert "not distinguishable" not in text
    near = (_diff("sglang-default", 7.3, 10.8), _diff("static", -0.1, 0.1), _diff("target", 30.0, 40.0))
    assert "not distinguishable from the best static config" in verdict_text(near, "output tokens/s", 1000, "simulated", False)


@pytest.mark.parametrize("run", sorted(_recorded()))
def test_action_on_recorded_passes_never_deploys_the_tuned_config_on_noise(run):
    gains, higher = _recorded()[run]
    for n in range(2, len(gains) + 1):
        decision = decide(gains.iloc[:n], COMPARED, higher, 4, len(gains))
        action = action_text(decision.differences, decision.stop, static_steps=2)
        default = next(d for d in decision.differences if d.name == "sglang-default")
        assert ("Deploy the tuned" in action) == (decision.stop and default.lo_pct > 0
                                                  and all(d.hi_pct >= 0 for d in decision.differences))


def test_confirm_refuses_a_sweep_of_attached_servers_before_measuring(tmp_path):
    """Attached servers run one config each: confirm would measure 'tuned', 'SGLang's default' and 'static g' on the
    very same running server (it did: all four attached to one url) and call that a verdict."""
    from spectune.confirm import confirm_plan

    plan = {"name": "att", "batch_sizes": [1, 4], "servers": [
        {"name": "target", "engine": "embedded", "url": "http://127.0.0.1:8101"},
        {"name": "eagle3", "engine": "embedded", "method": "eagle", "num_speculative_tokens": 3, "url": "http://127.0.0.1:8102"}]}
    tuning = {"engine": "embedded", "method": "eagle", "policies": {"static_speedups": {"1": 1.1, "2": 1.2, "3": 1.15}}}
    with pytest.raises(SpectuneError, match="the sweep attached target and eagle3 by url; confirm launches each config"):
        confirm_plan({"plan": plan}, tuning, tmp_path / "tuned", tmp_path / "confirm", None)
    assert not (tmp_path / "confirm").exists()  # nothing written
    launched = {**plan, "servers": [{k: v for k, v in s.items() if k != "url"} for s in plan["servers"]]}
    servers, _ = confirm_plan({"plan": launched}, tuning, tmp_path / "tuned", tmp_path / "confirm", None)
    assert [s["name"] for s in servers] == ["target", "static-g2", "tuned", "sglang-default"] and not any("url" in s for s in servers)


def test_action_when_every_attempt_was_run_says_another_call_adds_nothing():
    from spectune.confirm import DEFAULT, Difference, action_text

    diffs = (Difference(DEFAULT, "SGLang's default", 14, 0.9, -0.6, 2.5, 0.98),)
    assert "run spectune confirm RESULTS again" in action_text(diffs, finished=False)
    exhausted = action_text(diffs, finished=False, exhausted=True)
    assert "again" not in exhausted.split(";")[0] and "quieter machine" in exhausted and "Deploy" not in exhausted


def _speed_table(interleaved: bool) -> pd.DataFrame:
    """Five passes of three servers at one batch size; pass 2 ran 30% slower throughout, pass 3's tuned cell alone."""
    servers = ("tuned", "sglang-default", "target")
    speed = {(p, s): 1.3 if p == 2 or (p, s) == (3, "tuned") else 1.0 for p in range(1, 6) for s in servers}
    return pd.DataFrame([{"pass": p, "server": s, "batch_size": 4, "request_rate": 0.0, "speed_index": v, "foreign_cpu_cores": 0.0,
                          "interleaved": interleaved} for (p, s), v in speed.items()])


def test_a_slowdown_every_cell_of_an_interleaved_pass_shared_leaves_it_counted():
    """Passes one server after another: a pass slower than the servers' median passes is disturbed. Interleaved (each
    batch size's cells back to back), a slowdown all its cells shared cancels in their differences; only a cell slower
    than its neighbours disturbs the pass."""
    def disturbed(t):
        return mark_disturbed(t, 0.5, 0.15).groupby("pass")["disturbed"].first().to_dict()

    calm = {1: False, 4: False, 5: False}
    assert disturbed(_speed_table(interleaved=False)) == {**calm, 2: True, 3: True}
    assert disturbed(_speed_table(interleaved=True)) == {**calm, 2: False, 3: True}
    busy = _speed_table(interleaved=True)
    busy.loc[(busy["pass"] == 2) & (busy["server"] == "target"), "foreign_cpu_cores"] = 0.9
    assert disturbed(busy) == {**calm, 2: True, 3: True}  # other work on the machine disturbs a pass either way


def test_an_interleaved_pass_is_disturbed_only_beyond_the_hosts_own_spread():
    """On a host whose cells routinely differ by 10% back to back, a cell 27% slower than its neighbours' median is
    within that spread (3 robust SDs), not a disturbance; one 80% slower is."""
    slower = {(3, "tuned"): 1.4, (6, "tuned"): 2.0}
    rows = [{"pass": p, "server": s, "batch_size": 4, "request_rate": 0.0, "speed_index": wobble * slower.get((p, s), 1.0), "foreign_cpu_cores": 0.0,
             "interleaved": True} for p in range(1, 9) for s, wobble in zip(("tuned", "sglang-default", "target"), (1.0, 1.1, 0.9))]
    table = mark_disturbed(pd.DataFrame(rows), 0.5, 0.15)
    assert table.groupby("pass")["disturbed"].first().to_dict() == {p: p == 6 for p in range(1, 9)}
