"""The parallel (DFlash-style) block drafter: the engine's head computes what its trainer trained, drafting stays
lossless, one pass drafts the whole block whatever K is, training raises acceptance, and bad head files are refused
with one line naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_models import bigram_target, dflash_head, llama, write_tokenizer

from spectune.engine.config import EngineConfig, SpeculativeConfig
from spectune.engine.dflash import load_dflash
from spectune.engine.engine import LLMEngine
from spectune.engine.model import load_model
from spectune.engine.scheduler import SamplingParams
from spectune.errors import SpectuneError

torch.set_num_threads(1)  # two busy shared cores: more threads only spin
MAX_TOKENS = [24, 9, 31, 16, 5, 28, 12, 20]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash")
    vocab = write_tokenizer(root / "target")
    # Mostly a token -> token map (learnable in seconds) plus a little attention, so some drafts are rejected.
    target = bigram_target(root / "target", vocab, context=0.005)
    return {
        "target": target,
        "vocab": vocab,
        "trained": dflash_head(target, root / "trained", draft_vocab=vocab // 2, steps=400),
        "untrained": dflash_head(target, root / "untrained", draft_vocab=vocab // 2, steps=0),
    }


def prompts(vocab: int, n: int = 8) -> list[list[int]]:
    return [torch.randint(2, vocab, (3 + (5 * i) % 11,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]


def engine(target: Path, head: Path | None, max_num_seqs: int = 8, steps: int = 4) -> LLMEngine:
    spec = SpeculativeConfig.parse({"method": "dflash", "model": str(head), "num_speculative_tokens": steps}) if head else None
    return LLMEngine(EngineConfig(model=target, speculative=spec, max_num_seqs=max_num_seqs))


def greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]


def test_engine_head_computes_what_the_trainer_trained(models, tmp_path):
    """The engine's plain-tensor head against the trainer's nn.Module on the same (saved) weights."""
    from transformers import LlamaForCausalLM

    from spectune.engine.train import TrainConfig
    from spectune.engine.train_dflash import save_dflash, train_dflash

    hf = LlamaForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    cfg = TrainConfig(batch_size=2, vocab_size=models["vocab"], warmup_steps=1, dflash_steps=3, dflash_head_size=32,
                      dflash_intermediate_size=64, dflash_layers=2, dflash_heads=2, dflash_block_size=6,
                      dflash_context_tokens=3, dflash_vocab_size=50, dflash_sequences=4, dflash_prefix=6,
                      dflash_generated=16, dflash_anchors=4)
    trained = train_dflash(hf, torch.randint(0, models["vocab"], (500,)), cfg)
    save_dflash(trained, tmp_path / "head")
    head = load_dflash(tmp_path / "head", load_model(models["target"]))
    gen = torch.Generator().manual_seed(1)
    feature = torch.nn.functional.rms_norm(torch.randn(5, 64, generator=gen), (64,))
    tokens = torch.randint(0, models["vocab"], (5, 3), generator=gen)
    for k in (1, 6):
        got = head.draft(feature, tokens, k)
        with torch.no_grad():
            want = trained.logits(trained.head(feature, hf.model.embed_tokens.weight[tokens], k))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(head.vocab, trained.vocab)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_greedy_dflash_speculation_is_lossless(models, max_num_seqs):
    target, vocab = models["target"], models["vocab"]
    expected = engine(target, None, max_num_seqs).generate(prompts(vocab), greedy(MAX_TOKENS))
    for steps in (3, 8):
        e = engine(target, models["trained"], max_num_seqs, steps)
        assert e.generate(prompts(vocab), greedy(MAX_TOKENS)) == expected
        assert 0 < e.metrics.num_accepted_tokens < e.metrics.num_draft_tokens  # both accepting and rejecting exercised


def test_training_the_head_raises_acceptance(models):
    """First-draft acceptance and accepted drafts per round. Later positions stay low on this target: its next token
    is a lookup of the current one, and slot k must learn that lookup composed k times."""
    target, vocab = models["target"], models["vocab"]
    first, per_round = {}, {}
    for name in ("untrained", "trained"):
        e = engine(target, models[name])
        e.generate(prompts(vocab), greedy([32] * 8))
        first[name] = e.metrics.accepted_per_pos[0] / e.metrics.num_drafts
        per_round[name] = e.metrics.num_accepted_tokens / e.metrics.num_drafts
    assert first["trained"] > first["untrained"] + 0.2, first
    assert per_round["trained"] > per_round["untrained"] + 0.2, per_round


def test_one_pass_drafts_the_whole_block_whatever_k(models):
    """Why drafting cost does not grow with K (a behaviour check, not a timing): every verify round runs the head
    once, with K slots, at every K; and K drafts are the first K of a full block's (causal attention in the block)."""
    target, vocab = models["target"], models["vocab"]
    for k in (1, 2, 5, 8):
        e = engine(target, models["trained"], 4, k)
        head, runner = e.runner.proposer.head, e.runner
        calls: list[int] = []
        rounds: list[int] = []
        real_draft, real_speculate = head.draft, runner.speculate

        def counting_draft(feature, tokens, num_slots):  # spies: count the real calls, change nothing
            calls.append(num_slots)
            return real_draft(feature, tokens, num_slots)

        def counting_speculate(seqs, num_steps):
            rounds.append(num_steps)
            return real_speculate(seqs, num_steps)

        head.draft, runner.speculate = counting_draft, counting_speculate
        e.generate(prompts(vocab, 4), greedy([40] * 4))
        assert rounds and calls == [k] * len(rounds)
    head = load_dflash(models["trained"], load_model(target))
    gen = torch.Generator().manual_seed(0)
    feature = torch.nn.functional.rms_norm(torch.randn(3, 64, generator=gen), (64,))
    window = torch.randint(0, vocab, (3, 2), generator=gen)
    full = head.draft(feature, window, 8)
    for k in range(1, 8):
        torch.testing.assert_close(head.draft(feature, window, k), full[:, :k], atol=1e-5, rtol=1e-5)


