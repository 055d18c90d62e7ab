"""Validated configuration of the embedded engine and its server; speculative config uses vLLM's key names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spectune.errors import SpectuneError

METHODS = ("draft_model", "eagle", "dflash", "ngram")
MODEL_METHODS = ("draft_model", "eagle", "dflash")  # methods that take `model`
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", SCHEDULE_KEY)


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`, the subset this engine runs. Build with `parse`."""

    method: str
    num_speculative_tokens: int
    model: Path | None = None  # draft_model / eagle / dflash only; None -> the shipped draft / head
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    # vLLM dynamic SD: inclusive batch-size ranges (start, end, k); k = 0 -> plain decode at that batch size.
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    @classmethod
    def parse(cls, source: str | dict) -> SpeculativeConfig:
        """From a JSON object string (or dict). Every mistake raises one SpectuneError line naming the key."""
        where = "--speculative-config"
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except json.JSONDecodeError as exc:
                example = '{"method": "ngram", "num_speculative_tokens": 3}'
                raise SpectuneError(f"{where}: not valid JSON ({exc.msg}); pass an object like '{example}'") from None
        if not isinstance(source, dict):
            raise SpectuneError(f"{where}: must be a JSON object with keys {', '.join(_SPEC_KEYS)}")
        unknown = sorted(set(source) - set(_SPEC_KEYS))
        if unknown:
            raise SpectuneError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(_SPEC_KEYS)}")
        method = source.get("method") or ("draft_model" if source.get("model") else None)
        if method not in METHODS:
            raise SpectuneError(f"{where}.method: {source.get('method')!r} is not supported; use one of {', '.join(METHODS)}")
        k = _int(source.get("num_speculative_tokens"), f"{where}.num_speculative_tokens", minimum=1)
        model = source.get("model")
        if model is not None and (method not in MODEL_METHODS or not isinstance(model, str)):
            raise SpectuneError(f"{where}.model: must be a checkpoint dir path and applies to methods {', '.join(MODEL_METHODS)} only")
        lookup_min, lookup_max = source.get("prompt_lookup_min"), source.get("prompt_lookup_max")
        if method == "ngram":
            # vLLM's defaults: one given -> both equal; none given -> 5.
            lookup_min = _int(lookup_min if lookup_min is not None else (lookup_max or 5), f"{where}.prompt_lookup_min", minimum=1)
            lookup_max = _int(lookup_max if lookup_max is not None else lookup_min, f"{where}.prompt_lookup_max", minimum=1)
            if lookup_min > lookup_max:
                raise SpectuneError(f"{where}: prompt_lookup_min={lookup_min} must be <= prompt_lookup_max={lookup_max}")
        elif lookup_min is not None or lookup_max is not None:
            raise SpectuneError(f"{where}.prompt_lookup_min/max: apply to method ngram only; remove them")
        schedule = source.get(SCHEDULE_KEY)
        return cls(
            method=method,
            num_speculative_tokens=k,
            model=Path(model) if model else None,
            prompt_lookup_min=lookup_min or 0,
            prompt_lookup_max=lookup_max or 0,
            num_speculative_tokens_per_batch_size=None if schedule is None else _schedule(schedule, f"{where}.{SCHEDULE_KEY}"),
        )


def _int(value: object, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpectuneError(f"{where}: {value!r} must be an integer >= {minimum}")
    return value


def _schedule(raw: object, where: str) -> tuple[tuple[int, int, int], ...]:
    """vLLM's rules: non-empty list of [start, end, k], start <= end, positive sizes, k >= 0, sorted ranges disjoint, first starts at 1."""
    if not isinstance(raw, list) or not raw:
        raise SpectuneError(f"{where}: must be a non-empty list of [start, end, k] entries")
    entries = []
    for entry in raw:
        if not isinstance(entry, list | tuple) or len(entry) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
            raise SpectuneError(f"{where}: entry {entry!r} must be three integers [start, end, k]")
        start, end, k = entry
        if start <= 0 or end < start or k < 0:
            raise SpectuneError(f"{where}: entry {entry!r} needs 1 <= start <= end and k >= 0")
        entries.append((start, end, k))
    entries.sort()
    for (_, prev_end, _), (start, _, _) in zip(entries, entries[1:]):
        if start <= prev_end:
            raise SpectuneError(f"{where}: ranges overlap at batch size {start}; make them disjoint")
    if entries[0][0] != 1:
        raise SpectuneError(f"{where}: the first range must start at batch size 1")
    return tuple(entries)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """What the engine loads and how it schedules. Paths None -> the shipped models."""

    model: Path | None = None
    speculative: SpeculativeConfig | None = None
    adaptive_config: Path | None = None  # SGLang adaptive_spec.json; needs `speculative` (its k is the launch step)
    max_num_seqs: int = 16
    max_model_len: int | None = None  # None -> the target's max_position_embeddings
    seed: int = 0  # seeds requests that bring no seed of their own
    round_log: Path | None = None  # JSONL, one line per verify round
    num_threads: int | None = None  # torch intra-op threads; None -> $SPECTUNE_TORCH_THREADS or torch's default

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise SpectuneError(f"--max-num-seqs: {self.max_num_seqs} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SpectuneError(f"--max-model-len: {self.max_model_len} must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise SpectuneError(f"--threads: {self.num_threads} must be >= 1")
        if self.adaptive_config is not None:
            if self.speculative is None:
                raise SpectuneError(
                    "--speculative-adaptive-config: needs --speculative-config (method, and num_speculative_tokens as the launch step)"
                )
            if self.speculative.num_speculative_tokens_per_batch_size is not None:
                raise SpectuneError(f"--speculative-adaptive-config: cannot be combined with {SCHEDULE_KEY}; pick one step policy")
            if not self.adaptive_config.is_file():
                raise SpectuneError(f"{self.adaptive_config}: adaptive config file not found")


@dataclass(slots=True, frozen=True)
class ServeOptions:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000  # 0 -> any free port; the chosen one is printed on the ready line
    served_model_name: str | None = None  # None -> the model dir's name
