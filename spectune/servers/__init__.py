"""Engine adapters behind one protocol (base.Server); make_server picks one by spec.engine.

Adapters are imported on first use so that importing spectune.servers stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from spectune.errors import SpectuneError
from spectune.servers.base import Server, ServerSpec

ADAPTERS = {
    "embedded": ("spectune.servers.embedded", "EmbeddedServer"),
    "vllm": ("spectune.servers.vllm", "VllmServer"),
    "sglang": ("spectune.servers.sglang", "SglangServer"),
    "llamacpp": ("spectune.servers.llamacpp", "LlamaCppServer"),
    "openai": ("spectune.servers.openai", "OpenAIServer"),
}


def make_server(
    spec: ServerSpec, log_dir: Path, *, round_log: Path | None = None, max_batch_size: int | None = None
) -> Server:
    """The adapter for spec.engine. `max_batch_size` (the plan's largest) sizes the engine's concurrent
    sequences (vLLM --max-num-seqs, SGLang --max-running-requests, llama.cpp -np slots, embedded
    --max-num-seqs); `round_log` is where the embedded engine logs its verify rounds."""
    if spec.engine not in ADAPTERS:
        raise SpectuneError(f"server {spec.name!r}: unknown engine {spec.engine!r}; use one of {sorted(ADAPTERS)}")
    module, name = ADAPTERS[spec.engine]
    adapter = getattr(importlib.import_module(module), name)
    if spec.engine == "embedded":
        return adapter(spec, Path(log_dir), round_log=round_log, max_batch_size=max_batch_size)
    return adapter(spec, Path(log_dir), max_batch_size=max_batch_size)
