"""Tiny random Llama checkpoints for the engine tests, built with transformers (imported by tests, not a plugin).

Random weights are enough for exactness and losslessness; where a test needs a predictable target it builds one
on purpose (see `bigram_target`) and says why.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = "the cat sat on a mat and then ran to the door while a dog slept by the fire in our small house".split()


def write_tokenizer(out: Path, vocab_size: int = 300) -> int:
    """A byte-level BPE trained on a few generated sentences; <s>=0, </s>=1. Returns the real vocab size."""
    import random

    from tokenizers import ByteLevelBPETokenizer

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(corpus, vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return tok.get_vocab_size()


def llama(
    out: Path,
    vocab_size: int,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    init_std: float = 0.2,
    tie: bool = False,
    rope_theta: float = 5000.0,
    max_len: int = 256,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random LlamaForCausalLM saved with save_pretrained. A large init_std gives peaked (less uniform) logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
        rope_theta=rope_theta, tie_word_embeddings=tie, initializer_range=init_std, bos_token_id=0, eos_token_id=1,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    return out


def noisy_copy(src: Path, out: Path, noise: float, seed: int = 0) -> Path:
    """src's weights plus Gaussian noise of `noise` x each tensor's std: a draft whose acceptance falls with noise."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(src / "model.safetensors"))
    noisy = {k: (w + noise * w.float().std() * torch.randn(w.shape, generator=gen)).to(w.dtype) if w.numel() > 1 else w
             for k, w in sorted(weights.items())}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def bigram_target(out: Path, vocab_size: int, seed: int = 0, context: float = 0.0) -> Path:
    """A Llama whose attention and MLP outputs are zeroed, so the next token depends only on the current one.

    Its greedy output walks a fixed token -> token map, so text made of that walk is repetitive in exactly the
    way the model continues it: what an n-gram proposer needs, without training a model in the test.
    `context` > 0 keeps that share of the attention output: mostly the map, partly the context (and the KV cache).
    """
    from safetensors.torch import load_file, save_file

    llama(out, vocab_size, seed=seed, layers=1, init_std=1.0)
    weights = load_file(str(out / "model.safetensors"))
    for name in weights:
        if name.endswith("o_proj.weight"):
            weights[name] = weights[name] * context
        if name.endswith("down_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def eagle_head(target: Path, out: Path, *, draft_vocab: int, steps: int = 0, seed: int = 0) -> Path:
    """An EAGLE head for `target` made by spectune's own trainer: `steps` of distillation (0: untrained, random
    weights) on text the target itself samples, its LM head restricted to the `draft_vocab` most frequent tokens."""
    from transformers import LlamaForCausalLM

    from spectune.engine.train import TrainConfig, save_eagle, train_eagle

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    torch.manual_seed(seed)
    starts = torch.randint(2, vocab, (16, 4), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        text = model.generate(starts, do_sample=True, temperature=0.7, top_k=0, max_new_tokens=120, min_new_tokens=120,
                              pad_token_id=0)
    stream = text.flatten()
    cfg = TrainConfig(seed=seed, batch_size=4, seq_len=32, vocab_size=vocab, eagle_steps=steps, warmup_steps=5,
                      eagle_head_size=64, eagle_intermediate_size=128, eagle_vocab_size=draft_vocab, repeat_fraction=0.0)
    save_eagle(train_eagle(model, stream, cfg), out)
    return out


def dflash_head(target: Path, out: Path, *, draft_vocab: int, steps: int = 0, seed: int = 0, block_size: int = 8) -> Path:
    """A dflash head (parallel block drafter) for `target` made by spectune's own trainer: `steps` of distillation
    (0: untrained, random weights) on the target's greedy continuations of text it samples itself."""
    from transformers import LlamaForCausalLM

    from spectune.engine.train import TrainConfig
    from spectune.engine.train_dflash import save_dflash, train_dflash

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    starts = torch.randint(2, vocab, (16, 4), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    with torch.no_grad():
        text = model.generate(starts, do_sample=True, temperature=0.7, top_k=0, max_new_tokens=120, min_new_tokens=120,
                              pad_token_id=0)
    cfg = TrainConfig(seed=seed, batch_size=8, vocab_size=vocab, warmup_steps=5, dflash_steps=steps, dflash_head_size=64,
                      dflash_intermediate_size=128, dflash_layers=1, dflash_heads=2, dflash_block_size=block_size,
                      dflash_context_tokens=2, dflash_vocab_size=draft_vocab, dflash_sequences=256, dflash_prefix=4,
                      dflash_generated=16, dflash_anchors=8, dflash_position_decay=0.5)
    save_dflash(train_dflash(model, text.flatten(), cfg), out)
    return out
