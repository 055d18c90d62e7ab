"""Step 1 of the checklist: a draft must share the target's tokenizer. Checked before anything launches."""

from __future__ import annotations

import json
from pathlib import Path

from spectune.errors import SpectuneError
from spectune.servers.base import ServerSpec

SAMPLE = "def add(a, b):\n    return a + b  # sum\nThe quick brown fox, 3.14 — naïve café ✓\n"


def _model_dirs(spec: ServerSpec) -> tuple[Path | None, Path | None]:
    target = Path(spec.model) if spec.model else None
    draft = Path(spec.draft_model) if spec.draft_model else None
    if spec.engine == "embedded" and spec.method == "draft_model":
        from spectune.engine import shipped

        target = target or shipped.target_path()
        draft = draft or shipped.draft_path()
    return target, draft


def _load(path: Path, role: str, spec: ServerSpec):
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:
        raise SpectuneError(f"server {spec.name!r}: cannot read the {role} tokenizer {file} ({e}); point {role} at an HF model dir with tokenizer.json") from None


def check_tokenizers(spec: ServerSpec) -> None:
    """Raise SpectuneError when the server's draft and target tokenizers differ (vocab size or a round-trip)."""
    target, draft = _model_dirs(spec)
    if spec.method != "draft_model" or target is None or draft is None:
        return
    if not (target / "tokenizer.json").exists() or not (draft / "tokenizer.json").exists():
        return  # hub names or GGUF files: the engine itself checks
    t, d = _load(target, "model", spec), _load(draft, "draft_model", spec)
    vt, vd = _vocab_size(target, t), _vocab_size(draft, d)
    if vt != vd:
        raise SpectuneError(f"server {spec.name!r}: draft_model {draft} has vocab size {vd}, the target {target} has {vt}; "
                            "use a draft trained with the target's tokenizer")
    if t.encode(SAMPLE).ids != d.encode(SAMPLE).ids:
        raise SpectuneError(f"server {spec.name!r}: draft_model {draft} tokenizes sample text differently from the target {target}; "
                            "use a draft trained with the target's tokenizer")


def _vocab_size(model_dir: Path, tok) -> int:
    try:
        return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError):
        return tok.get_vocab_size()
