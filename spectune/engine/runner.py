"""The model runner: owns the tensors (target, its KV cache, the proposer) and runs prefill and verify rounds."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from spectune.engine.model import Llama
from spectune.engine.proposers import Proposer
from spectune.engine.scheduler import Sequence
from spectune.engine.speculative import greedy_verify, probs_from_logits, rejection_verify, sample


@dataclass(slots=True)
class RoundResult:
    """One verify round: the tokens each request gained and what the proposer did."""

    new_tokens: list[list[int]]
    num_steps: int
    proposed: list[int]  # drafts proposed per request
    accepted: list[int]  # drafts accepted per request, excluding the bonus/correction token
    round_ms: float  # draft + verify + accept, wall


class ModelRunner:
    """Owns the tensors: the target and its KV cache, the proposer, and the per-request random draws."""

    def __init__(self, target: Llama, proposer: Proposer | None, num_slots: int):
        self.target = target
        self.proposer = proposer
        self.cache = target.new_cache(num_slots)

    def prefill(self, seqs: list[Sequence]) -> list[list[int]]:
        """Run each prompt through the target (and the draft), sample the first output token."""
        prompts = [seq.prompt_ids for seq in seqs]
        slots = [seq.slot for seq in seqs]
        for slot in slots:
            self.cache.lengths[slot] = 0
        tokens = torch.zeros(len(seqs), max(map(len, prompts)), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt)
        lens = [len(p) for p in prompts]
        hidden = self.target.forward(tokens, slots, self.cache, lens)  # [B, T, D]
        logits = self.target.logits(hidden[torch.arange(len(seqs)), torch.tensor(lens) - 1])  # [B, V]
        temperatures = _temperatures(seqs)
        if bool((temperatures > 0).any()):
            first = sample(probs_from_logits(logits, temperatures), _uniforms(seqs, 1)[:, 0])
        else:
            first = logits.argmax(-1)
        if self.proposer is not None:
            self.proposer.prefill(seqs, hidden[torch.arange(len(seqs)), torch.tensor(lens) - 1])
        return [[t] for t in first.tolist()]

    def speculate(self, seqs: list[Sequence], num_steps: int) -> RoundResult:
        """Draft up to num_steps tokens per sequence, verify all in one batched target forward, accept."""
        t0 = time.perf_counter()
        bsz = len(seqs)
        temperatures = _temperatures(seqs)
        sampled = bool((temperatures > 0).any())
        # Draft up to the KV cache's end only, not to max_tokens: like vLLM, drafts past max_tokens are verified
        # (and counted) and the surplus tokens are dropped.
        limits = [self.cache.max_len - seq.num_tokens for seq in seqs]
        if num_steps > 0 and self.proposer is not None and max(limits) > 0:
            uniforms = _uniforms(seqs, num_steps) if sampled else torch.zeros(bsz, num_steps)
            proposal = self.proposer.propose(seqs, num_steps, limits, temperatures, uniforms)
            draft, num_draft, draft_probs = proposal.tokens, proposal.num_draft, proposal.probs
        else:
            draft, num_draft, draft_probs = torch.zeros(bsz, 0, dtype=torch.long), torch.zeros(bsz, dtype=torch.long), None
        g = draft.shape[1]
        last = torch.tensor([[seq.last_token] for seq in seqs])
        inputs = torch.cat([last, draft], dim=1)  # [B, G + 1]: last token, then drafts
        slots = [seq.slot for seq in seqs]
        starts = [self.cache.lengths[s] for s in slots]
        counts = (num_draft + 1).tolist()
        hidden = self.target.forward(inputs, slots, self.cache, counts if min(counts) < g + 1 else None)
        logits = self.target.logits(hidden)  # [B, G + 1, V]
        if not sampled:
            num_accepted, next_token = greedy_verify(draft, num_draft, logits)
        else:
            target_probs = probs_from_logits(logits, temperatures)
            if draft_probs is None:  # deterministic proposals (n-gram) are one-hot distributions
                draft_probs = torch.zeros(bsz, g, logits.shape[-1]).scatter_(-1, draft[..., None], 1.0)
            num_accepted, next_token = rejection_verify(draft, num_draft, draft_probs, target_probs, _uniforms(seqs, g + 1))
        if self.proposer is not None:
            self.proposer.observe(seqs, hidden[torch.arange(bsz), num_accepted])  # the input that produced next_token
        accepted = num_accepted.tolist()
        # Keep the last input and the accepted drafts in the KV cache; rejected ones are rolled back.
        for slot, start, n in zip(slots, starts, accepted):
            self.cache.lengths[slot] = start + 1 + n
        drafts = draft.tolist()
        new_tokens = [row[:n] + [t] for row, n, t in zip(drafts, accepted, next_token.tolist())]
        return RoundResult(new_tokens, num_steps, num_draft.tolist(), accepted, (time.perf_counter() - t0) * 1000)


def _temperatures(seqs: list[Sequence]) -> torch.Tensor:
    return torch.tensor([seq.params.temperature for seq in seqs], dtype=torch.float32)


def _uniforms(seqs: list[Sequence], n: int) -> torch.Tensor:
    """[B, n] draws in [0, 1), each row from its request's own generator; greedy rows draw nothing (zeros)."""
    rows = [torch.rand(n, generator=seq.generator) if seq.params.temperature > 0 else torch.zeros(n) for seq in seqs]
    return torch.stack(rows)
