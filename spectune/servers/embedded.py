"""spectune's own engine (`spectune serve`), launched in a subprocess like any other engine.

It takes vLLM's --speculative-config JSON and SGLang's adaptive config, exposes vLLM-style /metrics and
SGLang-style /server_info, and appends one JSON line per verify round to its round log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from spectune.adaptive import AdaptiveConfig
from spectune.emit import sglang_launch_steps
from spectune.errors import SpectuneError
from spectune.records import Scrape
from spectune.servers.base import ServerSpec
from spectune.servers.launched import LaunchedServer
from spectune.servers.scrape import (
    http_get,
    http_post,
    sglang_scrape,
    spec_decode_scrape,
)
from spectune.servers.vllm import speculative_config


class EmbeddedServer(LaunchedServer):
    engine = "embedded engine"

    def __init__(
        self, spec: ServerSpec, log_dir: Path, round_log: Path | None = None, max_batch_size: int | None = None
    ):
        super().__init__(spec, log_dir)
        self.max_batch_size = max_batch_size
        # a launched engine always logs rounds; an attached one logs wherever it was told to (unknown here)
        self.round_log: Path | None = None if spec.url else (round_log or self.log_dir / f"{spec.name}.rounds.jsonl")

    def command(self, port: int) -> list[str]:
        spec = self.spec
        argv = [
            sys.executable, "-m", "spectune.cli", "serve", "--host", spec.host, "--port", str(port),
            "--served-model-name", spec.name, "--round-log", str(self.round_log),
        ]  # fmt: skip
        if spec.model:
            argv += ["--model", spec.model]
        config = speculative_config(self._launch_spec())
        if config is not None:  # the engine validates it (and defaults a missing draft to the shipped one)
            argv += ["--speculative-config", json.dumps(config.to_dict())]
        if spec.draft_noise is not None:
            argv += ["--draft-noise", str(spec.draft_noise)]
        if spec.adaptive_config:
            argv += ["--speculative-adaptive-config", spec.adaptive_config]
        if self.max_batch_size is not None:
            argv += ["--max-num-seqs", str(self.max_batch_size)]
        if "--threads" not in spec.extra_args:
            # The load generator shares this machine: leave it a core, or both starve (measured 100x slower).
            argv += ["--threads", str(max(1, (os.cpu_count() or 2) - 1))]
        return argv + list(spec.extra_args)

    def _launch_spec(self) -> ServerSpec:
        """Under an adaptive config without a launch step, the step SGLang would start at."""
        if not self.spec.adaptive_config:
            return self.spec
        if not self.spec.is_speculative:
            raise SpectuneError(f"server {self.spec.name!r}: adaptive_config needs a `method` (e.g. draft_model)")
        if self.spec.num_speculative_tokens is not None:
            return self.spec
        steps = sglang_launch_steps(AdaptiveConfig.from_file(self.spec.adaptive_config))
        return dataclasses.replace(self.spec, num_speculative_tokens=steps)

    def scrape(self) -> Scrape:
        counters = spec_decode_scrape(http_get(self.base_url + "/metrics"), "vllm:")
        live = sglang_scrape(json.loads(http_get(self.base_url + "/server_info")), None)
        return dataclasses.replace(counters, num_steps=live.num_steps, avg_accept_length=live.avg_accept_length)

    def reset_cache(self) -> None:
        http_post(self.base_url + "/reset_prefix_cache")

    def engine_version(self) -> str | None:
        from spectune import __version__

        return f"spectune {__version__}"
