"""Through the engine API: greedy speculation is lossless, acceptance behaves as it must, step policies apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_models import bigram_target, llama, noisy_copy, write_tokenizer

from spectune.engine.config import EngineConfig, SpeculativeConfig
from spectune.engine.engine import LLMEngine
from spectune.engine.scheduler import SamplingParams

torch.set_num_threads(1)  # two busy shared cores: more threads only spin


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    vocab = write_tokenizer(root / "target")
    target = llama(root / "target", vocab)
    paths = {"target": target, "vocab": vocab}
    for noise in (0.02, 0.05, 0.2):
        paths[noise] = noisy_copy(target, root / f"noisy-{noise}", noise)
    paths["bigram"] = bigram_target(root / "bigram", vocab)
    return paths


def prompts(vocab: int, n: int = 8) -> list[list[int]]:
    return [torch.randint(2, vocab, (3 + (5 * i) % 11,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]


def engine(target: Path, spec: dict | None = None, max_num_seqs: int = 8, **kwargs) -> LLMEngine:
    speculative = SpeculativeConfig.parse(spec) if spec else None
    return LLMEngine(EngineConfig(model=target, speculative=speculative, max_num_seqs=max_num_seqs, **kwargs))


def greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]


def acceptance(e: LLMEngine) -> float:
    return e.metrics.num_accepted_tokens / e.metrics.num_draft_tokens


# Different output lengths make requests finish at different rounds, so slots are freed and reused mid-run.
MAX_TOKENS = [24, 9, 31, 16, 5, 28, 12, 20]


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_speculation_is_lossless(models, method, max_num_seqs):
    target, vocab = models["target"], models["vocab"]
    spec = {"method": "draft_model", "model": str(models[0.05]), "num_speculative_tokens": 3} if method == "draft_model" \
        else {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    expected = engine(target, max_num_seqs=max_num_seqs).generate(prompts(vocab), greedy(MAX_TOKENS))
    e = engine(target, spec, max_num_seqs=max_num_seqs)
    got = e.generate(prompts(vocab), greedy(MAX_TOKENS))
    assert [len(o) for o in got] == MAX_TOKENS
    assert got == expected
    assert 0 < e.metrics.num_accepted_tokens < e.metrics.num_draft_tokens  # both accepting and rejecting were exercised


def test_greedy_rows_stay_lossless_in_a_batch_with_sampled_rows(models):
    """A mixed batch goes through rejection sampling; its temperature-0 rows must still equal greedy decoding."""
    target, vocab = models["target"], models["vocab"]
    spec = {"method": "draft_model", "model": str(models[0.05]), "num_speculative_tokens": 3}
    expected = engine(target).generate(prompts(vocab), greedy(MAX_TOKENS))
    params = [SamplingParams(max_tokens=m, temperature=float(i % 2), ignore_eos=True, seed=i) for i, m in enumerate(MAX_TOKENS)]
    got = engine(target, spec).generate(prompts(vocab), params)
    assert got[0::2] == expected[0::2]
    assert got[1::2] != expected[1::2]  # the sampled rows really sampled


def test_target_as_its_own_draft_accepts_everything(models):
    target, vocab = models["target"], models["vocab"]
    e = engine(target, {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4})
    e.generate(prompts(vocab), greedy(MAX_TOKENS))
    assert e.metrics.num_draft_tokens > 100
    assert acceptance(e) == 1.0


def test_acceptance_falls_as_draft_noise_grows(models):
    target, vocab = models["target"], models["vocab"]
    rates = []
    for noise in (0.02, 0.05, 0.2):
        e = engine(target, {"method": "draft_model", "model": str(models[noise]), "num_speculative_tokens": 3})
        e.generate(prompts(vocab), greedy([32] * 8))
        rates.append(acceptance(e))
    assert rates[0] > rates[1] > rates[2], rates


def test_ngram_accepts_more_on_repetitive_text_than_on_random_text(models):
    """The bigram target continues its own token walk, so a prompt made of that walk is 'repetitive text'."""
    bigram, vocab = models["bigram"], models["vocab"]
    walk_engine = engine(bigram)
    starts = [[t] for t in (7, 40, 90, 150)]
    walks = walk_engine.generate(starts, greedy([40] * 4))
    random_text = [torch.randint(2, vocab, (40,), generator=torch.Generator().manual_seed(100 + i)).tolist() for i in range(4)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}

    def accepted_per_round(texts: list[list[int]]) -> float:
        e = engine(bigram, spec)
        e.generate(texts, greedy([12] * 4))
        return e.metrics.num_accepted_tokens / e.metrics.num_spec_request_rounds

    repetitive, random = accepted_per_round(walks), accepted_per_round(random_text)
    assert repetitive > 2.0 > random, (repetitive, random)


def test_batch_size_schedule_picks_k_per_batch_size_and_logs_rounds(models, tmp_path):
    """vLLM's num_speculative_tokens_per_batch_size: k=3 alone, k=1 at 2-3 running, k=0 (plain decode) from 4."""
    target, vocab = models["target"], models["vocab"]
    log = tmp_path / "rounds.jsonl"
    spec = {"method": "draft_model", "model": str(models[0.02]), "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 3, 1], [4, 8, 0]]}
    e = engine(target, spec, round_log=log)
    got = e.generate(prompts(vocab), greedy(MAX_TOKENS))
    e.close()
    assert got == engine(target).generate(prompts(vocab), greedy(MAX_TOKENS))
    rounds = [r for r in map(json.loads, log.read_text().splitlines()) if not r.get("prefill")]
    expected_k = {1: 3, 2: 1, 3: 1, 4: 0, 5: 0, 6: 0, 7: 0, 8: 0}
    assert all(r["num_steps"] == expected_k[r["batch_size"]] for r in rounds)
    assert {r["num_steps"] for r in rounds} == {0, 1, 3}  # every range was visited
    for r in rounds:
        assert set(r) == {"t_s", "start_s", "end_s", "batch_size", "num_steps", "proposed", "accepted", "round_ms", "request_ids"}
        assert r["start_s"] <= r["end_s"] and len(r["request_ids"]) == r["batch_size"]
        assert len(r["proposed"]) == len(r["accepted"]) == r["batch_size"]
        assert all(0 <= a <= p <= r["num_steps"] for p, a in zip(r["proposed"], r["accepted"]))
        assert r["round_ms"] > 0
    assert [r["t_s"] for r in rounds] == sorted(r["t_s"] for r in rounds)
    # the log and the counters tell the same story
    assert sum(sum(r["accepted"]) for r in rounds) == e.metrics.num_accepted_tokens
    assert sum(sum(r["proposed"]) for r in rounds) == e.metrics.num_draft_tokens


def test_adaptive_steps_follow_acceptance(models, tmp_path):
    """SGLang's adaptive policy: a draft that is always accepted climbs the ladder, one that never is descends."""
    target, vocab = models["target"], models["vocab"]
    config = tmp_path / "adaptive_spec.json"
    config.write_text(json.dumps({"1": {"candidate_steps": [1, 3, 5]}, "warmup_batches": 2, "update_interval": 2}))
    steps = {}
    for name, draft in (("perfect", target), ("poor", models[0.2])):
        log = tmp_path / f"{name}.jsonl"
        e = engine(target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}, max_num_seqs=1,
                   adaptive_config=config, round_log=log)
        e.generate(prompts(vocab, 1), greedy([60]))
        e.close()
        steps[name] = [r["num_steps"] for r in map(json.loads, log.read_text().splitlines()) if not r.get("prefill")]
    assert steps["perfect"][0] == 3 and steps["perfect"][-1] == 5
    assert steps["poor"][0] == 3 and steps["poor"][-1] == 1


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_requests_filling_the_whole_context_stay_lossless(models, method):
    """prompt + max_tokens == max_model_len: drafts must stop at the cache's end, not overflow it."""
    target, vocab = models["target"], models["vocab"]
    spec = {"method": "draft_model", "model": str(models[0.02]), "num_speculative_tokens": 6} if method == "draft_model" \
        else {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    texts = prompts(vocab, 3)
    params = greedy([48 - len(p) for p in texts])
    expected = engine(target, max_model_len=48).generate(texts, params)
    e = engine(target, spec, max_model_len=48)
    assert e.generate(texts, params) == expected
    assert [len(p) + len(o) for p, o in zip(texts, expected)] == [48] * 3
    assert e.metrics.num_accepted_tokens > 0
