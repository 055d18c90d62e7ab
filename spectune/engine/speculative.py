"""The speculative core: sampling and lossless verification, tensors in and tensors out.

Rows of a batch may carry different numbers of draft tokens: drafts are right-padded to G and `num_draft`
caps how many of them can be accepted. A temperature-0 row is the special case of one-hot distributions,
so a batch mixing greedy and sampled requests goes through `rejection_verify` unchanged.
"""

from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits: [B, ..., V], temperatures: [B] -> probs [B, ..., V]; temperature 0 rows become one-hot(argmax)."""
    t = temperatures.view(-1, *([1] * (logits.dim() - 1)))
    probs = torch.softmax(logits / t.clamp_min(1e-6), dim=-1)
    greedy = one_hot_argmax(logits)
    return torch.where(t > 0, probs, greedy)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    # [..., V] -> one-hot of the argmax, same dtype
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. weights: [..., V] non-negative (need not sum to 1), uniforms: [...] in [0, 1) -> [...] long.

    Using caller-drawn uniforms keeps every draw on the request's own torch.Generator.
    """
    cdf = weights.double().cumsum(-1)  # [..., V]
    target = uniforms.double().unsqueeze(-1) * cdf[..., -1:]  # [..., 1]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_max(weights.shape[-1] - 1)


def greedy_verify(draft: torch.Tensor, num_draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept draft i iff it equals the target argmax at i and all before it were accepted.

    draft: [B, G] long, num_draft: [B] (drafts beyond it are padding), target_logits: [B, G + 1, V]
    (position i scores the token after input i, inputs being [last token, draft_1 .. draft_G]).
    Returns num_accepted [B] and next_token [B]: the target's token at the first rejected position, or the
    bonus token after the last draft when all were accepted.
    """
    best = target_logits.argmax(-1)  # [B, G + 1]
    g = draft.shape[1]
    real = torch.arange(g)[None, :] < num_draft[:, None]  # [B, G]
    match = (draft == best[:, :g]) & real
    num_accepted = match.long().cumprod(-1).sum(-1)  # [B]
    next_token = best.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def rejection_verify(
    draft: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling (Leviathan et al.): output tokens are distributed exactly as the target's.

    draft: [B, G] long, num_draft: [B], draft_probs q: [B, G, V] (the distributions the drafts were drawn from),
    target_probs p: [B, G + 1, V], uniforms: [B, G + 1] in [0, 1) (G acceptance tests + 1 final draw).
    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), tested as u_i * q < p. At the first
    rejection the next token comes from normalize(max(0, p - q)); if all num_draft drafts pass, a bonus token
    comes from p at position num_draft. Returns num_accepted [B] and next_token [B].
    """
    bsz, g = draft.shape
    p_draft = target_probs[:, :g].gather(-1, draft[..., None]).squeeze(-1)  # [B, G]
    q_draft = draft_probs.gather(-1, draft[..., None]).squeeze(-1)  # [B, G]
    real = torch.arange(g)[None, :] < num_draft[:, None]
    accept = (uniforms[:, :g] * q_draft < p_draft) & real
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(bsz)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft
    q_next = draft_probs[rows, num_accepted.clamp_max(max(g - 1, 0))] if g else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp_min(0)
    # p == q up to rounding leaves no residual mass; p itself is then the right distribution.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    weights = torch.where(rejected[:, None], residual, p_next)
    return num_accepted, sample(weights, uniforms[:, g])
