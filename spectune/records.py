"""The data that moves between the stages: requests, raw per-request timings, server scrapes.

Raw timings are stored once, as measured (perf_counter_ns); every metric is derived later in analysis.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload. Chat requests have `messages`; completion requests a `prompt`."""

    index: int
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None  # (role, content) pairs
    max_tokens: int
    arrival_s: float | None = None  # offset from the start of the run, when the workload fixes it
    tag: str = ""  # e.g. the workload phase ("code", "random") the request came from


@dataclass(slots=True)
class RequestRecord:
    """What the load generator saw for one request. Times are time.perf_counter_ns() values."""

    index: int
    send_ns: int  # when the request was actually sent
    chunk_ns: list[int] = field(default_factory=list)  # arrival time of each chunk that carried >= 1 output token
    chunk_tokens: list[int] = field(default_factory=list)  # output tokens carried by each of those chunks
    end_ns: int | None = None  # when the stream ended ([DONE] or connection closed)
    output_tokens: int | None = None  # from the final `usage`
    prompt_tokens: int | None = None
    text: str = ""
    error: str | None = None  # None = success; else the cause ("http 503: ...", "timeout after 30 s", ...)
    warmup: bool = False
    token_source: str = ""  # how chunk_tokens were counted (spectune.tokens): usage, timings, token_ids, tokenizer,
    # tokenizer+spread, text (1 per chunk, confirmed by the total) or unknown (only the total is known)
    intended_ns: int | None = None  # when the schedule meant to send it (trace, Poisson); None: closed loop, = send_ns

    @property
    def intended(self) -> int:
        """The intended send time; in closed loop the actual one (a request is meant to go when a slot frees)."""
        return self.send_ns if self.intended_ns is None else self.intended_ns

    @property
    def per_token_known(self) -> bool:
        """Whether each chunk's token count is known (not only the request's total)."""
        return self.token_source != "unknown"

    @property
    def counted_tokens(self) -> int:
        """Tokens summed over chunks; may differ from the server's `output_tokens` (analysis flags it)."""
        return sum(self.chunk_tokens)


@dataclass(frozen=True, slots=True)
class Scrape:
    """One snapshot of a server's speculative-decoding counters (absent values are None)."""

    num_drafts: float | None = None  # rounds that proposed drafts (vllm:spec_decode_num_drafts_total)
    num_draft_tokens: float | None = None
    num_accepted_tokens: float | None = None  # accepted drafts, bonus token excluded
    accepted_per_pos: tuple[float, ...] = ()
    avg_accept_length: float | None = None  # SGLang /server_info lifetime mean, bonus included
    num_steps: int | None = None  # live speculative_num_steps (SGLang adaptive)
    kv_cache_usage: float | None = None  # fraction 0..1
    num_running: float | None = None  # requests the server is decoding now (vllm:num_requests_running and the like)


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Acceptance over a measured window, from two scrapes."""

    rate: float | None  # accepted draft tokens / proposed draft tokens
    mean_length: float | None  # tokens per round incl. bonus = 1 + accepted / drafts
    per_pos: tuple[float, ...] = ()  # P(draft at position i accepted) per round
    is_lifetime: bool = False  # True when taken from a server's lifetime mean (SGLang), not this window
    num_drafts: float | None = None  # the window's counter deltas: request-rounds that drafted,
    num_accepted_tokens: float | None = None  # and the drafts they accepted (bonus excluded)
