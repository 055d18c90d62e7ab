"""The attach-only OpenAI adapter against real HTTP servers on 127.0.0.1: one that requires an API key, and ones
exposing what vLLM, llama-server and SGLang expose (their payloads in tests/data)."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web
from engine_fixtures import running_app

from spectune.errors import SpectuneError
from spectune.records import Scrape
from spectune.servers import make_server
from spectune.servers.base import ServerSpec

KEY = "sk-test-7f3a9c"


def _keyed_app(seen: list[str]) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": "invalid api key"}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "hosted-model"}, {"id": "other"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


def test_attach_with_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_TEST_KEY", KEY)
    seen: list[str] = []
    with running_app(_keyed_app(seen)) as url:
        server = make_server(ServerSpec(name="hosted", engine="openai", url=url, api_key_env="SPECTUNE_TEST_KEY"), tmp_path)
        server.start()
        assert seen and set(seen) == {f"Bearer {KEY}"}
        assert server.model_name == "hosted-model"  # no `model` given: the first one served
        assert server.scrape() == Scrape()  # no speculative knowledge
        calls = len(seen)
        server.reset_cache()
        assert len(seen) == calls  # a no-op: nothing sent
        assert server.pid() is None and server.alive()
        server.stop()
    assert not server.alive()
    assert not list(tmp_path.iterdir())  # nothing logged, so the key cannot be either


def test_model_given_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_TEST_KEY", KEY)
    with running_app(_keyed_app([])) as url:
        server = make_server(ServerSpec(name="h", engine="openai", url=url, model="other", api_key_env="SPECTUNE_TEST_KEY"), tmp_path)
        server.start()
    assert server.model_name == "other"


def test_wrong_key_fails_without_showing_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_TEST_KEY", "sk-wrong-1234")
    with running_app(_keyed_app([])) as url:
        server = make_server(ServerSpec(name="h", engine="openai", url=url, api_key_env="SPECTUNE_TEST_KEY"), tmp_path)
        with pytest.raises(SpectuneError, match="HTTP 401") as err:
            server.start()
    assert "sk-wrong-1234" not in str(err.value)


def test_unset_key_variable_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECTUNE_TEST_KEY", raising=False)
    with running_app(_keyed_app([])) as url:
        server = make_server(ServerSpec(name="h", engine="openai", url=url, api_key_env="SPECTUNE_TEST_KEY"), tmp_path)
        with pytest.raises(SpectuneError, match="SPECTUNE_TEST_KEY, which is not set"):
            server.start()


def test_nothing_listening_is_a_clear_error(tmp_path):
    from spectune.servers.base import free_port

    server = make_server(ServerSpec(name="h", engine="openai", url=f"http://127.0.0.1:{free_port()}"), tmp_path)
    with pytest.raises(SpectuneError, match="no answer .* is the server running"):
        server.start()


DATA = Path(__file__).parent / "data"


def _exposing_app(metrics: str | None, server_info: str | None) -> web.Application:
    """An attachable server exposing what a vLLM / llama-server / SGLang server does (their payloads in tests/data)."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def text(request: web.Request) -> web.Response:
        body = metrics if request.path == "/metrics" else server_info
        if body is None:
            return web.Response(status=404, text="Not Found")
        return web.Response(text=body, content_type="application/json" if request.path == "/server_info" else "text/plain")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", text)
    app.router.add_get("/server_info", text)
    return app


@pytest.mark.parametrize("metrics, server_info, exposes, counters", [
    ("vllm_0.32_cpu_draft_model_metrics.txt", None, ["/metrics (vllm:)"], (6, 18, 18)),
    ("llamacpp_draft_model_metrics.txt", None, ["/metrics (llamacpp:)"], (6, 17, 17)),
    ("vllm_0.32_cpu_target_only_metrics.txt", None, ["/metrics (vllm:)"], (None, None, None)),  # no drafts: no counters
    ("sglang_0.5.23_metrics.txt", "sglang_0.5.23_server_info.json", ["/server_info (sglang)"], (None, None, None)),
    (None, None, [], (None, None, None)),  # a hosted endpoint: nothing to see
])
def test_attach_finds_what_the_server_exposes_and_scrapes_it(tmp_path, metrics, server_info, exposes, counters):
    read = lambda name: (DATA / name).read_text() if name else None
    with running_app(_exposing_app(read(metrics), read(server_info))) as url:
        server = make_server(ServerSpec(name="h", engine="openai", url=url), tmp_path)
        server.start()
        scrape = server.scrape()
    assert server.exposes == exposes
    assert (scrape.num_drafts, scrape.num_draft_tokens, scrape.num_accepted_tokens) == counters
    if metrics and metrics.startswith("llamacpp"):
        assert server.extra_body == {"timings_per_token": True}  # so llama-server sends per-chunk token counts
    if server_info:  # SGLang: live steps and lifetime accept length from /server_info, as its own adapter reads them
        assert (scrape.num_steps, scrape.avg_accept_length, scrape.num_running) == (1, 2.4375, 12)
