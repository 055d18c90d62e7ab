"""spectune.refine: the config that keeps, at each measured batch size, the slots of the confirmed config that measured
best there, must run exactly what that config runs over the batch-size range (checked through SGLang-exact routing,
spectune.adaptive), and `spectune tune --refine` must refuse what it cannot refine from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectune.adaptive import SGLANG_DEFAULT_CONFIG, AdaptiveConfig, AdaptivePolicy, SlotConfig, runs_alike
from spectune.confirm import batch_size_gains, default_out_dir, split_text
from spectune.errors import SpectuneError
from spectune.refine import choose_slots, merge_slots, refine, round_in, slot_sources

TUNED = AdaptiveConfig({1: SlotConfig([7]), 4: SlotConfig([6, 7], ema_alpha=0.4), 16: SlotConfig([2, 4]),
                        32: SlotConfig([0, 2, 4, 5], ceiling_coeff=1.67)})


def _row(b: int, **gain_pct: float) -> dict:
    """A verdict row: the tuned config's gain (%) over each role ('_' for '-' in names)."""
    return {"batch_size": b, "gain_pct": {k.replace("_", "-"): v for k, v in gain_pct.items()}}


def _slot_at(cfg: AdaptiveConfig, batch_size: int) -> SlotConfig:
    policy = AdaptivePolicy(cfg, initial_steps=sorted({s for x in cfg.slots.values() for s in x.candidate_steps})[-1], cuda_graph_bs=[])
    return cfg.slots[policy.slot_for_batch(batch_size)]


def test_each_batch_size_keeps_the_role_the_tuned_config_did_worst_against():
    rows = [_row(1, sglang_default=-4.0, static=1.0, target=30.0), _row(4, sglang_default=2.0, static=3.0, target=25.0),
            _row(16, sglang_default=-1.0, static=-2.5, target=10.0), _row(64, sglang_default=9.0, static=-0.5, target=-0.4)]
    kept = [c.kept for c in choose_slots(rows)]
    assert kept == ["sglang-default", "tuned", "static", "static"]
    assert choose_slots([_row(1, sglang_default=0.0, static=0.0, target=0.0)])[0].kept == "tuned"  # a tie keeps what is tuned


def test_merged_config_runs_each_sources_own_slots_over_its_range():
    sources = slot_sources(TUNED, static_steps=3)
    rows = [_row(1, sglang_default=-4.0, static=1.0, target=30.0), _row(4, sglang_default=-2.0, static=3.0, target=25.0),
            _row(16, sglang_default=-1.0, static=2.0, target=10.0), _row(64, sglang_default=9.0, static=4.0, target=8.0)]
    choices = choose_slots(rows)
    merged = merge_slots(choices, sources)
    # default from 1 to 63 (its own bounds 8 and 32 inside), tuned from 64 on (its slot that routes 64: bs >= 32)
    assert sorted(merged.slots) == [1, 8, 32, 64]
    for b in range(1, 200):
        source = SGLANG_DEFAULT_CONFIG if b < 64 else TUNED
        assert _slot_at(merged, b) == _slot_at(source, b), b
    json.loads(json.dumps(merged.to_dict()))
    assert AdaptiveConfig.from_dict(merged.to_dict()).to_dict() == merged.to_dict()  # valid SGLang JSON


def test_static_and_target_roles_become_one_rung_ladders_and_equal_neighbours_merge():
    rows = [_row(1, sglang_default=5.0, static=-3.0, target=20.0), _row(16, sglang_default=5.0, static=-1.0, target=10.0),
            _row(64, sglang_default=5.0, static=4.0, target=-2.0)]
    merged = merge_slots(choose_slots(rows), slot_sources(TUNED, static_steps=3))
    assert {b: s.candidate_steps for b, s in merged.slots.items()} == {1: [3], 64: [0]}


