"""spectune.adaptive against SGLang 0.5.23's own released adaptive code, driven by the same random traces.

Both policies see identical configs, launch steps, CUDA-graph padding lists, batch sizes and
accepted-draft counts; every round must give the same step before drafting, the same switch
decision after verify, and the same per-slot step count and EMA (compared exactly).
"""

from __future__ import annotations

import json
import random
import types
from dataclasses import dataclass, field

import pytest

from sglang_compat import load_sglang_module, sglang_adaptive_module
from spectune.adaptive import (
    AGGRESSIVE_PRESET,
    CONSERVATIVE_PRESET,
    SGLANG_DEFAULT_CONFIG,
    AdaptiveConfig,
    AdaptivePolicy,
    SlotConfig,
    sglang_cuda_graph_bs,
)
from spectune.errors import SpectuneError

NUM_TRACES = 1200
BOUND_CHOICES = [1, 2, 3, 4, 8, 9, 10, 11, 16, 17, 24, 32, 33, 40, 41, 48, 60, 61, 64, 65, 100, 128, 129, 200, 256, 300]


@pytest.fixture(scope="module")
def sglang():
    return sglang_adaptive_module()


def random_tuning(rng: random.Random, name: str):
    return {
        "ema_alpha": lambda: rng.choice([1.0, 0.2, round(rng.uniform(0.01, 1.0), 3)]),
        "update_interval": lambda: rng.randint(1, 6),
        "warmup_batches": lambda: rng.randint(0, 12),
        "down_hysteresis": lambda: rng.choice([0.0, -0.25, round(rng.uniform(-1.0, 0.5), 3)]),
        "up_hysteresis": lambda: rng.choice([0.0, round(rng.uniform(-0.5, 1.0), 3)]),
        "ceiling_coeff": lambda: rng.choice([0, 0, round(rng.uniform(0.3, 4.0), 2)]),
    }[name]()


def random_config(rng: random.Random) -> dict:
    """A valid adaptive_spec.json: 1-4 slots, ladders with and without 0, top-level defaults and per-slot overrides."""
    bounds = sorted(rng.sample(BOUND_CHOICES, rng.randint(1, 4)))
    if rng.random() < 0.6:
        bounds[0] = 1
    tuning = ["ema_alpha", "update_interval", "warmup_batches", "down_hysteresis", "up_hysteresis", "ceiling_coeff"]
    cfg: dict = {name: random_tuning(rng, name) for name in tuning if rng.random() < 0.3}
    for bound in sorted(set(bounds)):
        ladder = sorted(rng.sample(range(0, 9), rng.randint(1, 4)))
        slot: dict = {"candidate_steps": ladder}
        slot.update({name: random_tuning(rng, name) for name in tuning if rng.random() < 0.5})
        cfg[str(bound)] = slot
    return cfg


def random_padding(rng: random.Random) -> tuple[list[int] | None, list[int] | None]:
    """(what spectune gets, what SGLang's set_cuda_graph_bs gets)."""
    kind = rng.choice(["off", "off_empty", "default", "default_none", "custom"])
    if kind == "off":
        return [], None
    if kind == "off_empty":
        return [], []
    if kind == "default_none":
        return None, sglang_cuda_graph_bs()
    if kind == "default":
        sizes = sglang_cuda_graph_bs(rng.choice([8, 32, 48, 160, 256, 512]))
        return sizes, sizes
    sizes = sorted(rng.sample(range(1, 400), rng.randint(1, 30)))
    return sizes, list(reversed(sizes))  # SGLang sorts what it is given


def accepted_weights(alpha: float, steps: int) -> list[float]:
    # P(k accepted) for a per-position acceptance rate alpha, capped at the drafted steps
    return [alpha**k * (1 - alpha) for k in range(steps)] + [alpha**steps]


