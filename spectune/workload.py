"""Request sets and traffic schedules: what is sent, and when. Everything here is deterministic.

A request set is a JSONL file, one object per line:
    {"prompt": str} or {"messages": [{"role": str, "content": str}, ...]}
    optional: "max_tokens" (int > 0), "arrival_s" (float >= 0, for Trace), "tag" (str)
ShareGPT JSON (a list of {"conversations": [{"from": "human"|"gpt", "value": str}, ...]}) is read too:
the first human turn becomes one user message; entries without a human turn are skipped.

A schedule turns a request list into send offsets (seconds from the start of the run); None means
"as soon as a slot frees" (closed loop). `max_concurrency` caps the requests in flight.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

from spectune.errors import SpectuneError
from spectune.records import Request
from spectune.resources import shipped_dir

WORKLOADS_DIR = shipped_dir("workloads")  # package data: the repository's workloads/ folder
DEFAULT_MAX_TOKENS = 128  # for lines (and ShareGPT entries) that do not give one
VALID_KEYS = ("prompt", "messages", "max_tokens", "arrival_s", "tag")


def builtin_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.jsonl"))


def load_requests(
    source: str | Path, *, num_prompts: int | None = None, max_tokens: int | None = None, seed: int = 0
) -> list[Request]:
    """Read a shipped set ("code", "quote", "random", "phase") or a file.

    num_prompts takes the first N; asking for more than the set holds cycles over it, the first pass in
    file order and every later pass in an order shuffled by `seed` (so a long run does not replay one
    fixed sequence). max_tokens overrides every request's. Indices are 0..N-1 in the returned order.
    """
    path = _resolve(source)
    base = _read_sharegpt(path) if _is_sharegpt(path) else _read_jsonl(path)
    if not base:
        raise SpectuneError(f"{path}: no requests; add at least one line")
    if num_prompts is not None and num_prompts < 1:
        raise SpectuneError(f"num_prompts: must be >= 1, got {num_prompts}")
    if max_tokens is not None and max_tokens < 1:
        raise SpectuneError(f"max_tokens: must be >= 1, got {max_tokens}")
    chosen = _cycle(base, num_prompts or len(base), seed)
    return [
        replace(r, index=i, max_tokens=max_tokens if max_tokens is not None else r.max_tokens)
        for i, r in enumerate(chosen)
    ]


def _resolve(source: str | Path) -> Path:
    if isinstance(source, str) and source in builtin_workloads():
        return WORKLOADS_DIR / f"{source}.jsonl"
    path = Path(source)
    if not path.is_file():
        raise SpectuneError(
            f"workload {source!s}: no such file or shipped set; use a path or one of {', '.join(builtin_workloads())}"
        )
    return path


def _cycle(base: list[Request], n: int, seed: int) -> list[Request]:
    out = list(base[:n])
    rng = random.Random(seed)
    while len(out) < n:
        extra = list(base)
        rng.shuffle(extra)
        out.extend(extra[: n - len(out)])
    return out


def _is_sharegpt(path: Path) -> bool:
    if path.suffix == ".json":
        return True
    with path.open(encoding="utf-8") as f:
        head = f.read(64).lstrip()
    return head.startswith("[")


def _read_jsonl(path: Path) -> list[Request]:
    requests = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                requests.append(_parse_line(line, f"{path}:{lineno}", len(requests)))
    return requests


def _parse_line(line: str, where: str, index: int) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpectuneError(f"{where}: not valid JSON ({e.msg}); write one JSON object per line") from None
    if not isinstance(obj, dict):
        raise SpectuneError(f'{where}: expected a JSON object like {{"prompt": "..."}}, got {type(obj).__name__}')
    unknown = sorted(set(obj) - set(VALID_KEYS))
    if unknown:
        raise SpectuneError(f"{where}: unknown key {', '.join(map(repr, unknown))}; valid keys: {', '.join(VALID_KEYS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise SpectuneError(f'{where}: give exactly one of "prompt" or "messages"')
    prompt, messages = None, None
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise SpectuneError(f'{where}: "prompt" must be a non-empty string, got {prompt!r}')
    else:
        messages = _parse_messages(obj["messages"], where)
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or max_tokens < 1:
        raise SpectuneError(f'{where}: "max_tokens" must be a positive integer, got {json.dumps(max_tokens)}')
    arrival_s = obj.get("arrival_s")
    if arrival_s is not None and (type(arrival_s) not in (int, float) or arrival_s < 0):
        raise SpectuneError(f'{where}: "arrival_s" must be a number >= 0, got {json.dumps(arrival_s)}')
    tag = obj.get("tag", "")
    if not isinstance(tag, str):
        raise SpectuneError(f'{where}: "tag" must be a string, got {json.dumps(tag)}')
    return Request(
        index=index,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        arrival_s=None if arrival_s is None else float(arrival_s),
        tag=tag,
    )


def _parse_messages(messages: object, where: str) -> tuple[tuple[str, str], ...]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["role"], str) and isinstance(m["content"], str)
        for m in messages
    )
    if not ok:
        raise SpectuneError(
            f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}, got {json.dumps(messages)[:80]}'
        )
    return tuple((m["role"], m["content"]) for m in messages)


def _read_sharegpt(path: Path) -> list[Request]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SpectuneError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); ShareGPT files are one JSON list") from None
    if not isinstance(data, list):
        raise SpectuneError(f'{path}: expected a JSON list of {{"conversations": [...]}} (ShareGPT)')
    requests = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise SpectuneError(f'{path}: entry {i}: expected {{"conversations": [{{"from": ..., "value": ...}}]}}')
        first = next((t for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
        if first is None:
            continue
        if not isinstance(first.get("value"), str) or not first["value"]:
            raise SpectuneError(f'{path}: entry {i}: the first human turn needs a non-empty string "value"')
        requests.append(
            Request(index=len(requests), prompt=None, messages=(("user", first["value"]),), max_tokens=DEFAULT_MAX_TOKENS)
        )
    return requests


class Schedule(Protocol):
    """When each request is sent. A pure function of the request list and the schedule's own seed."""

    @property
    def max_concurrency(self) -> int | None: ...  # None: no cap

    def send_offsets(self, requests: list[Request]) -> list[float | None]: ...


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """`concurrency` requests in flight at all times: the batch-size axis."""

    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise SpectuneError(f"concurrency: must be >= 1, got {self.concurrency}")

    @property
    def max_concurrency(self) -> int:
        return self.concurrency

    def send_offsets(self, requests: list[Request]) -> list[float | None]:
        return [None] * len(requests)


