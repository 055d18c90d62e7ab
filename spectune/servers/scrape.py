"""Reading servers: Prometheus text (prometheus_client's parser), the speculative counters of each engine, and
the plain HTTP calls the adapters share (urllib: adapters run in the sweep's main thread).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from spectune.errors import SpectuneError
from spectune.records import Scrape


@dataclass(frozen=True, slots=True)
class Sample:
    """One line of a Prometheus text exposition: name{labels} value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in order (counters keep their `_total` and `_created`
    samples apart); ValueError naming the problem on text that is not one."""
    try:
        return [Sample(s.name, tuple(s.labels.items()), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, IndexError, KeyError) as e:  # the parser's errors on malformed lines
        raise ValueError(f"not Prometheus text exposition ({type(e).__name__}: {e})") from None


def metric_sum(samples: list[Sample], name: str) -> float | None:
    """The sum of `name` over all its label sets (engines, data-parallel ranks); None if absent."""
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None


def metric_mean(samples: list[Sample], name: str) -> float | None:
    """The mean of a gauge over its label sets; None if absent."""
    values = [s.value for s in samples if s.name == name]
    return sum(values) / len(values) if values else None


def per_position(samples: list[Sample], name: str) -> tuple[float, ...]:
    """A counter labelled position="0..n-1", summed over every other label, in position order."""
    totals: dict[int, float] = {}
    for s in samples:
        pos = s.label("position") if s.name == name else None
        if pos is not None:
            totals[int(pos)] = totals.get(int(pos), 0.0) + s.value
    return tuple(totals.get(i, 0.0) for i in range(max(totals) + 1)) if totals else ()


def spec_decode_scrape(text: str, prefix: str = "vllm:") -> Scrape:
    """vLLM's spec_decode counters (llama.cpp exposes the same names under "llamacpp:")."""
    samples = parse_prometheus(text)
    return Scrape(
        num_drafts=metric_sum(samples, f"{prefix}spec_decode_num_drafts_total"),
        num_draft_tokens=metric_sum(samples, f"{prefix}spec_decode_num_draft_tokens_total"),
        num_accepted_tokens=metric_sum(samples, f"{prefix}spec_decode_num_accepted_tokens_total"),
        accepted_per_pos=per_position(samples, f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"),
        kv_cache_usage=metric_mean(samples, f"{prefix}kv_cache_usage_perc"),
        num_running=metric_sum(samples, RUNNING_GAUGES[prefix]) if prefix in RUNNING_GAUGES else None,
    )


# requests decoding now, per engine's metric prefix (summed over data-parallel engines)
RUNNING_GAUGES = {"vllm:": "vllm:num_requests_running", "llamacpp:": "llamacpp:requests_processing",
                  "sglang:": "sglang:num_running_reqs"}


def sglang_scrape(server_info: dict, metrics_text: str | None) -> Scrape:
    """SGLang's /server_info (live num_steps, lifetime accept length incl. bonus) and its gauges."""
    states = server_info.get("internal_states") or [{}]
    state = states[0] if isinstance(states[0], dict) else {}
    samples = parse_prometheus(metrics_text) if metrics_text else []
    num_steps = state.get("speculative_num_steps")
    if num_steps is None and (gauge := metric_mean(samples, "sglang:spec_num_steps")) is not None:
        num_steps = round(gauge)
    accept_length = state.get("avg_spec_accept_length")
    if accept_length is None:
        accept_length = metric_mean(samples, "sglang:spec_accept_length")
    return Scrape(
        avg_accept_length=float(accept_length) if accept_length is not None else None,
        num_steps=int(num_steps) if num_steps is not None else None,
        kv_cache_usage=metric_mean(samples, "sglang:token_usage"),
        num_running=metric_sum(samples, RUNNING_GAUGES["sglang:"]),
    )


class HttpError(SpectuneError):
    """A server answered with an error status; `status` lets an adapter explain a known one."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def http_get(url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> str:
    """GET `url` and return its body; SpectuneError naming the URL on any failure."""
    return _call(urllib.request.Request(url, headers=headers or {}), timeout_s)


def http_post(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> str:
    """POST an empty JSON object (the engines' cache-reset endpoints take no arguments)."""
    request = urllib.request.Request(
        url, data=b"{}", method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    return _call(request, timeout_s)


def _call(request: urllib.request.Request, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")[:200]
        raise HttpError(f"{request.full_url}: HTTP {e.code} {detail}; check the server and its flags", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        raise SpectuneError(f"{request.full_url}: no answer ({e}); is the server running?") from None