def random_batch_size(rng: random.Random, previous: int) -> int:
    if rng.random() < 0.7:
        return max(1, previous + rng.randint(-2, 2))
    return rng.choice([rng.randint(1, 16), rng.randint(1, 80), rng.randint(1, 600)])


@dataclass
class Tally:
    traces: int = 0
    rounds: int = 0
    switches: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0, "from_zero": 0, "to_zero": 0, "ceiling_slot": 0})


def compare_trace(sglang, rng: random.Random, cfg_obj: dict, ours_cfg, tmp_path, tally: Tally, label: str) -> None:
    path = tmp_path / f"{label}.json"
    path.write_text(json.dumps(cfg_obj))
    union = sorted({s for key, slot in cfg_obj.items() if key.isdigit() for s in slot["candidate_steps"]})
    initial = rng.choice(union)
    ours_padding, sglang_padding = random_padding(rng)

    ref = sglang.AdaptiveSpeculativeParams(initial_steps=initial, cfg_path=str(path))
    ref.set_cuda_graph_bs(sglang_padding)
    ours = AdaptivePolicy.from_config(ours_cfg, initial_steps=initial, cuda_graph_bs=ours_padding)
    assert ours.candidate_steps == ref.candidate_steps

    alpha = rng.uniform(0.05, 0.98)
    batch_size = rng.randint(1, 64)
    context = f"{label}: config={json.dumps(cfg_obj)} initial={initial} padding={ours_padding}"
    for round_no in range(rng.randint(30, 250)):
        if rng.random() < 0.05:
            alpha = rng.uniform(0.05, 0.98)  # the traffic changes character
        batch_size = random_batch_size(rng, batch_size)
        live = ours.steps_for_batch(batch_size)
        assert live == ref.get_steps_for_batch(batch_size), f"round {round_no} bs {batch_size}: {context}"
        if rng.random() < 0.02:
            accepted = []  # a pass with no decode requests
        else:
            accepted = rng.choices(range(live + 1), weights=accepted_weights(alpha, live), k=batch_size)
        slot = ours.slots[ours.slot_for_batch(batch_size)]
        before = slot.steps
        new_ours = ours.on_verify_complete(accepted, batch_size)
        new_ref = ref.on_verify_complete(accepted, batch_size)
        assert new_ours == new_ref, f"round {round_no} bs {batch_size} accepted {accepted}: {context}"
        for bound, state in ours.slots.items():
            ref_slot = ref._slots[bound]
            assert (state.steps, state.ema, state.num_batches) == (
                ref_slot.current_steps, ref_slot.ema_accept_len, ref_slot._batch_count
            ), f"round {round_no} slot {bound}: {context}"
        tally.rounds += 1
        if new_ours is not None:
            tally.switches["up" if new_ours > before else "down"] += 1
            tally.switches["from_zero"] += before == 0
            tally.switches["to_zero"] += new_ours == 0
            tally.switches["ceiling_slot"] += slot.config.ceiling_coeff > 0
    tally.traces += 1


def test_policy_matches_sglang_on_random_traces(sglang, tmp_path):
    rng = random.Random(20240523)
    tally = Tally()
    for n in range(NUM_TRACES):
        cfg_obj = random_config(rng)
        compare_trace(sglang, rng, cfg_obj, cfg_obj, tmp_path, tally, f"trace{n}")
    print(f"\nadaptive conformance: {tally.traces} traces, {tally.rounds} rounds identical; switches {tally.switches}")
    assert tally.traces == NUM_TRACES
    # the traces must reach every branch of the decision, or the comparison proves little
    assert all(count > 50 for count in tally.switches.values()), tally.switches


