"""spectune.emit: SGLang's own released loader reads every file spectune writes; spectune refuses, with a
clear message, the files SGLang would accept and then misread or crash on; vLLM's own config classes
accept every speculative config spectune writes; llama-server parses the flags spectune gives it."""

from __future__ import annotations

import json
import math
import random
import subprocess
import textwrap

import pytest

from engine_fixtures import TINY_LLAMA, require_llama_server, require_vllm
from sglang_compat import sglang_adaptive_module
from spectune.adaptive import SGLANG_DEFAULT_CONFIG, AdaptiveConfig, SlotConfig
from spectune.emit import (
    MANAGED_KEYS,
    VLLM_OTHER_KEYS,
    VllmSpecConfig,
    llamacpp_flags,
    schedule_from_optima,
    sglang_flags,
    sglang_launch_steps,
    validate_sglang_config,
    validate_vllm_config,
    write_sglang_config,
)
from spectune.errors import SpectuneError


@pytest.fixture(scope="module")
def sglang():
    return sglang_adaptive_module()


def random_adaptive_config(rng: random.Random) -> AdaptiveConfig:
    slots = {}
    for n, bound in enumerate(sorted(rng.sample(range(1, 300), rng.randint(1, 5)))):
        ladder = sorted(rng.sample(range(0 if n else 1, 9), rng.randint(1, 4)))  # the smallest slot drafts
        slots[bound] = SlotConfig(
            candidate_steps=ladder,
            ema_alpha=round(rng.uniform(0.05, 1.0), 3),
            update_interval=rng.randint(1, 8),
            warmup_batches=rng.randint(0, 20),
            down_hysteresis=rng.choice([0.0, -0.25, round(rng.uniform(-1, 0.5), 2)]),
            up_hysteresis=rng.choice([0.0, round(rng.uniform(-0.5, 1), 2)]),
            ceiling_coeff=rng.choice([0.0, round(rng.uniform(0.5, 3.0), 2)]),
        )
    return AdaptiveConfig(slots=slots)


def test_sglang_loads_every_file_spectune_writes(sglang, tmp_path):
    rng = random.Random(11)
    for n in range(60):
        cfg = random_adaptive_config(rng)
        path = write_sglang_config(cfg, tmp_path / f"adaptive_spec_{n}.json")
        assert validate_sglang_config(path) == cfg  # round trip
        _, entries = sglang._load_adaptive_config(str(path))
        assert sorted(entries) == sorted(cfg.slots)
        steps = sglang_launch_steps(cfg)
        assert steps > 0 and steps in sglang.resolve_candidate_steps_from_config(str(path))  # the server's launch check
        params = sglang.AdaptiveSpeculativeParams(initial_steps=steps, cfg_path=str(path))
        for bound, slot in cfg.slots.items():
            ref = params._slots[bound]
            assert [ref.candidate_steps, ref.ema_alpha, ref.update_interval, ref.warmup_batches, ref.down_hysteresis,
                    ref.up_hysteresis, ref.ceiling_coeff] == [getattr(slot, k) for k in (
                        "candidate_steps", "ema_alpha", "update_interval", "warmup_batches", "down_hysteresis",
                        "up_hysteresis", "ceiling_coeff")]
        flags = sglang_flags(path, steps, draft_model="/models/eagle")
        assert flags[flags.index("--speculative-num-steps") + 1] == str(steps)
        assert flags[flags.index("--speculative-adaptive-config") + 1] == str(path)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries


