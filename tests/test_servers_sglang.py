"""The SGLang adapter against a real HTTP server on 127.0.0.1 answering with SGLang-shaped bodies
(SGLang cannot serve on CPU here; tests/data/README.md says where the bodies come from)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from aiohttp import web
from engine_fixtures import running_app
from sglang_compat import sglang_package_dir

from spectune.servers import make_server
from spectune.servers.base import ServerSpec

DATA = Path(__file__).parent / "data"


def _sglang_app(seen: list[str], with_metrics: bool = True) -> web.Application:
    info = json.loads((DATA / "sglang_0.5.23_server_info.json").read_text())
    metrics = (DATA / "sglang_0.5.23_metrics.txt").read_text()

    async def record(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path}")
        if request.path == "/server_info":
            return web.json_response(info)
        if request.path == "/metrics":
            return web.Response(text=metrics, content_type="text/plain") if with_metrics else web.Response(status=404)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "eagle-adaptive", "object": "model"}]})
        return web.Response(text="ok")

    app = web.Application()
    for path in ("/health", "/v1/models", "/server_info", "/metrics"):
        app.router.add_get(path, record)
    app.router.add_post("/flush_cache", record)
    return app


def test_attach_scrape_and_reset_recorded_sglang_payloads(tmp_path):
    seen: list[str] = []
    with running_app(_sglang_app(seen)) as url:
        server = make_server(ServerSpec(name="sg", engine="sglang", url=url), tmp_path)
        server.start()
        assert server.model_name == "eagle-adaptive"  # attached: the name the server serves
        assert server.pid() is None and server.alive()
        scrape = server.scrape()
        assert (scrape.num_steps, scrape.avg_accept_length) == (1, 2.4375)  # live steps, lifetime accept length
        assert scrape.kv_cache_usage == 0.0412
        assert "GET /metrics" in seen
        server.reset_cache()
        assert seen[-1] == "POST /flush_cache"
        assert server.engine_version() == "0.5.23"
        server.stop()  # attached: nothing to stop, the server keeps running
        assert server.alive()
    assert not server.alive()


def test_scrape_without_enable_metrics_uses_server_info_alone_recorded_sglang_payloads(tmp_path):
    seen: list[str] = []
    with running_app(_sglang_app(seen, with_metrics=False)) as url:
        server = make_server(ServerSpec(name="sg", engine="sglang", url=url, model="eagle-adaptive"), tmp_path)
        server.start()
        scrape = server.scrape()
    assert (scrape.num_steps, scrape.avg_accept_length, scrape.kv_cache_usage) == (1, 2.4375, None)


def _sglang_fields() -> set[str]:
    """Every launch option SGLang 0.5.23 declares (arg_groups/fields/*.py; --x-y is field x_y)."""
    names = set()
    for path in (sglang_package_dir() / "srt" / "arg_groups" / "fields").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def test_every_flag_the_adapter_passes_is_an_sglang_option(tmp_path):
    config = tmp_path / "adaptive_spec.json"
    config.write_text(json.dumps({"1": {"candidate_steps": [1, 3]}}))
    specs = [
        ServerSpec(name="a", engine="sglang", model="/m", method="eagle", num_speculative_tokens=3, draft_model="/e",
                   adaptive_config=str(config)),
        ServerSpec(name="s", engine="sglang", model="/m", method="draft_model", num_speculative_tokens=2, draft_model="/d"),
        ServerSpec(name="n", engine="sglang", model="/m", method="ngram", num_speculative_tokens=2),
    ]  # fmt: skip
    fields = _sglang_fields()
    for spec in specs:
        flags = [a for a in make_server(spec, tmp_path, max_batch_size=8).command(30000) if a.startswith("--")]
        assert {f for f in flags if f[2:].replace("-", "_") not in fields} == set(), spec.name