def test_batch_size_gains_and_the_refine_hint_from_a_pass_table():
    import pandas as pd

    rows = []
    for p in (1, 2):
        for b, tuned, default in ((1, 100.0, 110.0), (64, 120.0, 100.0)):
            for role, v in (("tuned", tuned), ("sglang-default", default), ("static", 100.0), ("target", 90.0)):
                rows.append({"pass": p, "batch_size": b, "role": role, "value": v * (1 + 0.01 * p)})
    gains = batch_size_gains(pd.DataFrame(rows), higher_is_better=True, passes=2)
    by_b = {r["batch_size"]: r["gain_pct"] for r in gains}
    assert by_b[1]["sglang-default"] == pytest.approx(100 * (100 / 110 - 1))
    assert by_b[64]["sglang-default"] == pytest.approx(20.0)
    assert "--refine" in split_text(gains) and "batch size 1" in split_text(gains)
    assert split_text([_row(1, sglang_default=3.0, static=1.0, target=5.0)]) == ""  # tuned best everywhere: nothing to say


def _tuning(tmp_path: Path, verdict: dict | None, tuned: AdaptiveConfig = TUNED) -> Path:
    tuned_dir = tmp_path / "tuned"
    tuned_dir.mkdir()
    report = {"policies": {"tuned_adaptive": tuned.to_dict(), "best_static": {"steps": 3}}}
    if verdict is not None:
        report["verdict"] = verdict
    (tuned_dir / "tuning.json").write_text(json.dumps(report))
    (tuned_dir / "adaptive_spec.json").write_text(json.dumps(tuned.to_dict()))
    return tuned_dir


def test_refine_archives_the_measured_round_and_records_what_it_kept(tmp_path):
    rows = [_row(1, sglang_default=-4.0, static=1.0, target=30.0), _row(64, sglang_default=9.0, static=4.0, target=8.0)]
    tuned_dir = _tuning(tmp_path, {"source": "measured", "finished": True, "passes": 20, "text": "tuned adaptive ...", "by_batch_size": rows})
    refined, record = refine(tuned_dir)
    assert record["round"] == 2 and [c["kept"] for c in record["slots_kept"]] == ["sglang-default", "tuned"]
    assert json.loads((tuned_dir / "round-1" / "adaptive_spec.json").read_text()) == TUNED.to_dict()
    assert _slot_at(refined, 70) == TUNED.slots[32] and _slot_at(refined, 1) == SGLANG_DEFAULT_CONFIG.slots[1]
    assert round_in(json.loads((tuned_dir / "tuning.json").read_text())) == 1  # tuning.json is rewritten by tune's finalize, not here
    assert default_out_dir(tmp_path, {"refined": record}) == tmp_path / "confirm-2"
    assert default_out_dir(tmp_path, {}) == tmp_path / "confirm"


@pytest.mark.parametrize("verdict, words", [
    (None, "no measured verdict"),
    ({"source": "simulated", "text": "x"}, "no measured verdict"),
    ({"source": "measured", "finished": False, "passes": 5, "by_batch_size": [_row(1, sglang_default=-1.0)]}, "not settled yet"),
    ({"source": "measured", "finished": False, "attempts_exhausted": True, "passes": 14, "by_batch_size": [_row(1, sglang_default=-1.0)]},
     "quieter machine"),
    ({"source": "measured", "finished": True, "passes": 20, "text": "t", "by_batch_size": [_row(1, sglang_default=1.0, static=2.0)]},
     "nothing to refine"),
    ({"source": "measured", "finished": True, "passes": 20, "text": "t",
      "by_batch_size": [_row(1, sglang_default=-1.0, static=2.0), _row(4, sglang_default=-3.0, static=2.0)]}, "nothing to combine"),
    # a confirm at one batch size (or one cap, in an open loop): it was told to run confirm, which it had
    ({"source": "measured", "finished": True, "passes": 6, "text": "t", "by_batch_size": []}, "compared one batch size only"),
])
def test_refine_refuses_without_a_settled_verdict_or_anything_to_change(tmp_path, verdict, words):
    with pytest.raises(SpectuneError, match=words):
        refine(_tuning(tmp_path, verdict))