def sglang_outcome(sglang, obj: dict, path) -> str:
    """What SGLang 0.5.23 does with this file: refuses it at start-up, crashes while serving, or accepts it."""
    path.write_text(json.dumps(obj))
    try:
        union = sglang.resolve_candidate_steps_from_config(str(path))
        params = sglang.AdaptiveSpeculativeParams(initial_steps=union[len(union) // 2], cfg_path=str(path))
    except ValueError:
        return "refuses"
    except Exception as e:
        return f"crashes: {type(e).__name__}"
    try:
        for _ in range(60):  # serve: one verify pass per slot and round, past any warmup
            for bound in params._bs_list:
                params.on_verify_complete([1] * bound, batch_size=bound)
    except Exception as e:
        return f"crashes: {type(e).__name__}"
    return "accepts"


LADDER = {"candidate_steps": [1, 3]}
BAD_SGLANG_FILES = [
    # (case, file, what SGLang does with it, what spectune says)
    ("update_interval 0", {"1": LADDER, "8": {**LADDER, "update_interval": 0}}, "crashes: ZeroDivisionError",
     'slot "8".update_interval = 0: must be an integer >= 1 (SGLang would crash at run time)'),
    ("update_interval as text", {"1": {**LADDER, "update_interval": "5"}}, "crashes: TypeError",
     'slot "1".update_interval = "5": must be an integer >= 1'),
    ("ema_alpha 0", {"1": {**LADDER, "ema_alpha": 0}}, "accepts", 'slot "1".ema_alpha = 0: must be a number with 0 < ema_alpha <= 1'),
    ("ema_alpha 1.5", {"ema_alpha": 1.5, "1": LADDER}, "accepts", '"ema_alpha" = 1.5: must be a number with 0 < ema_alpha <= 1'),
    ("boolean step", {"1": {"candidate_steps": [True, 3]}}, "accepts", "[true, 3]: must hold integers, not booleans"),
    ("boolean interval", {"1": {**LADDER, "update_interval": True}}, "accepts", "update_interval = true: must be a number, not a boolean"),
    ("unsorted ladder", {"1": {"candidate_steps": [7, 1, 3]}}, "accepts", "[7, 1, 3]: must be sorted ascending without repeats, e.g. [1, 3, 7]"),
    ("repeated step", {"1": {"candidate_steps": [1, 3, 3]}}, "accepts", "[1, 3, 3]: must be sorted ascending without repeats"),
    ("misspelt slot key", {"1": {**LADDER, "ema_alhpa": 0.5}}, "accepts", 'slot "1" has unknown key "ema_alhpa" (SGLang ignores it); did you mean "ema_alpha"?'),
    ("misspelt default", {"warmup_batch": 3, "1": LADDER}, "accepts", 'unknown key "warmup_batch" (SGLang ignores it); did you mean "warmup_batches"?'),
    ("strategy key", {"strategy": "ema", "1": LADDER}, "accepts", '"strategy" is read only by an unreleased SGLang main'),
    ("negative warmup", {"1": {**LADDER, "warmup_batches": -1}}, "accepts", "warmup_batches = -1: must be an integer >= 0"),
    ("NaN hysteresis", {"1": {**LADDER, "down_hysteresis": math.nan}}, "accepts", "down_hysteresis = NaN: must be a finite number"),
    ("negative ceiling", {"1": {**LADDER, "ceiling_coeff": -1.0}}, "accepts", "ceiling_coeff = -1.0: must be a number >= 0"),
    ("leading zero", {"08": LADDER}, "accepts", 'slot key "08": must be a batch size >= 1 written without leading zeros, e.g. "8"'),
    ("padded key", {" 8": LADDER, "1": LADDER}, "accepts", 'slot key " 8": write the batch size in plain digits alone, e.g. "8"'),
    ("slot not an object", {"1": [1, 3]}, "crashes: AttributeError", 'slot "1" = [1, 3]: must be an object'),
    ("empty ladder", {"1": {"candidate_steps": []}}, "refuses", 'slot "1".candidate_steps = []: must be a non-empty list'),
    ("no ladder", {"1": {"ema_alpha": 0.3}}, "refuses", 'slot "1".candidate_steps is missing'),
    ("no slot", {"ema_alpha": 0.2}, "refuses", "no batch-size slot"),
    ("flat schema", {"candidate_steps": [1, 3]}, "refuses", 'top-level "candidate_steps" is the flat schema of SGLang 0.5.11-0.5.12'),
]


@pytest.mark.parametrize("case, obj, sglang_does, message", BAD_SGLANG_FILES, ids=[c[0] for c in BAD_SGLANG_FILES])
def test_spectune_refuses_files_sglang_misreads(sglang, tmp_path, case, obj, sglang_does, message):
    path = tmp_path / "adaptive_spec.json"
    assert sglang_outcome(sglang, obj, path) == sglang_does
    path.write_text(json.dumps(obj))
    with pytest.raises(SpectuneError) as err:
        validate_sglang_config(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_repeated_json_key_is_refused(tmp_path):
    path = tmp_path / "adaptive_spec.json"
    path.write_text('{"1": {"candidate_steps": [1, 3]}, "1": {"candidate_steps": [1]}}')
    with pytest.raises(SpectuneError, match='key "1" appears twice'):
        validate_sglang_config(path)


def test_sglang_version_rules():
    with_zero = {"1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0, 1]}}
    assert validate_sglang_config(with_zero, "0.5.14").slots[8].candidate_steps == [0, 1]
    with pytest.raises(SpectuneError, match=r'slot "8".candidate_steps = \[0, 1\]: step 0 needs SGLang >= 0.5.14'):
        validate_sglang_config(with_zero, "0.5.13")
    with pytest.raises(SpectuneError, match="SGLang >= 0.5.13 only"):
        validate_sglang_config({"1": {"candidate_steps": [1]}}, "0.5.12")
    with pytest.raises(SpectuneError, match="expected a release number"):
        validate_sglang_config({"1": {"candidate_steps": [1]}}, "latest")


def test_write_refuses_an_invalid_config_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "adaptive_spec.json"
    write_sglang_config(SGLANG_DEFAULT_CONFIG, path)
    before = path.read_text()
    bad = AdaptiveConfig(slots={1: SlotConfig(candidate_steps=[1, 3], update_interval=0)})
    with pytest.raises(SpectuneError, match="update_interval = 0"):
        write_sglang_config(bad, path)
    assert path.read_text() == before
    assert list(tmp_path.iterdir()) == [path]


def test_launch_steps_pick_the_smallest_slots_own_start():
    assert sglang_launch_steps(SGLANG_DEFAULT_CONFIG) == 5  # [1, 3, 5, 7]: its middle rung
    zero_first = AdaptiveConfig(slots={1: SlotConfig([0]), 8: SlotConfig([0, 2, 4])})
    assert sglang_launch_steps(zero_first) == 2  # the smallest positive step anywhere
    with pytest.raises(SpectuneError, match="nothing is ever drafted"):
        sglang_launch_steps(AdaptiveConfig(slots={1: SlotConfig([0])}))


def test_sglang_flags(tmp_path):
    path = write_sglang_config(SGLANG_DEFAULT_CONFIG, tmp_path / "a.json")
    assert sglang_flags(path, 3, algorithm="EAGLE3", cuda_graph_bs=[4, 1, 2]) == [
        "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--speculative-adaptive", "--speculative-adaptive-config", str(path),
        "--cuda-graph-bs-decode", "1", "2", "4",
    ]
    with pytest.raises(SpectuneError, match="only with EAGLE or EAGLE3"):
        sglang_flags(path, 3, algorithm="NGRAM")
    with pytest.raises(SpectuneError, match=r"--speculative-num-steps 4: must be a positive step of the config's ladders \[0, 1, 3, 5, 7\]"):
        sglang_flags(path, 4)


# --- vLLM ---

GOOD_VLLM = [
    VllmSpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5),
    VllmSpecConfig(method="ngram", num_speculative_tokens=3,
                   num_speculative_tokens_per_batch_size=schedule_from_optima({1: 3, 4: 3, 8: 2, 32: 1, 128: 0})),
    VllmSpecConfig(method="draft_model", num_speculative_tokens=5, model=str(TINY_LLAMA),
                   prompt_lookup_min=3,  # not written: draft_model does not read it
                   num_speculative_tokens_per_batch_size=[(1, 4, 5), (5, 16, 3), (32, 64, 1)]),  # 17-31 carries 3
]
# (case, config, does vLLM accept it, what spectune says)
BAD_VLLM = [
    ("no tokens", {"method": "ngram", "num_speculative_tokens": 0}, False, "num_speculative_tokens = 0: must be an integer > 0"),
    ("lookup min > max", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, False,
     "prompt_lookup_min = 5 must be <= prompt_lookup_max = 2"),
    ("unknown key", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_mx": 4}, False,
     'unknown key "prompt_lookup_mx" (vLLM rejects it); did you mean "prompt_lookup_max"?'),
    ("tensor_parallel_size", {"method": "ngram", "num_speculative_tokens": 3, "tensor_parallel_size": 1}, False,
     'vLLM wants "draft_tensor_parallel_size"'),
    ("first range not at 1", {"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[2, 8, 3]]}, False,
     "the first range must start at batch size 1"),
    ("overlap", {"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, 3], [8, 16, 2]]}, False,
     "must not overlap (the previous one ends at 8)"),
    ("start > end", {"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, 3], [16, 9, 2]]}, False,
     "first_bs must be <= last_bs"),
    ("negative k", {"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, -1]]}, False,
     "k must be >= 0 (0 = no speculation)"),
    # vLLM accepts these three and silently does something else than written
    ("k above cap", {"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, 5]]}, True,
     "k must be <= num_speculative_tokens = 3 (vLLM would silently cap it)"),
    ("unsorted ranges", {"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[9, 16, 2], [1, 8, 3]]}, True,
     "the first range must start at batch size 1"),
    ("model for ngram", {"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, True, 'method "ngram" uses no model; remove it'),
]

VLLM_CHECK = textwrap.dedent("""
    import dataclasses, json, sys
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
    cases, model = json.load(sys.stdin), sys.argv[1]
    target, parallel = ModelConfig(model=model), ParallelConfig()
    results = []
    for obj in cases:
        try:
            cfg = SpeculativeConfig(**obj, target_model_config=target, target_parallel_config=parallel)
            lookup = None
            if cfg.num_speculative_tokens_per_batch_size is not None:  # the scheduler validates it here
                lookup = build_dynamic_sd_schedule_lookup(cfg.num_speculative_tokens_per_batch_size, 256, cfg.num_speculative_tokens)
            results.append({"ok": True, "lookup": lookup})
        except Exception as e:
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
    print(json.dumps({"results": results, "fields": [f.name for f in dataclasses.fields(SpeculativeConfig)]}))
""")


@pytest.fixture(scope="module")
def vllm_verdicts():
    """One vLLM process (importing it takes ~15 s) judges every case; draft_model configs use the tiny test Llama."""
    python = require_vllm()
    if not (TINY_LLAMA / "config.json").is_file():
        from engine_fixtures import build_tiny_llama

        build_tiny_llama()
    cases = [json.loads(c.to_json()) for c in GOOD_VLLM] + [c[1] for c in BAD_VLLM]
    proc = subprocess.run([str(python), "-c", VLLM_CHECK, str(TINY_LLAMA)], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.engines
def test_vllm_accepts_every_config_spectune_writes(vllm_verdicts):
    for cfg, verdict in zip(GOOD_VLLM, vllm_verdicts["results"]):
        assert verdict["ok"], (cfg, verdict)
        schedule = cfg.num_speculative_tokens_per_batch_size
        if schedule:
            assert verdict["lookup"][1:] == [expected_k(schedule, bs, cfg.num_speculative_tokens) for bs in range(1, 257)]


@pytest.mark.engines
@pytest.mark.parametrize("index", range(len(BAD_VLLM)), ids=[c[0] for c in BAD_VLLM])
def test_spectune_refuses_vllm_configs_vllm_refuses_or_misreads(vllm_verdicts, index):
    case, obj, vllm_accepts, message = BAD_VLLM[index]
    assert vllm_verdicts["results"][len(GOOD_VLLM) + index]["ok"] is vllm_accepts
    with pytest.raises(SpectuneError, match="^speculative config: ") as err:
        validate_vllm_config(obj)
    assert message in str(err.value)


@pytest.mark.engines
def test_spectune_accepts_every_key_vllm_has(vllm_verdicts):
    internal = {"target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config", "tensor_parallel_size"}
    assert set(vllm_verdicts["fields"]) - internal <= set(MANAGED_KEYS + VLLM_OTHER_KEYS)


def test_vllm_json_holds_only_the_methods_keys():
    ngram = VllmSpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5)
    assert json.loads(ngram.to_json()) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    draft = VllmSpecConfig(method="draft_model", num_speculative_tokens=3, model="/m", prompt_lookup_max=5,
                           num_speculative_tokens_per_batch_size=[(1, 8, 3), (9, 9, 1)], extra={"draft_tensor_parallel_size": 1})
    assert json.loads(draft.to_json()) == {"method": "draft_model", "num_speculative_tokens": 3, "model": "/m",
                                           "num_speculative_tokens_per_batch_size": [[1, 8, 3], [9, 9, 1]], "draft_tensor_parallel_size": 1}
    assert validate_vllm_config(draft.to_json()) == VllmSpecConfig(
        method="draft_model", num_speculative_tokens=3, model="/m", num_speculative_tokens_per_batch_size=[(1, 8, 3), (9, 9, 1)],
        extra={"draft_tensor_parallel_size": 1})
    with pytest.raises(SpectuneError, match='model is missing: method "draft_model" needs'):
        VllmSpecConfig(method="draft_model", num_speculative_tokens=3).to_json()
    with pytest.raises(SpectuneError, match='method = "ngrm": .*did you mean "ngram"'):
        validate_vllm_config({"method": "ngrm", "num_speculative_tokens": 3})


def expected_k(schedule: list[tuple[int, int, int]], bs: int, cap: int) -> int:
    """k at a batch size as vLLM documents it: the range holding bs, else the last range that starts below it."""
    return min(cap, [k for start, _, k in schedule if start <= bs][-1])


def test_schedule_from_optima_keeps_each_measured_optimum():
    assert schedule_from_optima({1: 4, 2: 4, 8: 2, 16: 2, 64: 0}) == [(1, 7, 4), (8, 63, 2), (64, 64, 0)]
    assert schedule_from_optima({4: 3}) == [(1, 4, 3)]
    rng = random.Random(3)
    for _ in range(200):
        optima = {bs: rng.randint(0, 6) for bs in rng.sample(range(1, 300), rng.randint(1, 10))}
        schedule = schedule_from_optima(optima)
        cap = max(max(optima.values()), 1)
        validate_vllm_config({"method": "ngram", "num_speculative_tokens": cap, "num_speculative_tokens_per_batch_size": schedule})
        assert all(expected_k(schedule, bs, cap) == k for bs, k in optima.items())
        assert all(a[2] != b[2] for a, b in zip(schedule, schedule[1:]))  # neighbours merged
    with pytest.raises(SpectuneError, match="no measured batch sizes"):
        schedule_from_optima({})
    with pytest.raises(SpectuneError, match="batch size 0"):
        schedule_from_optima({0: 2})


# --- llama.cpp ---

def test_llamacpp_flags():
    assert llamacpp_flags(4, draft_model_path="/m/draft.gguf") == ["-md", "/m/draft.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "4"]
    assert llamacpp_flags(6, ngram=True) == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "6"]
    with pytest.raises(SpectuneError, match="either a draft model path or ngram=True"):
        llamacpp_flags(4, draft_model_path="/m/d.gguf", ngram=True)
    with pytest.raises(SpectuneError, match="must be an integer >= 1"):
        llamacpp_flags(0, ngram=True)


@pytest.mark.engines
@pytest.mark.parametrize("flags", [llamacpp_flags(4, draft_model_path="/nonexistent/draft.gguf"), llamacpp_flags(5, ngram=True)])
def test_llama_server_parses_the_flags(tmp_path, flags):
    # With a model path that does not exist, llama-server gets past argument parsing and fails to load it;
    # a flag it does not know stops it earlier with its usage message.
    binary = require_llama_server()
    proc = subprocess.run([str(binary), "-m", str(tmp_path / "absent.gguf"), "--host", "127.0.0.1", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60)
    assert "failed to load model" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-1500:]


# --- CLI ---

def test_validate_config_cli(spectune_cmd, tmp_path):
    good = write_sglang_config(SGLANG_DEFAULT_CONFIG, tmp_path / "adaptive_spec.json")
    ok = subprocess.run([*spectune_cmd, "validate-config", str(good), "--engine", "sglang"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OK: 4 slot(s): bs>=1 [1, 3, 5, 7]")

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": LADDER, "8": {**LADDER, "update_interval": 0}}))
    refused = subprocess.run([*spectune_cmd, "validate-config", str(bad), "--engine", "sglang"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f'error: {bad}: slot "8".update_interval = 0: must be an integer >= 1 (SGLang would crash at run time)']

    old = subprocess.run([*spectune_cmd, "validate-config", str(good), "--engine", "sglang", "--sglang-version", "0.5.13"],
                         capture_output=True, text=True, timeout=60)
    assert old.returncode == 2 and "step 0 needs SGLang >= 0.5.14" in old.stderr

    vllm = tmp_path / "spec.json"
    vllm.write_text(GOOD_VLLM[1].to_json())
    ok = subprocess.run([*spectune_cmd, "validate-config", str(vllm), "--engine", "vllm"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("OK: method=ngram, num_speculative_tokens=3, schedule 1-7:3, 8-31:2")
    wrong = subprocess.run([*spectune_cmd, "validate-config", str(vllm), "--engine", "trt"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "must be sglang or vllm" in wrong.stderr
