"""Any OpenAI-compatible server, attached by URL: no launch, no cache reset, and acceptance from whatever the
server turns out to expose.

On attach it probes: GET /metrics with vLLM's spec_decode counters (`vllm:`, also what spectune's own engine
serves) or llama-server's (`llamacpp:`), else SGLang's `sglang:` gauges, and GET /server_info with SGLang's
`internal_states`. `exposes` lists what was found and scrape() reads it, so acceptance is measured on a server
spectune did not launch (and a llama-server is asked for its per-chunk token counts, timings_per_token); a hosted
endpoint that exposes nothing still gives latency and throughput.
"""

from __future__ import annotations

import json
from pathlib import Path

from spectune.errors import SpectuneError
from spectune.records import Scrape
from spectune.servers.base import ServerSpec
from spectune.servers.launched import LaunchedServer
from spectune.servers.scrape import http_get, parse_prometheus, sglang_scrape, spec_decode_scrape

COUNTER_PREFIXES = ("vllm:", "llamacpp:")  # engines whose /metrics has the spec_decode counters


class OpenAIServer(LaunchedServer):
    engine = "OpenAI-compatible server"
    health_path = "/v1/models"  # the one endpoint every such server has

    def __init__(self, spec: ServerSpec, log_dir: Path, max_batch_size: int | None = None):
        if spec.url is None:
            raise SpectuneError(f"server {spec.name!r}: engine openai attaches to a running server; set `url`")
        if spec.is_speculative:
            raise SpectuneError(f"server {spec.name!r}: engine openai cannot configure speculative decoding; "
                                "remove `method` or use the server's own engine adapter")
        super().__init__(spec, log_dir)
        self.exposes: list[str] = []  # what start() found: "/metrics (vllm:)", "/server_info (sglang)"
        self._prefix: str | None = None  # the spec_decode counters' prefix in /metrics
        self._sglang = False
        self._sglang_metrics = False  # SGLang launched with --enable-metrics: its sglang:* gauges too

    def start(self) -> None:
        """Ready when GET /v1/models answers (with the API key when spec.api_key_env names one); then probe."""
        self.model_name = self._attached_model_name()
        metrics = self._get("/metrics")
        names = {s.name for s in _samples(metrics)}
        self._prefix = next((p for p in COUNTER_PREFIXES if f"{p}spec_decode_num_drafts_total" in names), None)
        if self._prefix is None:  # a target-only vLLM / llama-server: no counters yet, still its gauges
            self._prefix = next((p for p in COUNTER_PREFIXES if any(n.startswith(p) for n in names)), None)
        if self._prefix == "llamacpp:":  # llama-server counts tokens per chunk only when asked (LlamaCppServer does too)
            self.extra_body = {"timings_per_token": True}
        info = _json(self._get("/server_info"))
        self._sglang = isinstance(info, dict) and isinstance(info.get("internal_states"), list)
        self._sglang_metrics = any(n.startswith("sglang:") for n in names)
        self.exposes = ([f"/metrics ({self._prefix})"] if self._prefix else []) + (["/server_info (sglang)"] if self._sglang else [])

    def scrape(self) -> Scrape:
        if self._prefix is not None:
            return spec_decode_scrape(http_get(self.base_url + "/metrics", headers=self.auth_headers()), self._prefix)
        if self._sglang:
            info = json.loads(http_get(self.base_url + "/server_info", headers=self.auth_headers()))
            return sglang_scrape(info, self._get("/metrics") if self._sglang_metrics else None)
        return Scrape()

    def reset_cache(self) -> None:
        """No portable way to reset a prefix cache: a no-op (repeated prompts may be served from cache)."""

    def _get(self, path: str) -> str | None:
        """The body of GET path, or None when the server has no such endpoint (or does not answer it)."""
        try:
            return http_get(self.base_url + path, timeout_s=5.0, headers=self.auth_headers())
        except SpectuneError:
            return None


def _samples(text: str | None) -> list:
    if not text:
        return []
    try:
        return parse_prometheus(text)
    except ValueError:  # not Prometheus text: an HTML page or some other body at /metrics
        return []


def _json(text: str | None) -> object:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None