@dataclass(frozen=True, slots=True)
class Poisson:
    """Open loop at `rate_per_s`; gaps are gamma(shape=burstiness) with mean 1/rate (1.0 = Poisson).

    The first request goes at 0 s. burstiness < 1 clusters arrivals, > 1 evens them out.
    """

    rate_per_s: float
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0:
            raise SpectuneError(f"rate_per_s: must be > 0, got {self.rate_per_s}")
        if not self.burstiness > 0:
            raise SpectuneError(f"burstiness: must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise SpectuneError(f"max_concurrency: must be >= 1 or unset, got {self.max_concurrency}")

    def send_offsets(self, requests: list[Request]) -> list[float | None]:
        rng = random.Random(self.seed)
        scale = 1.0 / (self.rate_per_s * self.burstiness)
        t, offsets = 0.0, []
        for _ in requests:
            offsets.append(t)
            t += rng.gammavariate(self.burstiness, scale)
        return offsets


@dataclass(frozen=True, slots=True)
class Trace:
    """Replays each request's `arrival_s` (which must not decrease along the list)."""

    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise SpectuneError(f"max_concurrency: must be >= 1 or unset, got {self.max_concurrency}")

    def send_offsets(self, requests: list[Request]) -> list[float | None]:
        missing = [r.index for r in requests if r.arrival_s is None]
        if missing:
            raise SpectuneError(
                f'Trace schedule: request {missing[0]} has no "arrival_s"; add it to every line or use ClosedLoop/Poisson'
            )
        offsets = [r.arrival_s for r in requests]
        for i in range(1, len(offsets)):
            if offsets[i] < offsets[i - 1]:
                raise SpectuneError(
                    f'Trace schedule: request {i} has "arrival_s" {offsets[i]} < {offsets[i - 1]} before it; sort the file by'
                    " arrival_s (a set cycled past its size by num_prompts cannot be replayed as a trace)"
                )
        return offsets


def traffic_digest(requests: list[Request], schedule: Schedule, sampling: dict) -> str:
    """sha256 of exactly what is sent: the ordered requests, the schedule with its offsets, the sampling."""
    canonical = {
        "requests": [
            {"prompt": r.prompt, "messages": [list(m) for m in r.messages] if r.messages else None, "max_tokens": r.max_tokens}
            for r in requests
        ],
        "schedule": {"type": type(schedule).__name__, **asdict(schedule), "offsets": schedule.send_offsets(requests)},
        "sampling": sampling,
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
