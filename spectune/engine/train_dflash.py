"""Train the parallel block drafter (dflash.py) on the shipped target; called by train.py (`--dflash-only` remakes
only this head from the target already in --out).

Self-distillation, as Medusa-2 and the DFlash / P-EAGLE recipes do: the target continues random windows of the
training corpus greedily, and the head learns, from the target's feature at position t and the tokens up to
x_{t+1}, the target's next-token distributions at t+1 .. t+K along that continuation. Along the target's own path
every anchor is a situation the head meets when its earlier drafts were accepted, which is the only case in which
a later draft matters; trained on the corpus instead, slot k would learn the target's choice after text the target
would not have written. Only `dflash_anchors` random anchors per sequence are trained each step (DFlash's sequence
sparsification); the target's features and distributions along the continuations are computed once, since every
sequence is visited many times.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from spectune.engine.dflash import DFlashConfig

if TYPE_CHECKING:  # train.py imports this module
    from spectune.engine.train import Eagle, TargetPaths, TrainConfig


class _Layer(torch.nn.Module):
    def __init__(self, head_size: int, intermediate_size: int):
        super().__init__()
        self.qkv = torch.nn.Linear(head_size, 3 * head_size, bias=False)
        self.o = torch.nn.Linear(head_size, head_size, bias=False)
        self.gate_up = torch.nn.Linear(head_size, 2 * intermediate_size, bias=False)
        self.down = torch.nn.Linear(intermediate_size, head_size, bias=False)


class DFlashTrainHead(torch.nn.Module):
    """The training twin of dflash.DFlashHead (same maths; parameters saved under the names it loads)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        d, h = config.hidden_size, config.head_size
        self.w_in = torch.nn.Linear(2 * d, h, bias=False)
        self.context_in = torch.nn.Linear(d, h, bias=False)
        self.context_pos = torch.nn.Parameter(0.02 * torch.randn(config.context_tokens - 1, h))
        self.slot_embed = torch.nn.Parameter(0.02 * torch.randn(config.block_size, h))
        self.layers = torch.nn.ModuleList(_Layer(h, config.intermediate_size) for _ in range(config.num_layers))
        self.w_out = torch.nn.Linear(h, d, bias=False)

    def forward(self, feature: torch.Tensor, embedded: torch.Tensor, num_slots: int) -> torch.Tensor:
        """feature [N, D], embedded [N, W, D] (embeddings of the last W tokens) -> predicted features [N, K, D]."""
        c, eps = self.config, self.config.rms_norm_eps
        n, h = feature.shape[0], c.head_size
        cond = self.w_in(torch.cat([feature, embedded[:, -1]], dim=-1))  # [N, H]
        parts = [self.context_in(embedded[:, :-1]) + self.context_pos] if c.context_tokens > 1 else []
        x = torch.cat([*parts, cond[:, None], cond[:, None] + self.slot_embed[:num_slots]], dim=1)  # [N, S, H]
        seq = x.shape[1]
        for layer in self.layers:
            q, k, v = layer.qkv(F.rms_norm(x, (h,), eps=eps)).view(n, seq, 3, c.num_heads, -1).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer.o(attn.transpose(1, 2).reshape(n, seq, h))
            gate, up = layer.gate_up(F.rms_norm(x, (h,), eps=eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        out = self.w_out(F.rms_norm(x[:, -num_slots:], (h,), eps=eps))
        return F.rms_norm(out, (c.hidden_size,), eps=eps)


@dataclass(slots=True)
class DFlash:
    head: DFlashTrainHead
    vocab: torch.Tensor  # [Vd] token ids, most frequent first
    lm_head: torch.Tensor  # [D, Vd]: the target's, final norm folded in, restricted to vocab
    coverage: float  # share of the generated training tokens inside vocab
    losses: list[float]
    step_s: float
    generate_s: float  # wall seconds spent making the training data (continuations and the target's outputs)

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        return feature @ self.lm_head


def head_config(target: LlamaForCausalLM, cfg: TrainConfig) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=target.config.hidden_size, head_size=cfg.dflash_head_size, intermediate_size=cfg.dflash_intermediate_size,
        num_layers=cfg.dflash_layers, num_heads=cfg.dflash_heads, block_size=cfg.dflash_block_size,
        context_tokens=cfg.dflash_context_tokens, draft_vocab_size=cfg.dflash_vocab_size, rms_norm_eps=target.config.rms_norm_eps,
    )


@dataclass(slots=True)
class Continuations:
    """The target's greedy continuations of corpus windows and what it computes along them, from the last prefix
    position on (index 0 = position prefix - 1): tokens [N, G + 1], features [N, G + 1, D], and the target's
    distribution of each next token over the draft vocabulary, probs [N, G, Vd] (probs[:, i] is that of tokens[:, i + 1])."""

    tokens: torch.Tensor
    features: torch.Tensor
    probs: torch.Tensor


@torch.no_grad()
def greedy_continuations(target: LlamaForCausalLM, stream: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """[N, prefix + generated]: corpus windows, each followed by the target's greedy continuation."""
    from spectune.engine.train import greedy_generate

    gen = torch.Generator().manual_seed(cfg.seed + 5)
    starts = torch.randint(0, len(stream) - cfg.dflash_prefix, (cfg.dflash_sequences,), generator=gen).tolist()
    prefixes = torch.stack([stream[s : s + cfg.dflash_prefix] for s in starts])
    return torch.cat([torch.cat([chunk, greedy_generate(target, chunk, cfg.dflash_generated)], dim=1)
                      for chunk in prefixes.split(64)])


@torch.no_grad()
def continuation_targets(target: LlamaForCausalLM, sequences: torch.Tensor, prefix: int, vocab: torch.Tensor) -> Continuations:
    """What training reads, computed once: every sequence is visited many times, at different anchors."""
    from spectune.engine.train import target_features

    parts = [target_features(target, chunk) for chunk in sequences.split(32)]
    features = torch.cat([f[:, prefix - 1 :] for f, _ in parts])  # [N, G + 1, D]
    probs = torch.cat([p[:, prefix - 1 : -1][..., vocab] for _, p in parts])  # [N, G, Vd]
    return Continuations(sequences[:, prefix - 1 :], features, probs)


def train_dflash(target: LlamaForCausalLM, stream: torch.Tensor, cfg: TrainConfig) -> DFlash:
    """Distil the head: for random anchors t on the target's greedy continuations, cross-entropy of slot k's draft
    distribution (over the draft vocabulary) to the target's distribution of x_{t+2+k}, slot k weighted by
    cfg.dflash_position_decay ** k."""
    import time

    from spectune.engine.train import run_steps

    started = time.perf_counter()
    sequences = greedy_continuations(target, stream, cfg)  # [N, prefix + generated]
    generated = sequences[:, cfg.dflash_prefix :]
    counts = torch.bincount(generated.flatten(), minlength=target.config.vocab_size)
    counts += torch.bincount(stream, minlength=target.config.vocab_size)  # rare and unseen tokens: corpus order
    config = head_config(target, cfg)
    vocab = torch.argsort(-counts, stable=True)[: config.draft_vocab_size]
    coverage = (torch.isin(generated, vocab).float().mean()).item()
    data = continuation_targets(target, sequences, cfg.dflash_prefix, vocab)
    generate_s = time.perf_counter() - started
    torch.manual_seed(cfg.seed + 4)
    head = DFlashTrainHead(config)
    embed = target.model.embed_tokens.weight.detach()
    lm_head = (target.model.norm.weight[:, None] * target.lm_head.weight.t()).detach()[:, vocab].contiguous()
    k, w = config.block_size, config.context_tokens
    # Anchor a is position t = prefix - 1 + a: feature data.features[:, a]; it drafts the tokens whose target
    # distributions are data.probs[:, a + 1 .. a + K]. tokens[:, j] is position prefix - W + j, so the window of the
    # last W tokens (t + 2 - W .. t + 1) is j = a + 1 .. a + W, reaching back into the corpus prefix.
    num_anchors = data.probs.shape[1] - k
    # Slot k's draft counts only when slots 1..k-1 were accepted, so earlier slots weigh more (as P-EAGLE does).
    weights = cfg.dflash_position_decay ** torch.arange(k, dtype=torch.float32)
    weights = weights / weights.sum()
    tokens = torch.cat([sequences[:, cfg.dflash_prefix - w : cfg.dflash_prefix - 1], data.tokens], dim=1)  # [N, W + G]

    def loss_fn(gen: torch.Generator) -> torch.Tensor:
        rows = torch.randint(0, len(sequences), (cfg.batch_size, 1), generator=gen)  # [B, 1]
        anchors = torch.randint(0, num_anchors, (cfg.batch_size, cfg.dflash_anchors), generator=gen)  # [B, A]
        window = tokens[rows[..., None], anchors[..., None] + 1 + torch.arange(w)]  # [B, A, W]
        p = data.probs[rows[..., None], anchors[..., None] + 1 + torch.arange(k)]  # [B, A, K, Vd]
        predicted = head(data.features[rows, anchors].flatten(0, 1), F.embedding(window, embed).flatten(0, 1), k)
        ce = -(p.flatten(0, 1) * torch.log_softmax(predicted @ lm_head, -1)).sum(-1)  # [B*A, K]
        return (ce * weights).sum(-1).mean()

    losses, step_s = run_steps("dflash", head, loss_fn, cfg.dflash_steps, cfg.dflash_lr, cfg.warmup_steps, cfg.seed + 4)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(param.half())  # shipped in fp16; evaluate exactly that
    return DFlash(head.eval(), vocab, lm_head, coverage, losses, step_s, generate_s)


# --- evaluation: acceptance per draft position along the target's greedy path ------------------------------------


@torch.no_grad()
def block_survival(target: LlamaForCausalLM, dflash: DFlash, tokens: torch.Tensor, choices: torch.Tensor,
                   num_slots: int) -> torch.Tensor:
    """S_k = share of anchors whose first k drafts all equal the target's greedy tokens, k = 1..num_slots ([K]).

    tokens [N, P + n]: prompts then the target's greedy continuation; choices [N, n]: the target's greedy token at
    those n positions. Anchors t = P-1 .. P+n-2-K: x_{t+1} is a generated token, as the last token is when drafting."""
    from spectune.engine.train import target_features

    features, _ = target_features(target, tokens[:, :-1])
    anchors, drafts = _anchors(tokens, choices, num_slots, dflash.head.config.context_tokens)
    n, a = anchors["t"].shape
    predicted = dflash.head(features[anchors["rows"], anchors["t"]].flatten(0, 1),
                            F.embedding(anchors["window"], target.model.embed_tokens.weight).flatten(0, 1), num_slots)
    choice = dflash.vocab[dflash.logits(predicted).argmax(-1)].view(n, a, num_slots)
    return (choice == drafts).long().cumprod(-1).float().mean((0, 1))


@torch.no_grad()
def chain_survival(target: LlamaForCausalLM, eagle: Eagle, tokens: torch.Tensor, choices: torch.Tensor, num_slots: int) -> torch.Tensor:
    """block_survival for the autoregressive EAGLE head (train.Eagle): each step feeds its own draft back."""
    from spectune.engine.train import target_features

    features, _ = target_features(target, tokens[:, :-1])
    anchors, drafts = _anchors(tokens, choices, num_slots, 1)
    embed = target.model.embed_tokens.weight
    feature, token = features[anchors["rows"], anchors["t"]], anchors["window"][..., -1]  # [N, A, D], [N, A]
    steps = []
    for _ in range(num_slots):
        feature = eagle.head(feature, F.embedding(token, embed))
        token = eagle.vocab[eagle.logits(feature).argmax(-1)]
        steps.append(token)
    return (torch.stack(steps, -1) == drafts).long().cumprod(-1).float().mean((0, 1))


def _anchors(tokens: torch.Tensor, choices: torch.Tensor, num_slots: int, width: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every anchor of every row: its index t, its last `width` tokens, and the K greedy tokens it should draft."""
    n, total = tokens.shape
    prompt = total - choices.shape[1]
    t = torch.arange(prompt - 1, total - 1 - num_slots)[None].expand(n, -1)  # [N, A]
    rows = torch.arange(n)[:, None]
    window = (t[..., None] + 2 - width + torch.arange(width)).clamp_min(0)  # [N, A, W]
    drafts = choices[rows[..., None], t[..., None] + 2 - prompt + torch.arange(num_slots)]  # [N, A, K]
    return {"t": t, "rows": rows, "window": tokens[rows[..., None], window]}, drafts


def survival_table(target: LlamaForCausalLM, dflash: DFlash, eagle: Eagle | None, paths: TargetPaths) -> dict[str, dict[str, torch.Tensor]]:
    """Per drafter (dflash; eagle when given, a train.Eagle), per workload of `paths` (train.TargetPaths): S_1..S_K."""
    k = dflash.head.config.block_size
    table = {"dflash": {name: block_survival(target, dflash, tokens, paths.choices[name], k) for name, tokens in paths.tokens.items()}}
    if eagle is not None:
        table["eagle"] = {name: chain_survival(target, eagle, tokens, paths.choices[name], k) for name, tokens in paths.tokens.items()}
    return table


def expected_tokens(survival: torch.Tensor, k: int) -> float:
    """Tokens per round drafting k: 1 + S_1 + ... + S_k."""
    return 1.0 + float(survival[:k].sum())


# --- files --------------------------------------------------------------------------------------------------------


def save_dflash(dflash: DFlash, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    config = dflash.head.config
    (out / "config.json").write_text(config.to_json())
    tensors = {name: t.detach().half().contiguous() for name, t in dflash.head.state_dict().items()}
    save_file({**tensors, "draft_vocab": dflash.vocab.to(torch.int32)}, str(out / "model.safetensors"), metadata={"format": "pt"})


def write_dflash_dir(dflash: DFlash, readme: str, out: Path) -> None:
    """Write `out` whole (staged beside it, then renamed), replacing what was there."""
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    save_dflash(dflash, staging)
    (staging / "README.md").write_text(readme)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def dflash_readme(dflash: DFlash, survival: dict[str, dict[str, torch.Tensor]], cfg: TrainConfig, command: str) -> str:
    """survival: per drafter ("dflash", "eagle"), per workload, S_1..S_K along the target's greedy paths."""
    c = dflash.head.config
    size = sum(p.numel() for p in dflash.head.parameters())
    k = len(next(iter(survival["dflash"].values())))
    header = " | ".join(f"a{i}" for i in range(1, k + 1))
    rows = []
    for drafter, per_workload in survival.items():
        for workload, s in per_workload.items():
            prev = torch.cat([torch.ones(1), s[:-1]])
            rates = " | ".join(f"{float(r):.2f}" for r in torch.where(prev > 0, s / prev.clamp_min(1e-9), torch.zeros_like(s)))
            e = " | ".join(f"{expected_tokens(s, g):.2f}" for g in (2, 4, 6, 8) if g <= k)
            rows.append(f"| {drafter} | {workload} | {rates} | {e} |")
    e_header = " | ".join(f"E(K={g})" for g in (2, 4, 6, 8) if g <= k)
    return f"""# DFlash-style parallel block drafter for the shipped target

Made by `spectune/engine/train.py` (see ../README.md; `{command}` remakes only this dir from ../target).
Method `dflash` (spectune/engine/dflash.py): one pass over a block of the last {c.context_tokens - 1} token(s), a
conditioning token (the target's last hidden state + the last token) and {c.block_size} learned mask slots, one
per future position; {c.num_layers} transformer layer(s) (causal attention, {c.num_heads} heads), head size
{c.head_size}, intermediate {c.intermediate_size}: {size / 1e6:.2f} M parameters of its own (fp16). Embeddings and
LM head are the target's, the LM head restricted to {c.draft_vocab_size} tokens ({dflash.coverage:.1%} of the
tokens the target generated for training).

Training (seed {cfg.seed + 4}): the target continued {cfg.dflash_sequences} random corpus windows of
{cfg.dflash_prefix} tokens greedily by {cfg.dflash_generated} tokens ({dflash.generate_s:.0f} s); then
{cfg.dflash_steps} steps (batch {cfg.batch_size} sequences x {cfg.dflash_anchors} anchors, {dflash.step_s:.2f} s
per step) of cross-entropy to the target's distribution at each of the {c.block_size} positions; final loss
{sum(dflash.losses[-20:]) / len(dflash.losses[-20:]):.3f}.

Acceptance per draft position along the target's greedy path on the held-out evaluation prompts (as in
../README.md; {cfg.eval_prompts} prompts x {cfg.eval_new_tokens} new tokens per workload, every anchor after the
prompt), greedy: a_k = P(draft k accepted | drafts 1..k-1 accepted), E(K) = expected tokens per verify round
drafting K. The autoregressive EAGLE head (../eagle) on the same anchors for comparison.

| drafter | workload | {header} | {e_header} |
|---|---|{"---|" * k}{"---|" * len([g for g in (2, 4, 6, 8) if g <= k])}
{chr(10).join(rows)}
"""