def test_runs_alike_only_where_every_batch_up_to_the_size_routes_to_the_same_slot_and_state():
    refined = merge_slots(choose_slots([_row(1, sglang_default=-4.0, static=1.0, target=30.0),
                                        _row(16, sglang_default=3.0, static=2.0, target=10.0)]), slot_sources(TUNED, 3))
    assert runs_alike(refined, SGLANG_DEFAULT_CONFIG, 5, 5, 15)  # the default's own slots 1 and 8 up to 15
    assert not runs_alike(refined, SGLANG_DEFAULT_CONFIG, 5, 5, 16)  # from 16 on the tuned config's slot
    assert not runs_alike(refined, SGLANG_DEFAULT_CONFIG, 5, 7, 4)  # another launch step starts slot 1 elsewhere
    # equal slot configs, but one slot (a shared EMA) in one config and two in the other: not alike
    one = AdaptiveConfig({1: SlotConfig([1, 3])})
    two = AdaptiveConfig({1: SlotConfig([1, 3]), 4: SlotConfig([1, 3])})
    assert runs_alike(one, two, 3, 3, 3) and not runs_alike(one, two, 3, 3, 4)


def test_pooling_makes_the_difference_zero_where_alike_and_keeps_both_measurements_for_the_rest():
    import pandas as pd

    from spectune.confirm import pass_gains, pool_alike

    rows = [{"pass": p, "batch_size": b, "request_rate": 0.0, "role": role, "value": v}
            for p in (1, 2) for b, vals in ((1, (100.0, 110.0, 90.0, 80.0)), (4, (130.0, 120.0, 100.0, 90.0)))
            for role, v in zip(("tuned", "sglang-default", "static", "target"), vals)]
    pooled = pool_alike(pd.DataFrame(rows), (1,))
    at1 = pooled[pooled["batch_size"] == 1].set_index(["pass", "role"])["value"]
    assert at1[(1, "tuned")] == at1[(1, "sglang-default")] == 105.0 and at1[(1, "static")] == 90.0
    gains = pass_gains(pooled, higher_is_better=True)
    import numpy as np

    assert np.allclose(gains["sglang-default"], np.log(130 / 120) / 2)  # batch 1 adds exactly 0
    assert np.allclose(gains["static"], (np.log(105 / 90) + np.log(130 / 100)) / 2)


def test_report_shows_the_measured_verdict_per_batch_size_and_what_refine_kept(tmp_path):
    from types import SimpleNamespace

    from spectune.report.data import read_tuning
    from spectune.report.render import verdict_table

    rows = [_row(1, sglang_default=0.0, static=13.6, target=44.3), _row(64, sglang_default=5.4, static=-3.0, target=8.0)]
    record = {"round": 2, "passes": 10, "slots_kept": [{"batch_size": 1, "kept": "sglang-default"}, {"batch_size": 64, "kept": "tuned"}]}
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "tuning.json").write_text(json.dumps({
        "verdict": {"source": "measured", "text": "tuned adaptive ...", "by_batch_size": rows, "alike_batch_sizes": [1]},
        "refined": record}))
    tuning = read_tuning(tmp_path)
    table = verdict_table(SimpleNamespace(tuning=tuning))
    assert table.headers == ["batch size", "vs SGLang's default", "vs the best static g", "vs target-only"]
    assert table.rows == [["1", "0 (its own slots)", "+13.6%", "+44.3%"], ["64", "+5.4%", "-3.0%", "+8.0%"]]
    assert "round 2" in tuning.refined and "batch 1: SGLang's default; batch 64: the tuned config" in tuning.refined


def test_refine_refuses_a_config_whose_best_slots_never_draft(tmp_path):
    tuned = AdaptiveConfig({1: SlotConfig([1, 3]), 4: SlotConfig([0])})
    rows = [_row(1, sglang_default=1.0, static=2.0, target=-1.0), _row(4, sglang_default=3.0, static=1.0, target=0.5)]
    with pytest.raises(SpectuneError, match="never draft"):  # target-only at batch 1, the tuned [0] from batch 4 on
        refine(_tuning(tmp_path, {"source": "measured", "finished": True, "passes": 20, "text": "t", "by_batch_size": rows}, tuned))
