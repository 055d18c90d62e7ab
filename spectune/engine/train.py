"""Train the shipped tokenizer, target, draft and draft heads on the Python standard library's own sources.

    python -m spectune.engine.train --out spectune/engine/assets [--steps N] [--seed S]

Everything is local and deterministic from the seed (same Python stdlib, torch version and thread
count give identical bytes): a byte-level BPE tokenizer (GPT-2 pre-tokenizer regex), a 4-layer Llama
target trained on next-token loss, a 1-layer Llama draft that shares the target's frozen embeddings
and learns its layer by distillation (KL to the target's logits), an EAGLE-style head (eagle.py) and a
parallel block drafter (dflash.py, trained in train_dflash.py) on the target's hidden states. The script
measures the drafts' greedy agreement with the target per workload and writes it, with the losses and
timings, to <out>/README.md (the heads' figures to eagle/README.md and dflash/README.md).
`--eagle-only` / `--dflash-only` remake one head from the target already in --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from spectune.engine.train_dflash import DFlash, dflash_readme, survival_table, train_dflash, write_dflash_dir

EOS = "<|endoftext|>"
EOS_ID = 0  # the only special token, trained first
# Test suites, codec tables and pydoc's topic dump are large and unlike ordinary code.
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"})
HELD_OUT_EVERY = 10  # every 10th file (sorted order) is held out for evaluation
NOISE_LEVELS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5)


@dataclass(slots=True, frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 1000  # target optimizer steps
    draft_steps: int = 500  # draft distillation steps
    batch_size: int = 8  # 8 and 16 reached the same loss per token trained; 8 keeps progress fine-grained
    seq_len: int = 256
    vocab_size: int = 2048
    lr: float = 3e-3
    draft_lr: float = 3e-3
    warmup_steps: int = 50
    # Share of each batch that is a span followed by copies of itself, there to teach the target to
    # copy its context (induction heads); at the default budget copying has not emerged yet (README).
    repeat_fraction: float = 0.25
    corpus_mb: float | None = None  # cap on the corpus size, for quick runs
    eval_prompts: int = 16
    eval_new_tokens: int = 64
    threads: int = 2
    # EAGLE-style head (eagle.py): sizes picked so a draft step costs under 0.1 of a target forward at batch 1
    # (its weights, 2.4 MB in fp32, about fit a core's L2 cache; 256 / 512 / 1024 measured c = 0.13)
    eagle_steps: int = 1200
    eagle_lr: float = 3e-3
    eagle_unroll: int = 3  # train on its own predicted features for this many steps, as it drafts
    eagle_head_size: int = 192
    eagle_intermediate_size: int = 384
    eagle_vocab_size: int = 768  # the most frequent training tokens
    # Parallel block drafter (dflash.py, train_dflash.py). Capacity did not limit it here: one layer of width
    # 192, 256 or 384 and two of 256 drafted within 0.15 expected tokens per round of each other at K = 8, so the
    # cheapest (benchmarks/README.md, "Parallel drafting").
    dflash_steps: int = 3500
    dflash_lr: float = 3e-3
    dflash_head_size: int = 192
    dflash_intermediate_size: int = 384
    dflash_layers: int = 1
    dflash_heads: int = 4
    dflash_block_size: int = 8  # most drafts per pass
    dflash_context_tokens: int = 4  # recent tokens in the block, the last one included
    dflash_vocab_size: int = 768
    dflash_sequences: int = 3072  # greedy continuations of the target to train on
    dflash_prefix: int = 32  # corpus tokens before each continuation
    dflash_generated: int = 80  # tokens per continuation
    dflash_anchors: int = 16  # block positions trained per sequence and step
    dflash_position_decay: float = 0.6  # loss weight of draft position k: decay ** k (0.8 measured no better)


@dataclass(slots=True, frozen=True)
class Agreement:
    """Share of the target's greedy tokens that the draft's greedy choice matches, per workload."""

    code: float
    quote: float
    random: float


# --- corpus and tokenizer ---------------------------------------------------------------------


def corpus_files(corpus_mb: float | None = None) -> list[Path]:
    """The stdlib's .py files in sorted order, optionally only the first `corpus_mb` megabytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts))
    if corpus_mb is None:
        return files
    kept, size = [], 0
    for path in files:
        if size >= corpus_mb * 1e6:
            break
        kept.append(path)
        size += path.stat().st_size
    return kept


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def split_corpus(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every HELD_OUT_EVERY-th file is held out."""
    return ([p for i, p in enumerate(files) if i % HELD_OUT_EVERY != 0],
            [p for i, p in enumerate(files) if i % HELD_OUT_EVERY == 0])


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with GPT-2's pre-tokenizer regex, so llama.cpp can run it as "gpt-2"."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each followed by the end-of-text token."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def write_tokenizer_files(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    """tokenizer.json plus the two small files transformers' AutoTokenizer (and so vLLM) reads."""
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "model_max_length": max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # the default would rewrite " ." etc. and break code
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": EOS, "eos_token": EOS}, indent=2) + "\n")


# --- models -----------------------------------------------------------------------------------


def llama_config(vocab_size: int, num_layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=384,
        intermediate_size=768,
        num_hidden_layers=num_layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
    )


def sample_batch(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] windows of the stream; the last rows are a span tiled to fill the row."""
    width = cfg.seq_len + 1
    starts = torch.randint(0, len(stream) - width, (cfg.batch_size,), generator=gen)
    rows = [stream[s : s + width] for s in starts.tolist()]
    num_repeats = round(cfg.batch_size * cfg.repeat_fraction)
    span_lengths = torch.randint(16, cfg.seq_len // 2 + 1, (num_repeats,), generator=gen).tolist()
    for i, span in enumerate(span_lengths):
        row = cfg.batch_size - num_repeats + i
        rows[row] = rows[row][:span].repeat(math.ceil(width / span))[:width]
    return torch.stack(rows)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def run_steps(name: str, model: torch.nn.Module, step_loss: Callable[[torch.Generator], torch.Tensor],
              steps: int, peak_lr: float, warmup_steps: int, seed: int) -> tuple[list[float], float]:
    """The shared optimisation loop (`step_loss` samples a batch from the generator and returns its
    loss); returns the loss of every step and the mean seconds per step."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(model, peak_lr)
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup_steps)
        loss = step_loss(gen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            per_step = (time.perf_counter() - started) / (step + 1)
            recent = sum(losses[-20:]) / len(losses[-20:])
            print(f"{name} step {step + 1}/{steps} loss {recent:.3f} {per_step:.2f}s/step "
                  f"eta {per_step * (steps - step - 1):.0f}s", flush=True)
    model.eval()
    return losses, (time.perf_counter() - started) / max(1, steps)


def train_target(stream: torch.Tensor, cfg: TrainConfig) -> tuple[LlamaForCausalLM, list[float], float]:
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg.vocab_size, num_layers=4))

    def text_loss(gen: torch.Generator) -> torch.Tensor:
        batch = sample_batch(stream, cfg, gen)
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    losses, per_step = run_steps("target", model, text_loss, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.seed)
    return round_to_fp16(model), losses, per_step