def test_policy_matches_sglang_on_configs_sglang_reinterprets(sglang, tmp_path):
    """Ladders SGLang accepts but sorts and deduplicates (spectune's validator rejects them; the policy
    built directly from SlotConfig still has to behave as SGLang does)."""
    rng = random.Random(7)
    tally = Tally()
    for n in range(200):
        cfg_obj = random_config(rng)
        for key, slot in cfg_obj.items():
            if key.isdigit():
                ladder = slot["candidate_steps"] + rng.sample(slot["candidate_steps"], 1)
                rng.shuffle(ladder)
                slot["candidate_steps"] = ladder
        defaults = {k: v for k, v in cfg_obj.items() if not k.isdigit()}
        ours = AdaptiveConfig(slots={int(k): SlotConfig(**{**defaults, **v}) for k, v in cfg_obj.items() if k.isdigit()})
        compare_trace(sglang, rng, cfg_obj, ours, tmp_path, tally, f"unsorted{n}")
    assert tally.traces == 200 and sum(tally.switches.values()) > 0


def test_builtin_config_and_presets_match_sglang(sglang, tmp_path):
    assert AdaptiveConfig.from_dict(sglang.DEFAULT_ADAPTIVE_CONFIG) == SGLANG_DEFAULT_CONFIG
    for preset in (SGLANG_DEFAULT_CONFIG, CONSERVATIVE_PRESET, AGGRESSIVE_PRESET):
        path = tmp_path / "preset.json"
        path.write_text(json.dumps(preset.to_dict()))
        ref = sglang.AdaptiveSpeculativeParams(initial_steps=1, cfg_path=str(path))
        for bound, slot in preset.slots.items():
            r = ref._slots[bound]
            assert (r.candidate_steps, r.ema_alpha, r.update_interval, r.warmup_batches) == (
                slot.candidate_steps, slot.ema_alpha, slot.update_interval, slot.warmup_batches)
            assert (r.down_hysteresis, r.up_hysteresis, r.ceiling_coeff) == (
                slot.down_hysteresis, slot.up_hysteresis, slot.ceiling_coeff)


def test_default_capture_list_matches_sglang_server_args():
    hook = load_sglang_module("srt/arg_groups/cuda_graph_hook.py")
    hook.resolving_view = lambda server_args: server_args  # the one server helper it reads its flags through
    server_args = types.SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm="EAGLE")
    for max_bs in (1, 8, 9, 32, 48, 100, 160, 256, 300, 512, 513):
        assert sglang_cuda_graph_bs(max_bs) == hook.generate_decode_cuda_graph_batch_sizes(server_args, max_bs)


def test_routing_pads_then_picks_the_largest_bound_below():
    policy = AdaptivePolicy.from_config(AGGRESSIVE_PRESET, initial_steps=3)  # default capture list
    assert [policy.slot_for_batch(b) for b in (1, 7, 8, 61, 64, 65, 127, 128, 257)] == [1, 1, 8, 64, 64, 64, 128, 128, 128]
    unpadded = AdaptivePolicy.from_config(AGGRESSIVE_PRESET, initial_steps=3, cuda_graph_bs=[])
    assert [unpadded.slot_for_batch(b) for b in (61, 63, 64, 127)] == [8, 8, 64, 64]
    above_smallest = AdaptivePolicy.from_config({"4": {"candidate_steps": [1, 3]}}, initial_steps=3)
    assert above_smallest.slot_for_batch(1) == 4  # below every bound: the smallest slot


def test_slots_start_at_launch_step_or_their_middle_rung():
    policy = AdaptivePolicy.from_config(SGLANG_DEFAULT_CONFIG, initial_steps=3, cuda_graph_bs=[])
    assert {b: s.steps for b, s in policy.slots.items()} == {1: 3, 8: 3, 32: 1, 64: 0}
    assert {b: s.ema for b, s in policy.slots.items()} == {1: 2.0, 8: 2.0, 32: 0.0, 64: -1.0}


def test_launch_step_outside_every_ladder_is_refused():
    with pytest.raises(SpectuneError, match=r"--speculative-num-steps 4: not among the config's candidate steps \[1, 3, 7\]"):
        AdaptivePolicy.from_config(CONSERVATIVE_PRESET, initial_steps=4)
