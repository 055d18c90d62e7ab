"""Where spectune's shipped models live, and the models derived from them (noisy drafts, GGUF files).

The target and draft are Hugging Face Llama directories (fp16 safetensors + tokenizer files) made by
`python -m spectune.engine.train`. torch is imported only inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from spectune.errors import SpectuneError

if TYPE_CHECKING:
    import torch

ASSETS = Path(__file__).parent / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WEIGHTS = "model.safetensors"
RETRAIN = "run `python -m spectune.engine.train --out spectune/engine/assets`"


def cache_dir() -> Path:
    """spectune's cache: $SPECTUNE_CACHE, else ~/.cache/spectune."""
    return Path(os.environ.get("SPECTUNE_CACHE", Path.home() / ".cache" / "spectune")).expanduser()


def _shipped(name: str) -> Path:
    path = ASSETS / name
    if not (path / WEIGHTS).is_file():
        raise SpectuneError(f"{path}: shipped model missing; {RETRAIN}")
    return path


def target_path() -> Path:
    """The shipped target: a 4-layer Llama (hidden 384) trained on the Python stdlib's sources."""
    return _shipped("target")


def draft_path() -> Path:
    """The shipped draft: a 1-layer Llama distilled from the target (same tokenizer and vocab)."""
    return _shipped("draft")


def eagle_path() -> Path:
    """The shipped EAGLE-style head: a residual MLP on the target's hidden states (eagle.py), trained to
    imitate the target's own outputs."""
    return _shipped("eagle")


def dflash_path() -> Path:
    """The shipped parallel block drafter (dflash.py): K drafts in one pass from the target's hidden state."""
    return _shipped("dflash")


def perturbed(tensors: dict[str, torch.Tensor], noise: float, seed: int) -> dict[str, torch.Tensor]:
    """Each tensor plus Gaussian noise of std `noise` x the tensor's own std, in its own dtype.

    Noise is drawn in sorted-name order from one generator, so (tensors, noise, seed) fixes the result.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(tensors):
        weight = tensors[name].float()
        scale = noise * weight.std().item() if weight.numel() > 1 else 0.0
        out[name] = (weight + scale * torch.randn(weight.shape, generator=gen)).to(tensors[name].dtype)
    return out


def noisy_draft_path(noise: float, seed: int = 0) -> Path:
    """A draft that is the target plus relative Gaussian noise (0 = the target itself); acceptance
    falls as `noise` grows. Made on first use under <cache>/models/, atomically, keyed by the target's
    weights so a retrained target gets fresh noisy copies."""
    from safetensors.torch import load_file, save_file

    if noise < 0:
        raise SpectuneError(f"noise: {noise} is negative; use a relative noise scale >= 0, e.g. 0.05")
    source = target_path()
    digest = hashlib.sha256((source / WEIGHTS).read_bytes()).hexdigest()[:12]
    out = cache_dir() / "models" / f"noisy-{noise:g}-{seed}-{digest}"
    if (out / WEIGHTS).is_file():
        return out
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        if (source / name).is_file():
            shutil.copy2(source / name, staging / name)
    save_file(perturbed(load_file(source / WEIGHTS), noise, seed), staging / WEIGHTS, metadata={"format": "pt"})
    try:
        staging.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return out


# Runs llama.cpp's converter unchanged, except that a tokenizer whose pre-tokenizer hash is unknown but
# which is byte-level BPE with GPT-2's regex (ours: trained locally, so its token ids hash to no known
# model) is reported as "gpt-2", which is exactly the pre-tokenizer llama.cpp must then apply.
_CONVERT = """
import json, pathlib, runpy, sys
script, model_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
sys.argv = [str(script), *sys.argv[2:]]
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
import conversion.base as base
pre = json.loads((model_dir / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
is_gpt2 = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        if is_gpt2:
            return "gpt-2"
        raise
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(str(script), run_name="__main__")
"""


def gguf_convert(model_dir: Path, out: Path) -> Path:
    """Convert an HF Llama dir to an f16 GGUF at `out` with llama.cpp's convert_hf_to_gguf.py (from
    <cache>/llama.cpp); kept and reused while it is newer than the model's files."""
    model_dir, out = Path(model_dir), Path(out)
    newest_input = max(p.stat().st_mtime for p in model_dir.iterdir())
    if out.is_file() and out.stat().st_mtime >= newest_input:
        return out
    script = cache_dir() / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SpectuneError(f"{script}: llama.cpp's converter is missing; run scripts/install-engines.sh llamacpp")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    command = [sys.executable, "-c", _CONVERT, str(script), str(model_dir), "--outfile", str(staging), "--outtype", "f16"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not staging.is_file():
        staging.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if "No module named" in last:  # the converter imports transformers, gguf's deps: not in spectune's [engine] extra
            raise SpectuneError(f"{model_dir}: GGUF conversion needs a module this Python lacks ({last}); "
                                "pip install transformers, then run again")
        raise SpectuneError(f"{model_dir}: GGUF conversion failed ({last}); check the dir is an HF Llama model")
    os.replace(staging, out)
    return out

