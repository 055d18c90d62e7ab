"""Lossless sampling: speculative output is distributed as the target's, shown by a chi-square test that a
deliberately broken acceptance rule fails."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from engine_models import dflash_head, eagle_head, llama
from scipy.stats import chisquare

import spectune.engine.runner as runner_module
from spectune.engine.config import EngineConfig, SpeculativeConfig
from spectune.engine.engine import LLMEngine
from spectune.engine.scheduler import SamplingParams
from spectune.engine.speculative import (
    greedy_verify,
    probs_from_logits,
    rejection_verify,
    sample,
)

torch.set_num_threads(1)  # two busy shared cores: more threads only spin
VOCAB = 8
PROMPT = [3, 5, 2, 6, 3, 5, 2]  # repetitive, so the n-gram proposer drafts too
TEMPERATURE = 0.8
SAMPLES = 3000
ALPHA = 1e-3  # a correct sampler fails this test one run in a thousand


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    root = tmp_path_factory.mktemp("sampling")
    # A draft with other random weights: q differs from p a lot, so rejections (and their resampling) are common.
    target = llama(root / "target", VOCAB, layers=1, hidden=32, init_std=0.5)
    draft = llama(root / "draft", VOCAB, layers=1, hidden=32, init_std=0.5, seed=7)
    # untrained EAGLE and dflash heads (random weights) whose draft vocabulary leaves out 2 of the 8 tokens: q = 0 there
    return (target, draft, eagle_head(target, root / "eagle", draft_vocab=VOCAB - 2, steps=0),
            dflash_head(target, root / "dflash", draft_vocab=VOCAB - 2, steps=0))


def exact_pair_distribution(target: Path) -> torch.Tensor:
    """P(t2, t3) of the target at TEMPERATURE, summing over t1: [V, V]. Tokens t2 and t3 are the ones drafted."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])  # [V*V, L+2]
    with torch.no_grad():
        probs = torch.softmax(model(seqs).logits.double() / TEMPERATURE, -1)
    p1 = probs[0, len(PROMPT) - 1]  # [V]: t1 | prompt
    p2 = probs[:: VOCAB, len(PROMPT)]  # [V, V]: t2 | t1 (rows t1)
    p3 = probs[:, len(PROMPT) + 1].view(VOCAB, VOCAB, VOCAB)  # t3 | t1, t2
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def sample_pairs(target: Path, draft: Path | None, method: str | None) -> torch.Tensor:
    """Counts of (t2, t3) over SAMPLES seeded requests of 4 tokens; with speculation t2, t3 are verified drafts."""
    spec = None
    if method == "draft_model":
        spec = SpeculativeConfig.parse({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    elif method in ("eagle", "dflash"):
        spec = SpeculativeConfig.parse({"method": method, "model": str(draft), "num_speculative_tokens": 3})
    elif method == "ngram":
        spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    engine = LLMEngine(EngineConfig(model=target, speculative=spec, max_num_seqs=64))
    params = [SamplingParams(max_tokens=4, temperature=TEMPERATURE, ignore_eos=True, seed=i) for i in range(SAMPLES)]
    outputs = engine.generate([PROMPT] * SAMPLES, params)
    if spec is not None:
        assert engine.metrics.num_draft_tokens > SAMPLES  # the drafts really went through verification
        assert 0 < engine.metrics.num_accepted_tokens < engine.metrics.num_draft_tokens  # accepts and rejects both
    counts = torch.zeros(VOCAB, VOCAB)
    for out in outputs:
        counts[out[1], out[2]] += 1
    return counts


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness of fit; cells expected below 5 are pooled into one."""
    observed, expected = counts.flatten().double(), expected_probs.flatten() * counts.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("method", [None, "draft_model", "eagle", "dflash", "ngram"], ids=["target_only", "draft_model", "eagle", "dflash", "ngram"])
def test_sampled_output_matches_target_distribution(models, method):
    target, draft, eagle, dflash = models
    p = chi_square_p(sample_pairs(target, {"eagle": eagle, "dflash": dflash}.get(method, draft), method), exact_pair_distribution(target))
    assert p > ALPHA, f"output distribution differs from the target's (chi-square p={p:.2e})"


def _resample_from_target_on_reject(draft, num_draft, draft_probs, target_probs, uniforms):
    """The classic mistake: after a rejection draw from p instead of normalize(max(0, p - q)).
    Accepted tokens then over-represent the draft's choices and the output is no longer the target's."""
    num_accepted, _ = rejection_verify(draft, num_draft, draft_probs, target_probs, uniforms)
    p_next = target_probs[torch.arange(draft.shape[0]), num_accepted]
    return num_accepted, sample(p_next, uniforms[:, draft.shape[1]])


def test_chi_square_catches_broken_rule_injected(models, monkeypatch):
    """A fault no real part produces, injected by replacing the engine's verify function: the same test must fail."""
    target, draft, *_ = models
    monkeypatch.setattr(runner_module, "rejection_verify", _resample_from_target_on_reject)
    p = chi_square_p(sample_pairs(target, draft, "draft_model"), exact_pair_distribution(target))
    assert p < ALPHA, f"the broken rule went unnoticed (p={p:.2e}); the test has no power"


def test_seeded_requests_are_reproducible(models):
    target, draft, *_ = models
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})

    def run(seeds: list[int]) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(model=target, speculative=spec, max_num_seqs=4))
        params = [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=s) for s in seeds]
        return engine.generate([PROMPT] * len(seeds), params)

    first = run([11, 12, 13, 14])
    assert run([11, 12, 13, 14]) == first
    assert run([21, 22, 23, 24]) != first


def test_greedy_verify_accepts_the_matching_prefix_and_caps_at_num_draft():
    # target argmax per position: [5, 6, 7, 8]; drafts of 3 tokens, right-padded rows
    logits = torch.nn.functional.one_hot(torch.tensor([[5, 6, 7, 8]] * 3), 10).float()
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [5, 6, 7]])
    num_accepted, next_token = greedy_verify(draft, torch.tensor([3, 3, 1]), logits)
    assert num_accepted.tolist() == [3, 1, 1]  # all; stop at the first mismatch; capped by the row's one real draft
    assert next_token.tolist() == [8, 6, 6]  # bonus; correction; bonus after the last real draft


def test_rejection_verify_with_one_hot_distributions_is_greedy():
    """Temperature 0 rows ride the sampling path as one-hot p and q; they must behave exactly as greedy."""
    logits = torch.randn(4, 4, 10, generator=torch.Generator().manual_seed(0))
    draft = torch.cat([logits[:2, :3].argmax(-1), torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(1))])
    num_draft = torch.tensor([3, 2, 3, 3])
    q = torch.nn.functional.one_hot(draft, 10).float()
    p = probs_from_logits(logits, torch.zeros(4))
    got = rejection_verify(draft, num_draft, q, p, torch.rand(4, 4))
    expected = greedy_verify(draft, num_draft, logits)
    assert got[0].tolist() == expected[0].tolist() and got[1].tolist() == expected[1].tolist()
    assert got[0].tolist()[:2] == [3, 2]


def test_inverse_cdf_sample_skips_zero_weight_tokens():
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0]] * 3)
    assert sample(weights, torch.tensor([0.0, 0.2499, 0.25])).tolist() == [1, 1, 3]