def test_sampled_drafts_come_with_their_distributions(models):
    """For temperature > 0 the drafter returns, per position, the distribution it drew from (what rejection
    sampling divides by): a distribution over the target's vocabulary, zero outside the draft vocabulary, with the
    drawn token inside its support."""
    target, vocab = models["target"], models["vocab"]
    e = engine(target, models["trained"], 4, 5)
    propose = e.runner.proposer.propose
    seen = []

    def recording(*args, **kwargs):  # a spy: records the real proposals, changes nothing
        proposal = propose(*args, **kwargs)
        seen.append(proposal)
        return proposal

    e.runner.proposer.propose = recording
    e.generate(prompts(vocab, 4), [SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True, seed=s) for s in range(4)])
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[e.runner.proposer.head.vocab] = False
    assert seen
    for proposal in seen:
        q = proposal.probs  # [B, K, V]
        assert q.shape == (*proposal.tokens.shape, vocab)
        torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:2]))
        assert float(q[..., outside].abs().max()) == 0.0
        assert bool((q.gather(-1, proposal.tokens[..., None]) > 0).all())


def test_default_model_is_the_shipped_head_and_k_is_capped_by_its_block(monkeypatch, models, tmp_path):
    from spectune.engine import shipped

    monkeypatch.setattr(shipped, "ASSETS", tmp_path)  # an asset dir without a dflash head
    spec = SpeculativeConfig.parse({"method": "dflash", "num_speculative_tokens": 3})
    assert spec.model is None
    with pytest.raises(SpectuneError, match=r"dflash: shipped model missing"):
        LLMEngine(EngineConfig(model=models["target"], speculative=spec))
    shutil.copytree(models["trained"], tmp_path / "dflash")
    assert LLMEngine(EngineConfig(model=models["target"], speculative=spec)).runner.proposer.head.config.block_size == 8
    with pytest.raises(SpectuneError, match=r"9 exceeds the dflash head's block_size 8 \(.*config.json\)"):
        engine(models["target"], models["trained"], steps=9)


def _broken(models, tmp_path, change) -> Path:
    bad = tmp_path / "head"
    shutil.copytree(models["trained"], bad)
    change(bad)
    return bad


def _drop_tensor(path: Path, name: str, reshape: bool = False) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    if reshape:
        weights[name] = weights[name][:-1]
    else:
        del weights[name]
    save_file(weights, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: (p / "config.json").unlink(), r"head/config.json: cannot read the dflash head's config"),
        (lambda p: (p / "config.json").write_text("{oops"), r"head/config.json: cannot read the dflash head's config"),
        (lambda p: (p / "config.json").write_text(json.dumps({"architectures": ["SpectuneEagleHead"]})),
         r"head/config.json: architectures must be \['SpectuneDFlashHead'\]"),
        (lambda p: (p / "config.json").write_text(json.dumps({"architectures": ["SpectuneDFlashHead"], "hidden_size": 64})),
         r"head/config.json: missing head_size"),
        (lambda p: (p / "model.safetensors").unlink(), r"head/model.safetensors: missing"),
        (lambda p: (p / "model.safetensors").write_bytes(b"not safetensors"), r"head/model.safetensors: not a readable safetensors file"),
        (lambda p: _drop_tensor(p, "layers.0.qkv.weight"), r"head/model.safetensors: tensor 'layers.0.qkv.weight' is missing"),
        (lambda p: _drop_tensor(p, "slot_embed", reshape=True), r"head/model.safetensors: tensor 'slot_embed' has shape \(7, 64\)"),
    ],
    ids=["no_config", "bad_json", "eagle_head", "config_fields", "no_weights", "corrupt_weights", "missing_tensor", "wrong_shape"],
)
def test_wrong_or_missing_head_files_are_refused_naming_the_file(models, tmp_path, change, message):
    bad = _broken(models, tmp_path, change)
    with pytest.raises(SpectuneError, match=message) as info:
        engine(models["target"], bad)
    assert "\n" not in str(info.value)


def test_a_head_trained_for_another_target_is_refused(models, tmp_path):
    other = llama(tmp_path / "other", models["vocab"], hidden=32, heads=2, kv_heads=1)
    with pytest.raises(SpectuneError, match="hidden_size 64 != the target's 32"):
        engine(other, models["trained"])
