"""The SGLang adapter against a real HTTP server on 127.0.0.1 answering with SGLang-shaped bodies: SGLang cannot
serve on CPU here, so the bodies are derived from its released server code (tests/sglang_payloads.py, which also
writes them; tests/data/README.md names the file and function each shape comes from), and checked against that
code below."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from aiohttp import web
from engine_fixtures import running_app
from prometheus_client.parser import text_string_to_metric_families
from sglang_compat import sglang_package_dir
from sglang_payloads import METRICS_FILE, SERVER_INFO_FILE, metric_definitions

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


def test_attach_scrape_and_reset_on_sglang_shaped_payloads(tmp_path):
    seen: list[str] = []
    with running_app(_sglang_app(seen)) as url:
        server = make_server(ServerSpec(name="sg", engine="sglang", url=url), tmp_path)
        server.start()
        assert server.model_name == "eagle-adaptive"  # attached: the name the server serves
        assert server.pid() is None and server.alive()
        scrape = server.scrape()
        assert (scrape.num_steps, scrape.avg_accept_length) == (1, 2.4375)  # live steps, lifetime accept length
        assert scrape.kv_cache_usage == 0.0412 and scrape.num_running == 12
        assert "GET /metrics" in seen
        server.reset_cache()
        assert seen[-1] == "POST /flush_cache"
        assert server.engine_version() == "0.5.23"
        server.stop()  # attached: nothing to stop, the server keeps running
        assert server.alive()
    assert not server.alive()


def test_scrape_without_enable_metrics_uses_server_info_alone_on_sglang_shaped_payloads(tmp_path):
    seen: list[str] = []
    with running_app(_sglang_app(seen, with_metrics=False)) as url:
        server = make_server(ServerSpec(name="sg", engine="sglang", url=url, model="eagle-adaptive"), tmp_path)
        server.start()
        scrape = server.scrape()
    assert (scrape.num_steps, scrape.avg_accept_length, scrape.kv_cache_usage) == (1, 2.4375, None)


def test_the_metrics_payload_has_sglangs_own_family_names_types_help_and_labels():
    definitions = metric_definitions(sglang_package_dir())  # read from srt/observability/metrics_collector.py
    families = list(text_string_to_metric_families(METRICS_FILE.read_text()))
    assert {"sglang:token_usage", "sglang:spec_accept_length", "sglang:spec_num_steps", "sglang:num_running_reqs"} <= {
        f.name for f in families}
    for family in families:
        for sample in family.samples:
            d = definitions[sample.name]
            assert (family.type, family.documentation) == (d["type"], d["help"]), sample.name
            assert sorted(sample.labels) == sorted(d["labels"]), sample.name


def _string_keys(path: Path, functions: set[str]) -> set[str]:
    """Every string a function of SGLang's writes as a dict key or a subscript (`{"version": ...}`, `state["x"] =`)."""
    keys = set()
    for fn in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if fn.name in functions:
            for node in ast.walk(fn):
                if isinstance(node, ast.Dict):
                    keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
                elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.ctx, ast.Store):
                    keys.add(node.slice.value)
    return keys


def test_the_server_info_payload_has_only_fields_sglangs_code_writes():
    srt = sglang_package_dir() / "srt"
    top = (_string_keys(srt / "entrypoints" / "http_server.py", {"server_info"})
           | _string_keys(srt / "utils" / "common.py", {"build_server_info"})
           | _string_keys(srt / "managers" / "scheduler.py", {"get_init_info"}))
    per_rank = _string_keys(srt / "managers" / "scheduler_components" / "internal_state.py",
                            {"_add_topology", "_add_memory_usage", "_add_speculative"})
    memory = _string_keys(srt / "managers" / "scheduler_components" / "memory_usage.py", {"build_memory_usage"})
    info = json.loads(SERVER_INFO_FILE.read_text())
    args = _sglang_fields()  # the resolved ServerArgs both levels start from
    assert set(info) - args <= top and {"internal_states", "version"} <= top
    state = info["internal_states"][0]
    assert set(state) - args <= per_rank and {"avg_spec_accept_length", "memory_usage"} <= per_rank
    assert set(state["memory_usage"]) <= memory
    assert {"speculative_num_steps", "served_model_name"} <= args


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
