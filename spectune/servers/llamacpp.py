"""llama.cpp: `llama-server` with a draft model (draft-simple) or prompt n-gram lookup (ngram-simple).

The binary is $SPECTUNE_LLAMA_SERVER, else <cache>/llama.cpp/bin/llama-server (scripts/install-engines.sh
llamacpp). Models may be GGUF files or Hugging Face directories, converted once to GGUF under <cache>/gguf.

llama-server decodes at most `-np` requests at once (its slots), so the server is launched with as many
slots as the plan's largest batch size, each with its own context. It has no prefix-cache reset: the
adapter erases every slot (POST /slots/{i}?action=erase, which needs --slot-save-path) and turns off the
host-memory prompt cache (--cache-ram 0), which erasing slots would not clear. Its /metrics has vLLM's
spec_decode counter names under "llamacpp:" (server-task.cpp); they are added when a request finishes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from spectune.emit import llamacpp_flags
from spectune.errors import SpectuneError
from spectune.records import Scrape
from spectune.servers.base import ServerSpec
from spectune.servers.launched import LaunchedServer, option_given, spectune_cache
from spectune.servers.scrape import HttpError, http_get, http_post, spec_decode_scrape

CTX_PER_SLOT = 2048  # tokens of context per slot (prompt + output); -c in extra_args overrides the total
NGRAM_DEFAULT = 5  # lookup n-gram length when the spec gives none: vLLM's default prompt_lookup_max


def llama_server_binary() -> str:
    return os.environ.get("SPECTUNE_LLAMA_SERVER") or str(spectune_cache() / "llama.cpp" / "bin" / "llama-server")


def gguf_for(model: str) -> Path:
    """A GGUF file for `model`: the file itself, or an HF directory converted once (cached by its path)."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if not (path / "config.json").is_file():
        raise SpectuneError(f"{model}: not a GGUF file nor a Hugging Face model directory; llama.cpp needs one of them")
    from spectune.engine.shipped import gguf_convert

    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return gguf_convert(path, spectune_cache() / "gguf" / f"{path.name}-{digest}.gguf")


class LlamaCppServer(LaunchedServer):
    engine = "llama.cpp"

    # per-chunk cumulative token counts: llama-server holds back chunks with partial UTF-8, so counting text undercounts
    extra_body = {"timings_per_token": True}

    def __init__(self, spec: ServerSpec, log_dir: Path, max_batch_size: int | None = None):
        super().__init__(spec, log_dir)
        self.slots = max_batch_size or 1
        self.binary = llama_server_binary()

    def command(self, port: int) -> list[str]:
        spec = self.spec
        if not spec.model:
            raise SpectuneError(f"server {spec.name!r}: engine llamacpp needs `model` (a .gguf file or an HF model dir)")
        if not Path(self.binary).exists():
            raise SpectuneError(f"{self.binary}: llama-server not found; run scripts/install-engines.sh llamacpp "
                                "or set SPECTUNE_LLAMA_SERVER")
        slot_dir = self.log_dir / f"{spec.name}.slots"
        slot_dir.mkdir(parents=True, exist_ok=True)  # llama-server refuses a --slot-save-path that is not a directory
        argv = [
            self.binary, "-m", str(gguf_for(spec.model)), "--host", spec.host, "--port", str(port),
            "--alias", spec.name, "--metrics", "-np", str(self.slots),
            "--slot-save-path", str(slot_dir), "--cache-ram", "0",
        ]  # fmt: skip
        if not option_given(spec.extra_args, "-c", "--ctx-size"):
            argv += ["-c", str(self.slots * CTX_PER_SLOT)]
        return argv + self._speculative_args() + list(spec.extra_args)

    def _speculative_args(self) -> list[str]:
        spec = self.spec
        g = spec.num_speculative_tokens
        if spec.method is None:
            return []
        where = f"server {spec.name!r}"
        if g is None or g < 1:
            raise SpectuneError(f"{where}: method {spec.method!r} needs num_speculative_tokens >= 1")
        if spec.adaptive_config or spec.per_batch_size:
            raise SpectuneError(f"{where}: llama.cpp has no per-batch-size steps; remove adaptive_config/per_batch_size")
        if spec.method in ("draft_model", "standalone"):
            if not spec.draft_model:
                raise SpectuneError(f"{where}: method {spec.method!r} needs draft_model (a .gguf file or an HF model dir)")
            return llamacpp_flags(g, draft_model_path=gguf_for(spec.draft_model))
        if spec.method == "ngram":
            # ngram-simple looks up one n-gram length: the shortest vLLM falls back to (the one that matches most)
            n = spec.prompt_lookup_min or spec.prompt_lookup_max or NGRAM_DEFAULT
            return llamacpp_flags(g, ngram=True) + ["--spec-ngram-simple-size-n", str(n)]
        raise SpectuneError(f"{where}: method {spec.method!r} is not supported by the llamacpp adapter; "
                            "use draft_model or ngram")

    def scrape(self) -> Scrape:
        return spec_decode_scrape(http_get(self.base_url + "/metrics", headers=self.auth_headers()), "llamacpp:")

    def reset_cache(self) -> None:
        props = json.loads(http_get(self.base_url + "/props", headers=self.auth_headers()))
        for slot in range(int(props.get("total_slots", self.slots))):
            try:
                http_post(f"{self.base_url}/slots/{slot}?action=erase", headers=self.auth_headers())
            except HttpError as e:
                raise SpectuneError(
                    f"{self.base_url}: llama-server refused to erase slot {slot} (HTTP {e.status}); start it with "
                    "--slot-save-path DIR and --cache-ram 0 (spectune does when it launches it)"
                ) from None

    def engine_version(self) -> str | None:
        try:
            done = subprocess.run([self.binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in (done.stdout + done.stderr).splitlines():
            if line.startswith("version:"):
                return line.removeprefix("version:").strip()
        return None
