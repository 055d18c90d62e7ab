"""Draft proposers: a small draft model with its own KV cache, an EAGLE-style head on the target's hidden
states, a parallel (DFlash-style) block drafter on the same states, or n-gram prompt lookup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from spectune.engine.dflash import DFlashHead
from spectune.engine.eagle import EagleHead
from spectune.engine.model import Llama
from spectune.engine.scheduler import Sequence
from spectune.engine.speculative import probs_from_logits, sample


@dataclass(slots=True)
class Proposal:
    tokens: torch.Tensor  # [B, G] long, right-padded
    num_draft: torch.Tensor  # [B] real drafts per row (<= G)
    probs: torch.Tensor | None  # [B, G, V] distributions the drafts were drawn from; None -> deterministic (one-hot)


class Proposer(Protocol):
    def prefill(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """After the target's prefill; hidden [B, D]: the target's feature at each prompt's last position."""
        ...

    def observe(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """After a verify round; hidden [B, D]: the target's feature at each sequence's last kept input."""
        ...

    def propose(
        self, seqs: list[Sequence], num_steps: int, limits: list[int], temperatures: torch.Tensor, uniforms: torch.Tensor
    ) -> Proposal:
        """Up to min(num_steps, limits[b]) drafts per row; temperatures [B]; uniforms [B, num_steps] for sampled rows."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM `ngram`): the longest suffix n-gram (min..max) found earlier in prompt + output
    proposes the tokens that followed its earliest occurrence. May propose fewer than asked, or none."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def prefill(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        pass

    def observe(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        pass

    def propose(
        self, seqs: list[Sequence], num_steps: int, limits: list[int], temperatures: torch.Tensor, uniforms: torch.Tensor
    ) -> Proposal:
        found = [ngram_lookup(np.asarray(seq.token_ids), self.min_n, self.max_n, min(num_steps, limit)) for seq, limit in zip(seqs, limits)]
        width = max(len(f) for f in found)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, f in enumerate(found):
            tokens[row, : len(f)] = torch.from_numpy(f)
        return Proposal(tokens, torch.tensor([len(f) for f in found]), None)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """tokens: [N] -> up to k continuation tokens of the longest matching suffix n-gram (earliest match)."""
    if k <= 0:
        return tokens[:0]
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [N - n, n]: every earlier n-gram
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = hits[0] + n
            return tokens[start : start + k]
    return tokens[:0]


class DraftModelProposer:
    """Autoregressive draft model, batched over the running sequences, with a KV cache slot per sequence.

    Its cache holds a prefix of each sequence's tokens. Drafts the target accepted are sequence tokens, so after a
    round the valid draft prefix is min(draft length, num_tokens - 1); the first draft step feeds the rest (one
    token, two after an all-accepted round, more after rounds without speculation) as a ragged batch.
    """

    def __init__(self, model: Llama, num_slots: int):
        self.model = model
        self.cache = model.new_cache(num_slots)

    def prefill(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        for seq in seqs:
            self.cache.lengths[seq.slot] = 0
        prompts = [seq.prompt_ids for seq in seqs]
        self.model.forward(_pad(prompts), [seq.slot for seq in seqs], self.cache, [len(p) for p in prompts])

    def observe(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        pass

    def propose(
        self, seqs: list[Sequence], num_steps: int, limits: list[int], temperatures: torch.Tensor, uniforms: torch.Tensor
    ) -> Proposal:
        bsz = len(seqs)
        slots = [seq.slot for seq in seqs]
        lengths = self.cache.lengths
        tails = []
        for seq in seqs:
            lengths[seq.slot] = min(lengths[seq.slot], seq.num_tokens - 1)
            tails.append(seq.token_ids[lengths[seq.slot] :])
        steps = min(num_steps, max(limits))
        tokens = torch.zeros(bsz, steps, dtype=torch.long)
        sampled = bool((temperatures > 0).any())
        probs = torch.zeros(bsz, steps, self.model.config.vocab_size) if sampled else None
        inputs = _pad(tails)  # [B, T]
        num_new = [len(t) if limit > 0 else 0 for t, limit in zip(tails, limits)]
        rows = torch.arange(bsz)
        for step in range(steps):
            hidden = self.model.forward(inputs, slots, self.cache, num_new)  # [B, T, D]
            logits = self.model.logits(hidden[rows, torch.tensor(num_new).clamp_min(1) - 1])  # [B, V]
            if sampled:
                q = probs_from_logits(logits, temperatures)
                probs[:, step] = q
                tokens[:, step] = sample(q, uniforms[:, step])
            else:
                tokens[:, step] = logits.argmax(-1)
            inputs = tokens[:, step : step + 1]
            # A row past its limit stops writing (its padding goes to the scratch slot).
            num_new = [1 if step + 1 < limit else 0 for limit in limits]
        num_draft = torch.tensor([min(steps, limit) for limit in limits])
        return Proposal(tokens, num_draft, probs)


class _FeatureProposer:
    """A head that drafts from the target's feature at each sequence's last processed position, kept per KV slot;
    that feature is its only state, so rejected drafts leave nothing to undo."""

    def __init__(self, head: EagleHead | DFlashHead, num_slots: int):
        self.head = head
        self.features = torch.zeros(num_slots, head.config.hidden_size)

    def prefill(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        self.observe(seqs, hidden)

    def observe(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        self.features[[seq.slot for seq in seqs]] = hidden


class EagleProposer(_FeatureProposer):
    """Drafts step by step with an EAGLE-style head (eagle.py), each step feeding its own draft back."""

    def propose(
        self, seqs: list[Sequence], num_steps: int, limits: list[int], temperatures: torch.Tensor, uniforms: torch.Tensor
    ) -> Proposal:
        bsz, steps = len(seqs), min(num_steps, max(limits))
        vocab = self.head.vocab
        feature = self.features[[seq.slot for seq in seqs]]
        token = torch.tensor([seq.last_token for seq in seqs])
        tokens = torch.zeros(bsz, steps, dtype=torch.long)
        sampled = bool((temperatures > 0).any())
        probs = torch.zeros(bsz, steps, self.head.vocab_size) if sampled else None
        for step in range(steps):
            feature, logits = self.head.step(feature, token)  # logits over the draft vocabulary [B, K]
            if sampled:
                q = probs_from_logits(logits, temperatures)
                probs[:, step, vocab] = q  # zero outside the draft vocabulary
                token = vocab[sample(q, uniforms[:, step])]
            else:
                token = vocab[logits.argmax(-1)]
            tokens[:, step] = token
        return Proposal(tokens, torch.tensor([min(steps, limit) for limit in limits]), probs)


class DFlashProposer(_FeatureProposer):
    """Drafts a whole block in one pass of a DFlash-style head (dflash.py) from the feature and the sequence's last
    few tokens."""

    def propose(
        self, seqs: list[Sequence], num_steps: int, limits: list[int], temperatures: torch.Tensor, uniforms: torch.Tensor
    ) -> Proposal:
        steps = min(num_steps, max(limits), self.head.config.block_size)  # a step policy may ask past the block
        width = self.head.config.context_tokens
        # the last W tokens; a sequence shorter than that repeats its first token on the left
        recent = torch.tensor([([seq.token_ids[0]] * width + seq.token_ids[-width:])[-width:] for seq in seqs])  # [B, W]
        logits = self.head.draft(self.features[[seq.slot for seq in seqs]], recent, steps)  # [B, K, Vd]
        vocab = self.head.vocab
        probs = None
        if bool((temperatures > 0).any()):
            q = probs_from_logits(logits, temperatures)  # [B, K, Vd]; each slot drawn on its own, from its own q
            tokens = vocab[sample(q, uniforms[:, :steps])]
            probs = torch.zeros(len(seqs), steps, self.head.vocab_size)
            probs[:, :, vocab] = q  # zero outside the draft vocabulary
        else:
            tokens = vocab[logits.argmax(-1)]
        return Proposal(tokens, torch.tensor([min(steps, limit) for limit in limits]), probs)


def _pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out