def train_draft(target: LlamaForCausalLM, stream: torch.Tensor, cfg: TrainConfig) -> tuple[LlamaForCausalLM, list[float], float]:
    """One layer, warm-started from the target's first layer, embeddings (= tied LM head) frozen."""
    torch.manual_seed(cfg.seed + 1)
    draft = LlamaForCausalLM(llama_config(cfg.vocab_size, num_layers=1))
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.model.embed_tokens.requires_grad_(False)

    def kl_loss(gen: torch.Generator) -> torch.Tensor:
        batch = sample_batch(stream, cfg, gen)
        with torch.no_grad():
            target_logp = F.log_softmax(target(input_ids=batch[:, :-1]).logits, dim=-1)  # [B, T, V]
        draft_logp = F.log_softmax(draft(input_ids=batch[:, :-1]).logits, dim=-1)
        # KL(target || draft) per token, temperature 1
        return F.kl_div(draft_logp.flatten(0, 1), target_logp.flatten(0, 1), log_target=True, reduction="batchmean")

    losses, per_step = run_steps("draft", draft, kl_loss, cfg.draft_steps, cfg.draft_lr, cfg.warmup_steps, cfg.seed + 1)
    return round_to_fp16(draft), losses, per_step


class EagleTrainHead(torch.nn.Module):
    """The training twin of eagle.EagleHead (same maths, nn.Linear weights saved under the same names)."""

    def __init__(self, hidden_size: int, head_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.w_in = torch.nn.Linear(2 * hidden_size, head_size, bias=False)
        self.gate_up = torch.nn.Linear(head_size, 2 * intermediate_size, bias=False)
        self.down = torch.nn.Linear(intermediate_size, head_size, bias=False)
        self.w_out = torch.nn.Linear(head_size, hidden_size, bias=False)

    def forward(self, feature: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.w_in(torch.cat([feature, embedded], dim=-1))
        gate, up = self.gate_up(F.rms_norm(x, x.shape[-1:], eps=self.eps)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return F.rms_norm(self.w_out(F.rms_norm(x, x.shape[-1:], eps=self.eps)), feature.shape[-1:], eps=self.eps)


@dataclass(slots=True)
class Eagle:
    head: EagleTrainHead
    vocab: torch.Tensor  # [K] token ids, most frequent first
    lm_head: torch.Tensor  # [D, K]: the target's, final norm folded in, restricted to vocab
    coverage: float  # share of training tokens inside vocab
    losses: list[float]
    step_s: float

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        return feature @ self.lm_head


@torch.no_grad()
def target_features(target: LlamaForCausalLM, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] tokens -> the target's features [B, T, D] (final hidden state normalized without the final norm's
    weight, as the engine's model.forward returns it) and its next-token probabilities [B, T, V]."""
    captured: list[torch.Tensor] = []
    hook = target.model.norm.register_forward_hook(lambda module, args, out: captured.append(args[0]))
    try:
        logits = target(input_ids=tokens).logits
    finally:
        hook.remove()
    return F.rms_norm(captured[0], captured[0].shape[-1:], eps=target.config.rms_norm_eps), torch.softmax(logits, -1)


def train_eagle(target: LlamaForCausalLM, stream: torch.Tensor, cfg: TrainConfig) -> Eagle:
    """Distil the head from the target: from the target's feature at t and token t+1, predict the target's
    feature and next-token distribution at t+1, then again from its own prediction (cfg.eagle_unroll steps).
    Loss per step: cross-entropy to the target's distribution over the draft vocabulary + smooth L1 on features."""
    torch.manual_seed(cfg.seed + 3)
    counts = torch.bincount(stream, minlength=cfg.vocab_size)
    vocab = torch.argsort(-counts, stable=True)[: cfg.eagle_vocab_size]
    coverage = (counts[vocab].sum() / counts.sum()).item()
    hidden = target.config.hidden_size
    head = EagleTrainHead(hidden, cfg.eagle_head_size, cfg.eagle_intermediate_size, target.config.rms_norm_eps)
    embed = target.model.embed_tokens.weight.detach()
    lm_head = (target.model.norm.weight[:, None] * target.lm_head.weight.t()).detach()[:, vocab].contiguous()
    unroll = cfg.eagle_unroll

    def loss_fn(gen: torch.Generator) -> torch.Tensor:
        batch = sample_batch(stream, cfg, gen)  # [B, W]
        with torch.no_grad():
            features, probs = target_features(target, batch)
        width = batch.shape[1] - unroll
        feature, loss = features[:, :width], torch.zeros(())
        for k in range(unroll):
            feature = head(feature, F.embedding(batch[:, 1 + k : 1 + k + width], embed))
            p = probs[:, 1 + k : 1 + k + width][..., vocab]
            loss = loss - (p * torch.log_softmax(feature @ lm_head, -1)).sum(-1).mean()
            loss = loss + F.smooth_l1_loss(feature, features[:, 1 + k : 1 + k + width])
        return loss / unroll

    losses, step_s = run_steps("eagle", head, loss_fn, cfg.eagle_steps, cfg.eagle_lr, cfg.warmup_steps, cfg.seed + 3)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(param.half())  # shipped in fp16; evaluate exactly that
    return Eagle(head.eval(), vocab, lm_head, coverage, losses, step_s)


@torch.no_grad()
def eagle_agreement(target: LlamaForCausalLM, eagle: Eagle, paths: TargetPaths) -> Agreement:
    """The head's first draft from the target's own feature, against the target's greedy token (as agreement())."""
    embed = target.model.embed_tokens.weight
    figures = {}
    for name, tokens in paths.tokens.items():
        features, _ = target_features(target, tokens[:, :-1])
        n = paths.num_new
        # the last n positions choose tokens[-n:]; the head drafts each from the feature and token before it
        feature = features[:, -n - 1 : -1]  # [N, n]
        predicted = eagle.head(feature, F.embedding(tokens[:, -n - 1 : -1], embed))
        choice = eagle.vocab[eagle.logits(predicted).argmax(-1)]
        figures[name] = (choice == paths.choices[name]).float().mean().item()
    return Agreement(**figures)


def save_eagle(eagle: Eagle, out: Path) -> None:
    from safetensors.torch import save_file

    from spectune.engine.eagle import EagleConfig

    out.mkdir(parents=True)
    head = eagle.head
    config = EagleConfig(hidden_size=head.w_out.out_features, head_size=head.w_in.out_features,
                         intermediate_size=head.down.in_features, draft_vocab_size=len(eagle.vocab), rms_norm_eps=head.eps)
    (out / "config.json").write_text(config.to_json())
    tensors = {name: t.detach().half().contiguous() for name, t in head.state_dict().items()}
    save_file({**tensors, "draft_vocab": eagle.vocab.to(torch.int32)}, str(out / "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def round_to_fp16(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Evaluate (and distil from) exactly the weights that are shipped in fp16. Parameters only:
    `model.to(float16)` would also round the rotary frequencies, which a loader recomputes in fp32."""
    for param in model.parameters():
        param.copy_(param.half())
    return model.eval()


def save_model(model: LlamaForCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True)
    copy.deepcopy(model).to(torch.float16).save_pretrained(out, safe_serialization=True)
    write_tokenizer_files(tokenizer, out, model.config.max_position_embeddings)


# --- evaluation -------------------------------------------------------------------------------


def eval_prompts(held_out: torch.Tensor, cfg: TrainConfig, seed: int) -> dict[str, torch.Tensor]:
    """[N, 64] prompts per workload: held-out code; a code span then its first 8 tokens again (the
    continuation is a quote of the span); uniformly random non-special tokens."""
    gen = torch.Generator().manual_seed(seed)
    n, length = cfg.eval_prompts, 64
    starts = torch.linspace(0, len(held_out) - 2 * length - 1, n).long().tolist()
    code = torch.stack([held_out[s : s + length] for s in starts])
    spans = torch.stack([held_out[s + length : s + 2 * length - 8] for s in starts])  # [N, 56]
    quote = torch.cat([spans, spans[:, :8]], dim=1)
    random = torch.randint(1, cfg.vocab_size, (n, length), generator=gen)
    return {"code": code, "quote": quote, "random": random}


@torch.no_grad()
def greedy_generate(model: LlamaForCausalLM, prompts: torch.Tensor, num_new: int) -> torch.Tensor:
    """[N, num_new] greedy continuation (ignores end-of-text, like a benchmark with ignore_eos)."""
    out = model(input_ids=prompts, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]  # each [N, 1]
    for _ in range(num_new - 1):
        out = model(input_ids=tokens[-1], cache=out.cache, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


@dataclass(slots=True, frozen=True)
class TargetPaths:
    """Per workload: prompts followed by the target's greedy continuation ([N, P + num_new] tokens), and
    the target's greedy choice at those num_new positions recomputed by one full forward pass ([N,
    num_new]): the computation every compared model gets, so the target agrees with itself exactly."""

    tokens: dict[str, torch.Tensor]
    choices: dict[str, torch.Tensor]
    num_new: int


@torch.no_grad()
def greedy_choices(model: LlamaForCausalLM, tokens: torch.Tensor, num_new: int) -> torch.Tensor:
    """[N, num_new]: the model's greedy token at each of the last num_new positions of `tokens`."""
    return model(input_ids=tokens[:, :-1]).logits[:, -num_new:].argmax(-1)


def target_paths(target: LlamaForCausalLM, prompts: dict[str, torch.Tensor], num_new: int) -> TargetPaths:
    tokens = {name: torch.cat([p, greedy_generate(target, p, num_new)], dim=1) for name, p in prompts.items()}
    choices = {name: greedy_choices(target, t, num_new) for name, t in tokens.items()}
    return TargetPaths(tokens, choices, num_new)


def agreement(model: LlamaForCausalLM, paths: TargetPaths) -> Agreement:
    """Token-level acceptance proxy: along the target's greedy path, how often the model's greedy token
    equals the target's (what greedy speculative decoding accepts, position by position)."""
    return Agreement(**{
        name: (greedy_choices(model, tokens, paths.num_new) == paths.choices[name]).float().mean().item()
        for name, tokens in paths.tokens.items()
    })


@torch.no_grad()
def copy_accuracy(model: LlamaForCausalLM, quote_prompts: torch.Tensor) -> float:
    """How much of the quoted span (after its first 8 tokens) the model reproduces greedily."""
    expected = quote_prompts[:, 8:-8]  # the span's tokens after the 8 repeated ones
    generated = greedy_generate(model, quote_prompts, expected.shape[1])
    return (generated == expected).float().mean().item()


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, held_out: torch.Tensor, seq_len: int, windows: int = 16) -> float:
    starts = torch.linspace(0, len(held_out) - seq_len - 2, windows).long().tolist()
    batch = torch.stack([held_out[s : s + seq_len + 1] for s in starts])
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


# --- the whole run ----------------------------------------------------------------------------


def train(out: Path, cfg: TrainConfig, command: str, eagle_only: bool = False, dflash_only: bool = False) -> None:
    """Build tokenizer, target, draft, EAGLE head and dflash head into `out` (replaced as a whole when done)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    try:
        (train_eagle_only if eagle_only else train_dflash_only if dflash_only else _build)(out, cfg, command)
    finally:  # leave a calling process (a test) as it was
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _build(out: Path, cfg: TrainConfig, command: str) -> None:
    from spectune.engine.shipped import perturbed

    started = time.perf_counter()
    train_files, eval_files = split_corpus(corpus_files(cfg.corpus_mb))
    train_texts = read_texts(train_files)
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    stream = encode_stream(tokenizer, train_texts)
    held_out = encode_stream(tokenizer, read_texts(eval_files))
    print(f"corpus: {len(train_files)} train files ({len(stream)} tokens), {len(eval_files)} held out "
          f"({len(held_out)} tokens), tokenizer {time.perf_counter() - started:.0f}s", flush=True)

    target, target_losses, target_step_s = train_target(stream, cfg)
    draft, draft_losses, draft_step_s = train_draft(target, stream, cfg)
    eagle = train_eagle(target, stream, cfg)
    dflash = train_dflash(target, stream, cfg)

    prompts = eval_prompts(held_out, cfg, cfg.seed)
    paths = target_paths(target, prompts, cfg.eval_new_tokens)
    torch.manual_seed(cfg.seed + 2)
    untrained = LlamaForCausalLM(llama_config(cfg.vocab_size, num_layers=1)).eval()
    figures = {
        "draft": agreement(draft, paths),
        "eagle head (first draft)": eagle_agreement(target, eagle, paths),
        "untrained 1-layer": agreement(untrained, paths),
    }
    shipped_weights = {k: v.half() for k, v in target.state_dict().items() if k != "lm_head.weight"}  # tied
    for noise in NOISE_LEVELS:
        noisy = LlamaForCausalLM(target.config).eval()
        noisy.load_state_dict(perturbed(shipped_weights, noise, cfg.seed), strict=False)
        noisy.tie_weights()
        figures[f"noisy target {noise:g}"] = agreement(noisy, paths)
    sample_ids = greedy_generate(target, prompts["code"][:1], 48)[0].tolist()
    report = RunReport(
        command=command, cfg=cfg, wall_s=time.perf_counter() - started,
        target_step_s=target_step_s, draft_step_s=draft_step_s,
        target_loss=sum(target_losses[-20:]) / len(target_losses[-20:]),
        draft_kl=sum(draft_losses[-20:]) / len(draft_losses[-20:]),
        target_held_out=held_out_loss(target, held_out, cfg.seq_len),
        draft_held_out=held_out_loss(draft, held_out, cfg.seq_len),
        copy=copy_accuracy(target, prompts["quote"]),
        figures=figures,
        prompt_text=tokenizer.decode(prompts["code"][0].tolist()),
        sample_text=tokenizer.decode(sample_ids),
    )
    dflash_text = dflash_readme(dflash, survival_table(target, dflash, eagle, paths), cfg, command + " --dflash-only")
    print(write_assets(out, target, draft, eagle, (dflash, dflash_text), tokenizer, report), flush=True)


def train_eagle_only(out: Path, cfg: TrainConfig, command: str) -> None:
    """Retrain only the EAGLE head, on the target already in `out` (what a full run would make from it)."""
    target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    train_files, eval_files = split_corpus(corpus_files(cfg.corpus_mb))
    stream = encode_stream(tokenizer, read_texts(train_files))
    eagle = train_eagle(target, stream, cfg)
    paths = target_paths(target, eval_prompts(encode_stream(tokenizer, read_texts(eval_files)), cfg, cfg.seed), cfg.eval_new_tokens)
    figures = eagle_agreement(target, eagle, paths)
    staging = out / f".eagle.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    save_eagle(eagle, staging)
    (staging / "README.md").write_text(eagle_readme(eagle, figures, cfg, command))
    shutil.rmtree(out / "eagle", ignore_errors=True)
    staging.rename(out / "eagle")
    print((out / "eagle" / "README.md").read_text(), flush=True)


def train_dflash_only(out: Path, cfg: TrainConfig, command: str) -> None:
    """Retrain only the dflash head, on the target already in `out` (what a full run would make from it); the
    EAGLE head in `out`, if any, is measured beside it."""
    from safetensors.torch import load_file

    from spectune.engine.eagle import EagleConfig

    target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    train_files, eval_files = split_corpus(corpus_files(cfg.corpus_mb))
    dflash = train_dflash(target, encode_stream(tokenizer, read_texts(train_files)), cfg)
    paths = target_paths(target, eval_prompts(encode_stream(tokenizer, read_texts(eval_files)), cfg, cfg.seed), cfg.eval_new_tokens)
    eagle = None
    if (out / "eagle" / "model.safetensors").is_file():
        config = EagleConfig.from_dir(out / "eagle")
        weights = {k: v.float() for k, v in load_file(str(out / "eagle" / "model.safetensors")).items()}
        vocab = weights.pop("draft_vocab").long()
        head = EagleTrainHead(config.hidden_size, config.head_size, config.intermediate_size, config.rms_norm_eps)
        head.load_state_dict(weights)
        lm_head = (target.model.norm.weight[:, None] * target.lm_head.weight.t()).detach()[:, vocab]
        eagle = Eagle(head.eval(), vocab, lm_head, 0.0, [], 0.0)
    write_dflash_dir(dflash, dflash_readme(dflash, survival_table(target, dflash, eagle, paths), cfg, command), out / "dflash")
    print((out / "dflash" / "README.md").read_text(), flush=True)


def eagle_readme(eagle: Eagle, figures: Agreement, cfg: TrainConfig, command: str) -> str:
    size = sum(p.numel() for p in eagle.head.parameters())
    return f"""# EAGLE-style head for the shipped target

Made by `spectune/engine/train.py` (see ../README.md; `{command}` remakes only this dir from ../target).
A residual SwiGLU MLP on the target's last hidden state and the next token's embedding (spectune/engine/eagle.py):
head size {cfg.eagle_head_size}, intermediate {cfg.eagle_intermediate_size}, {size / 1e6:.2f} M parameters of its
own (fp16); embeddings and LM head are the target's, the LM head restricted to the {len(eagle.vocab)} most
frequent training tokens ({eagle.coverage:.1%} of training tokens). Trained {cfg.eagle_steps} steps (seed
{cfg.seed + 3}, {eagle.step_s:.2f} s per step) on its own predictions {cfg.eagle_unroll} steps deep; final
loss {sum(eagle.losses[-20:]) / len(eagle.losses[-20:]):.3f}.

First-draft greedy agreement with the target (as in ../README.md): code {figures.code:.3f}, quote
{figures.quote:.3f}, random {figures.random:.3f}.
"""


@dataclass(slots=True)
class RunReport:
    command: str
    cfg: TrainConfig
    wall_s: float
    target_step_s: float
    draft_step_s: float
    target_loss: float
    draft_kl: float
    target_held_out: float
    draft_held_out: float
    copy: float
    figures: dict[str, Agreement]
    prompt_text: str
    sample_text: str

    def markdown(self, size_bytes: int) -> str:
        rows = "\n".join(f"| {name} | {a.code:.3f} | {a.quote:.3f} | {a.random:.3f} |" for name, a in self.figures.items())
        return f"""# spectune's shipped models

Made by `spectune/engine/train.py` (no hub, no downloads); this file is written by that script.

- `target/`: LlamaForCausalLM, 4 layers, hidden 384, intermediate 768, 6 heads / 2 KV heads,
  vocab {self.cfg.vocab_size}, tied embeddings, fp16 safetensors.
- `draft/`: the same shape with 1 layer; embeddings (= tied LM head) copied from the target and frozen,
  the layer warm-started from the target's first layer and trained by distillation (KL to the target).
- `eagle/`: an EAGLE-style head (spectune/engine/eagle.py) on the target's hidden states, using the target's
  embeddings and LM head, trained to imitate the target's outputs; its own figures are in `eagle/README.md`.
- `dflash/`: a parallel block drafter (spectune/engine/dflash.py, method `dflash`) on the same hidden states:
  up to 8 drafts in one pass; its figures, with acceptance per draft position beside the EAGLE head's, are in
  `dflash/README.md`.
- Tokenizer (both dirs, identical): byte-level BPE trained on the Python {sys.version.split()[0]} standard
  library's sources, GPT-2 pre-tokenizer regex, one special token `{EOS}` (id {EOS_ID}, bos = eos).
- Corpus: the stdlib's `.py` files in sorted order, minus {", ".join(sorted(SKIPPED_DIRS))}; every
  {HELD_OUT_EVERY}th file held out for evaluation. A share of {self.cfg.repeat_fraction:g} of each training
  batch is a span tiled to fill the row, meant to teach the target to copy its context (see the
  measured copy accuracy below: at this budget it has not learned to).
- Size: {size_bytes / 1e6:.1f} MB for both dirs together.

## Reproduce

```
{self.command}
```

seed {self.cfg.seed}, target steps {self.cfg.steps}, draft steps {self.cfg.draft_steps}, batch
{self.cfg.batch_size} x {self.cfg.seq_len} tokens, AdamW (peak lr {self.cfg.lr}, cosine), torch
{torch.__version__}, {self.cfg.threads} threads. Wall time {self.wall_s:.0f} s in all
({self.target_step_s:.2f} s per target step, {self.draft_step_s:.2f} s per draft step, on a 2-core machine
shared with other work). Bit-identical output needs the same Python stdlib, torch version and thread count.

## Measured

| figure | value |
|---|---|
| target train loss (mean of last 20 steps) | {self.target_loss:.3f} |
| target held-out loss | {self.target_held_out:.3f} |
| draft train KL to target (mean of last 20 steps) | {self.draft_kl:.3f} |
| draft held-out loss | {self.draft_held_out:.3f} |
| target copies a quoted held-out span (greedy, token accuracy) | {self.copy:.3f} |

Greedy agreement with the target (share of the target's greedy tokens that the model's greedy choice
matches along the target's path; {self.cfg.eval_prompts} prompts x {self.cfg.eval_new_tokens} new tokens
per workload): code = held-out stdlib code; quote = a held-out span then its first 8 tokens again;
random = uniformly random tokens. "noisy target x" = the target with Gaussian noise of x times each
tensor's std added (`shipped.noisy_draft_path(x)`).

| model | code | quote | random |
|---|---|---|---|
{rows}

Greedy sample from the target (prompt, then continuation):

```
{self.prompt_text}
```
```
{self.sample_text}
```
"""


def write_assets(out: Path, target: LlamaForCausalLM, draft: LlamaForCausalLM, eagle: Eagle, dflash: tuple[DFlash, str],
                 tokenizer: Tokenizer, report: RunReport) -> str:
    """Write into a temporary sibling, then swap it in, so readers never see half an asset set.
    Returns the README's text."""
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_model(target, tokenizer, staging / "target")
    save_model(draft, tokenizer, staging / "draft")
    save_eagle(eagle, staging / "eagle")
    (staging / "eagle" / "README.md").write_text(
        eagle_readme(eagle, report.figures["eagle head (first draft)"], report.cfg, report.command + " --eagle-only"))
    write_dflash_dir(*dflash, staging / "dflash")
    readme = report.markdown(sum(p.stat().st_size for p in staging.rglob("*") if p.is_file()))
    (staging / "README.md").write_text(readme)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return readme


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m spectune.engine.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="asset directory to (re)write")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="target training steps")
    parser.add_argument("--draft-steps", type=int, default=None, help="draft distillation steps (default: steps / 2)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--corpus-mb", type=float, default=None, help="use only the first N MB of the corpus")
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--eval-prompts", type=int, default=defaults.eval_prompts, help="prompts per workload")
    parser.add_argument("--eagle-only", action="store_true", help="retrain only the EAGLE head, on the target in --out")
    parser.add_argument("--eagle-steps", type=int, default=defaults.eagle_steps)
    parser.add_argument("--dflash-only", action="store_true", help="retrain only the dflash head, on the target in --out")
    parser.add_argument("--dflash-steps", type=int, default=defaults.dflash_steps)
    parser.add_argument("--dflash-sequences", type=int, default=defaults.dflash_sequences,
                        help="greedy continuations of the target the dflash head trains on")
    parser.add_argument("--dflash-layers", type=int, default=defaults.dflash_layers)
    parser.add_argument("--dflash-head-size", type=int, default=defaults.dflash_head_size, help="width (intermediate = 2x)")
    args = parser.parse_args(argv)
    cfg = TrainConfig(
        seed=args.seed, steps=args.steps,
        draft_steps=args.steps // 2 if args.draft_steps is None else args.draft_steps,
        batch_size=args.batch_size, corpus_mb=args.corpus_mb, threads=args.threads, eval_prompts=args.eval_prompts,
        eagle_steps=args.eagle_steps, dflash_steps=args.dflash_steps, dflash_sequences=args.dflash_sequences,
        dflash_layers=args.dflash_layers, dflash_head_size=args.dflash_head_size, dflash_intermediate_size=2 * args.dflash_head_size,
    )
    command = " ".join(["python -m spectune.engine.train", *argv])
    if args.eagle_only and args.dflash_only:
        parser.error("--eagle-only and --dflash-only: pick one")
    train(args.out, cfg, command, eagle_only=args.eagle_only, dflash_only=args.dflash_only)


if __name__ == "__main__":
    main()
