"""Output tokens per streamed chunk, counted once a request has ended (the stream reader only stamps and keeps).

Sources, in order of preference (RequestRecord.token_source says which one counted a request):
  usage             `usage.completion_tokens` on every chunk (vLLM/SGLang continuous usage stats): the deltas
  timings           llama-server's cumulative `timings.predicted_n` (timings_per_token)
  token_ids         `choices[0].token_ids` (vLLM return_token_ids)
  tokenizer         the served model's tokenizer over the request's whole text, each token counted in the chunk
                    where its text ends (so a token split over two chunks counts once); when the server's final
                    usage total differs, the difference is spread over the chunks in proportion to their counts
                    and the source is "tokenizer+spread"
  text              no tokenizer: one token per chunk with text, which the final total confirms (total == chunks)
  unknown           no tokenizer and a total that differs from the chunks (or no total): only the sum is known;
                    chunk_tokens hold 1 per chunk as placeholders and per-token latency is unknown
Role-only and empty chunks carry no tokens. A chunk without `choices` (the final usage chunk) only gives the
totals (output_tokens, prompt_tokens).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spectune.errors import SpectuneError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(slots=True)
class Counted:
    """One request's token chunks: arrival stamps and output tokens of every chunk that carried >= 1 token."""

    chunk_ns: list[int]
    chunk_tokens: list[int]
    text: str
    output_tokens: int | None  # the server's final usage total, None when it sent none
    prompt_tokens: int | None
    source: str  # see the module docstring


def count_tokens(chunks: list[tuple[int, dict]], tokenizer: Tokenizer | None = None) -> Counted:
    """Count the tokens of each (arrival_ns, parsed SSE chunk) of one stream, in arrival order."""
    stamps: list[int] = []
    texts: list[str] = []
    cumulative: list[tuple[str, int] | None] = []
    token_ids: list[int | None] = []
    output_tokens = prompt_tokens = None
    for ns, chunk in chunks:  # runs once per chunk of every request: each lookup made once
        usage = chunk.get("usage")
        completion = None
        if isinstance(usage, dict):
            completion = usage.get("completion_tokens")
            output_tokens = usage.get("completion_tokens", output_tokens)
            prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
        choices = chunk.get("choices")
        if not choices or not isinstance(choices[0], dict):
            continue  # usage-only chunk: a total, not new tokens
        choice = choices[0]
        text = choice.get("text")
        if not text:
            delta = choice.get("delta")
            text = (delta.get("content") or delta.get("reasoning_content")) if isinstance(delta, dict) else None
        stamps.append(ns)
        texts.append(text if isinstance(text, str) else "")
        cumulative.append(("usage", completion) if isinstance(completion, int) else _timings(chunk))
        ids = choice.get("token_ids")
        token_ids.append(len(ids) if isinstance(ids, list) else None)
    counts, source = _per_chunk(texts, cumulative, token_ids, output_tokens, tokenizer)
    kept = [i for i, c in enumerate(counts) if c > 0]
    return Counted(
        chunk_ns=[stamps[i] for i in kept],
        chunk_tokens=[counts[i] for i in kept],
        text="".join(texts),
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        source=source,
    )


def _timings(chunk: dict) -> tuple[str, int] | None:
    timings = chunk.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        return "timings", timings["predicted_n"]
    return None


def _per_chunk(texts: list[str], cumulative: list, token_ids: list, total: int | None, tokenizer) -> tuple[list[int], str]:
    has_text = [bool(t) for t in texts]
    # A source counts a stream only if every chunk that brought text carries it.
    for kind in ("usage", "timings"):
        if any(c is not None and c[0] == kind for c in cumulative) and all(
            c is not None and c[0] == kind for c, t in zip(cumulative, has_text) if t
        ):
            counts, counted = [], 0
            for c in cumulative:
                n = max(0, c[1] - counted) if c is not None and c[0] == kind else 0
                counts.append(n)
                counted += n
            return counts, kind
    if any(n is not None for n in token_ids) and all(n is not None for n, t in zip(token_ids, has_text) if t):
        return [n or 0 for n in token_ids], "token_ids"
    if tokenizer is not None and any(has_text):
        counts = _tokenize(texts, tokenizer)
        if total is None or sum(counts) == total:
            return counts, "tokenizer"
        spread = spread_counts(counts, total)
        return (spread, "tokenizer+spread") if spread is not None else (counts, "tokenizer")
    if not any(has_text):
        return [0] * len(texts), ""  # nothing streamed with tokens: nothing to count
    counts = [1 if t else 0 for t in texts]
    return counts, "text" if total == sum(counts) else "unknown"


def _tokenize(texts: list[str], tokenizer) -> list[int]:
    """Tokens per chunk: the whole text tokenized once, each token counted in the chunk where its text ends; a
    chunk with text always counts at least one (a server streams a chunk only when it has a token to send)."""
    ends = []
    position = 0
    for t in texts:
        position += len(t)
        ends.append(position)  # chunk i holds characters [ends[i-1], ends[i])
    counts = [0] * len(texts)
    for start, end in tokenizer.encode("".join(texts), add_special_tokens=False).offsets:
        last = end - 1 if end > start else start
        counts[min(bisect.bisect_right(ends, last), len(texts) - 1)] += 1
    return [max(c, 1) if t else 0 for c, t in zip(counts, texts)]


def spread_counts(counts: list[int], total: int) -> list[int] | None:
    """`counts` changed to sum to `total`: the difference shared out in proportion to the counts (largest
    remainder, ties to the earlier chunk), no chunk with a token below one. None when that cannot be done."""
    difference = total - sum(counts)
    weights = counts if difference > 0 else [max(c - 1, 0) for c in counts]
    if difference == 0:
        return list(counts)
    if sum(weights) == 0 or (difference < 0 and sum(weights) < -difference):
        return None
    shares = [abs(difference) * w / sum(weights) for w in weights]
    moved = [int(s) for s in shares]
    for i in sorted(range(len(counts)), key=lambda i: moved[i] - shares[i])[: abs(difference) - sum(moved)]:
        moved[i] += 1
    sign = 1 if difference > 0 else -1
    return [c + sign * m for c, m in zip(counts, moved)]


def load_tokenizer(path: str | Path, where: str) -> Tokenizer:
    """A tokenizer from a tokenizer.json file or a model directory holding one; SpectuneError naming `where`."""
    from tokenizers import Tokenizer

    file = Path(path).expanduser()
    file = file / "tokenizer.json" if file.is_dir() else file
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:
        raise SpectuneError(f"{where}: cannot read a tokenizer at {file} ({e}); give a tokenizer.json file or an HF model "
                            "directory holding one") from None


def tokenizer_path(model: str | None, tokenizer: str | None, engine: str) -> Path | None:
    """The served model's tokenizer: the spec's `tokenizer`, else its model when that is a local directory with a
    tokenizer.json, else (embedded engine) the shipped target's; None when none is known (a hub name, a GGUF file)."""
    if tokenizer is not None:
        return Path(tokenizer)
    if model is not None:
        found = Path(model).expanduser() / "tokenizer.json"
        return found.parent if found.is_file() else None
    if engine == "embedded":
        from spectune.engine import shipped

        return shipped.target_path()
    return None
