"""The attach-only OpenAI adapter against a real HTTP server on 127.0.0.1 that requires an API key."""

from __future__ import annotations

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
