"""The EAGLE-style proposer: the engine's head computes what its trainer trained, drafting stays lossless, and
training it raises acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_models import bigram_target, eagle_head, llama, write_tokenizer

from spectune.engine.config import EngineConfig, SpeculativeConfig
from spectune.engine.eagle import load_eagle
from spectune.engine.engine import LLMEngine
from spectune.engine.model import load_model
from spectune.engine.scheduler import SamplingParams
from spectune.errors import SpectuneError

torch.set_num_threads(1)  # two busy shared cores: more threads only spin
MAX_TOKENS = [24, 9, 31, 16, 5, 28, 12, 20]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle")
    vocab = write_tokenizer(root / "target")
    # Mostly a token -> token map, which a head can learn in seconds, plus a little attention, so that verifying
    # drafts reads the KV cache and some drafts are rejected (random Llamas are too chaotic to draft for).
    target = bigram_target(root / "target", vocab, context=0.005)
    return {
        "target": target,
        "vocab": vocab,
        "trained": eagle_head(target, root / "trained", draft_vocab=vocab // 2, steps=400),
        "untrained": eagle_head(target, root / "untrained", draft_vocab=vocab // 2, steps=0),
    }


def prompts(vocab: int, n: int = 8) -> list[list[int]]:
    return [torch.randint(2, vocab, (3 + (5 * i) % 11,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]


def engine(target: Path, head: Path | None, max_num_seqs: int = 8, steps: int = 3) -> LLMEngine:
    spec = SpeculativeConfig.parse({"method": "eagle", "model": str(head), "num_speculative_tokens": steps}) if head else None
    return LLMEngine(EngineConfig(model=target, speculative=spec, max_num_seqs=max_num_seqs))


def greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]


def test_engine_head_computes_what_the_trainer_trained(models, tmp_path):
    """The engine's plain-tensor head against the trainer's nn.Module on the same (saved) weights."""
    from transformers import LlamaForCausalLM

    from spectune.engine.train import TrainConfig, train_eagle

    hf = LlamaForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    cfg = TrainConfig(batch_size=2, seq_len=32, vocab_size=models["vocab"], eagle_steps=3, warmup_steps=1,
                      eagle_head_size=32, eagle_intermediate_size=64, eagle_vocab_size=50, repeat_fraction=0.0)
    trained = train_eagle(hf, torch.randint(0, models["vocab"], (500,)), cfg)
    from spectune.engine.train import save_eagle

    save_eagle(trained, tmp_path / "head")
    head = load_eagle(tmp_path / "head", load_model(models["target"]))
    gen = torch.Generator().manual_seed(1)
    feature = torch.nn.functional.rms_norm(torch.randn(5, 64, generator=gen), (64,))
    tokens = torch.randint(0, models["vocab"], (5,), generator=gen)
    got_feature, got_logits = head.step(feature, tokens)
    with torch.no_grad():
        want_feature = trained.head(feature, hf.model.embed_tokens.weight[tokens])
        want_logits = trained.logits(want_feature)
    torch.testing.assert_close(got_feature, want_feature, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(head.vocab, trained.vocab)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_greedy_eagle_speculation_is_lossless(models, max_num_seqs):
    target, vocab = models["target"], models["vocab"]
    expected = engine(target, None, max_num_seqs).generate(prompts(vocab), greedy(MAX_TOKENS))
    e = engine(target, models["trained"], max_num_seqs)
    got = e.generate(prompts(vocab), greedy(MAX_TOKENS))
    assert got == expected
    assert 0 < e.metrics.num_accepted_tokens < e.metrics.num_draft_tokens  # both accepting and rejecting were exercised


def test_training_the_head_raises_acceptance(models):
    target, vocab = models["target"], models["vocab"]
    rates = {}
    for name in ("untrained", "trained"):
        e = engine(target, models[name])
        e.generate(prompts(vocab), greedy([32] * 8))
        rates[name] = e.metrics.num_accepted_tokens / e.metrics.num_draft_tokens
    assert rates["trained"] > rates["untrained"] + 0.1, rates


def test_drafts_stay_inside_the_draft_vocabulary(models):
    target, vocab = models["target"], models["vocab"]
    e = LLMEngine(EngineConfig(model=target, max_num_seqs=4, speculative=SpeculativeConfig.parse(
        {"method": "eagle", "model": str(models["trained"]), "num_speculative_tokens": 4})))
    head_vocab = set(e.runner.proposer.head.vocab.tolist())
    assert len(head_vocab) == vocab // 2
    propose = e.runner.proposer.propose  # a spy: records the real proposals, changes nothing
    seen: list[int] = []

    def recording(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        seen.extend(proposal.tokens.flatten().tolist())
        return proposal

    e.runner.proposer.propose = recording
    e.generate(prompts(vocab, 4), greedy([16] * 4))
    assert seen and set(seen) <= head_vocab


def test_a_head_of_another_architecture_is_refused_naming_the_file(models, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SpectuneError, match=r"bad/config.json: architectures must be"):
        engine(models["target"], bad)


def test_a_head_trained_for_another_target_is_refused(models, tmp_path):
    other = llama(tmp_path / "other", models["vocab"], hidden=32, heads=2, kv_heads=1)
    with pytest.raises(SpectuneError, match="hidden_size 64 != the target's 32"):
        engine(other, models["trained"])
