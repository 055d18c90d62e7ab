"""Any OpenAI-compatible server, attached by URL: no launch, no speculative counters, no cache reset.

Use it to measure a server spectune cannot see into (a hosted endpoint, an engine without an adapter):
latency and throughput are still measured; acceptance is not.
"""

from __future__ import annotations

from pathlib import Path

from spectune.errors import SpectuneError
from spectune.records import Scrape
from spectune.servers.base import ServerSpec
from spectune.servers.launched import LaunchedServer


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

    def start(self) -> None:
        """Ready when GET /v1/models answers (with the API key when spec.api_key_env names one)."""
        self.model_name = self._attached_model_name()

    def scrape(self) -> Scrape:
        return Scrape()

    def reset_cache(self) -> None:
        """No portable way to reset a prefix cache: a no-op (repeated prompts may be served from cache)."""
