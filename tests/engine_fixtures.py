"""Models and engine look-ups shared by the server-adapter tests (imported, not a pytest plugin).

The real engines need a real Hugging Face model directory. spectune's shipped models are used when they
are there; otherwise a tiny random-weight Llama with a Llama-2-style byte-fallback BPE tokenizer is built
once and cached under ~/.cache/spectune/test-models (that tokenizer shape is what llama.cpp's converter
accepts without a pre-tokenizer hash, and what vLLM loads through transformers).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

CACHE = Path(os.environ.get("SPECTUNE_CACHE", Path.home() / ".cache" / "spectune"))
TEST_MODELS = CACHE / "test-models"
TINY_LLAMA = TEST_MODELS / "tiny-llama-v1"
VLLM_PYTHON = CACHE / "vllm-venv" / "bin" / "python"
LLAMA_DIR = CACHE / "llama.cpp"

_WORDS = [  # the corpus the tokenizer is trained on
    "the", "a", "of", "to", "and", "in", "is", "for", "on", "with", "as", "by", "at", "from", "that", "this",
    "it", "be", "are", "was", "or", "an", "not", "which", "model", "server", "token", "draft", "target",
    "batch", "size", "step", "accept", "reject", "round", "cache", "prefix", "request", "speculative",
    "decoding", "measure", "latency", "throughput", "memory", "engine", "config", "verify", "greedy",
    "sample", "python", "def", "return", "class", "import", "if", "else", "for", "while", "yield", "await",
    "async", "with", "open", "read", "write",
]


def _corpus(lines: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1024,
        "legacy": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1))


def build_tiny_llama(out: Path = TINY_LLAMA, vocab_size: int = 512, seed: int = 0) -> Path:
    """A 2-layer Llama (d64, head_dim 32) with random weights; cached, rebuilt only when absent."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = _staging(out)
    tmp.mkdir(parents=True)
    _write_tokenizer(tmp, vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked logits: greedy argmax is far from ties, so outputs compare exactly
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    return _publish(tmp, out)


def noisy_copy(source: Path, noise: float, seed: int = 0) -> Path:
    """`source` with relative Gaussian noise on every weight (spectune.engine.shipped.perturbed): a draft
    that agrees with the target most of the time, so acceptance is neither 0 nor exactly 1."""
    from safetensors.torch import load_file, save_file

    from spectune.engine.shipped import perturbed

    out = TEST_MODELS / f"{source.name}-noisy-{noise:g}-{seed}"
    if (out / "model.safetensors").is_file():
        return out
    tmp = _staging(out)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(source / "model.safetensors")
    save_file(perturbed(tensors, noise, seed), tmp / "model.safetensors", metadata={"format": "pt"})
    return _publish(tmp, out)


def _staging(out: Path) -> Path:
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _publish(tmp: Path, out: Path) -> Path:
    """Move a finished model dir into place; if another test process got there first, keep theirs."""
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def target_and_draft(noise: float = 0.02) -> tuple[Path, Path]:
    """The shipped target when it is there, else the tiny test Llama; the draft is a low-noise copy of it."""
    from spectune.engine import shipped
    from spectune.errors import SpectuneError

    try:
        return shipped.target_path(), shipped.noisy_draft_path(noise)
    except SpectuneError:  # not trained yet
        tiny = build_tiny_llama()
        return tiny, noisy_copy(tiny, noise)


def require_vllm() -> Path:
    python = Path(os.environ.get("SPECTUNE_VLLM_PYTHON", VLLM_PYTHON))
    if not python.exists():
        pytest.skip(f"vLLM is not installed at {python}; run: scripts/install-engines.sh vllm")
    return python


def require_llama_server() -> Path:
    binary = Path(os.environ.get("SPECTUNE_LLAMA_SERVER", LLAMA_DIR / "bin" / "llama-server"))
    if not binary.exists() or not (LLAMA_DIR / "convert_hf_to_gguf.py").exists():
        pytest.skip(f"llama-server is not installed at {binary}; run: scripts/install-engines.sh llamacpp")
    return binary


@dataclass(slots=True)
class Completion:
    text: str
    chunks: int  # SSE chunks that carried text
    completion_tokens: int | None  # from the final usage chunk


def stream_completion(base_url: str, model: str, prompt: str, max_tokens: int = 24, timeout_s: float = 120.0) -> Completion:
    """One greedy, streamed /v1/completions request (ignore_eos, so every server writes max_tokens tokens)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    request = urllib.request.Request(
        base_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    text, chunks, tokens = [], 0, None
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data:"))
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    text.append(choice["text"])
                    chunks += 1
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
    return Completion("".join(text), chunks, tokens)


@contextmanager
def running_app(app: web.Application) -> Iterator[str]:
    """Serve an aiohttp app on a free 127.0.0.1 port from a background thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


if __name__ == "__main__":  # build the test model ahead of a test run: python tests/engine_fixtures.py
    print(build_tiny_llama())
