"""SGLang 0.5.23's /metrics and /server_info bodies, derived from its released server code (SGLang does not serve
on CPU, so no server can be recorded here). Run it to rewrite tests/data/sglang_0.5.23_*:

    python tests/sglang_payloads.py

Where each shape comes from (paths under the unpacked wheel's `sglang/`):
- /metrics: `srt/utils/common.py` add_prometheus_middleware serves prometheus_client's multiprocess exposition
  (MultiProcessCollector: no `_created` samples, label names sorted). Each family's name, type, help text and
  label names are read here, with `ast`, from `srt/observability/metrics_collector.py`:
  SchedulerMetricsCollector.__init__ (gauges; labels: the dict SchedulerMetricsCollectorContext builds, model_name,
  engine_type, tp_rank, pp_rank, moe_ep_rank) and TokenizerMetricsCollector.__init__ (counters; labels:
  tokenizer_metric_labels(), model_name and engine_type, plus the family's own). Only the values are chosen.
- /server_info: `srt/entrypoints/http_server.py` server_info(): build_server_info (`srt/utils/common.py`: the
  resolved ServerArgs, launch_command, the scheduler's handshake info from Scheduler.get_init_info, kv_events) plus
  startup_time, internal_states, version, frontend. internal_states holds one dict per DP rank from
  `srt/managers/scheduler_components/internal_state.py` SchedulerInternalStateController.get_internal_state: the
  resolved ServerArgs with runtime overrides (the adaptive worker's live speculative_num_steps, published by
  `srt/speculative/eagle_worker_v2.py` apply_runtime_state), _add_topology, _add_memory_usage (build_memory_usage in
  `memory_usage.py`) and _add_speculative (avg_spec_accept_length: accepted tokens / forward passes, bonus included).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
METRICS_FILE = DATA / "sglang_0.5.23_metrics.txt"
SERVER_INFO_FILE = DATA / "sglang_0.5.23_server_info.json"
SERVED = "eagle-adaptive"

# (family, labels beyond the collector's own, value): what a server at launch step 3 that adapted down to 1 shows
METRIC_VALUES = [
    ("sglang:num_running_reqs", {}, 12.0),
    ("sglang:token_usage", {}, 0.0412),
    ("sglang:spec_accept_length", {}, 2.61),
    ("sglang:spec_accept_rate", {}, 0.5367),
    ("sglang:spec_num_steps", {}, 1.0),
    ("sglang:spec_num_draft_tokens", {}, 2.0),
    ("sglang:generation_tokens_total", {"is_streaming": "true"}, 3140.0),
    ("sglang:spec_verify_calls_total", {}, 1288.0),
]
SCHEDULER_LABELS = {"model_name": SERVED, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


def collector_source(package: Path) -> Path:
    return package / "srt" / "observability" / "metrics_collector.py"


def metric_definitions(package: Path) -> dict[str, dict]:
    """Every Gauge/Counter SGLang's scheduler and tokenizer collectors declare: name -> type, help, label names."""
    tree = ast.parse(collector_source(package).read_text())
    own = {"SchedulerMetricsCollector": _dict_keys(tree, {"engine_type", "tp_rank"}),
           "TokenizerMetricsCollector": _dict_keys(tree, {"engine_type"}, "tokenizer_metric_labels")}
    found = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in own):
        for call in (n for n in ast.walk(cls) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            if call.func.id not in ("Gauge", "Counter"):
                continue
            kw = {k.arg: k.value for k in call.keywords}
            if not isinstance(kw.get("name"), ast.Constant) or not isinstance(kw.get("documentation"), ast.Constant):
                continue  # names or help built at run time: not the families spectune reads
            extra = [e.value for e in ast.walk(kw["labelnames"]) if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            found[kw["name"].value] = {"type": call.func.id.lower(), "help": kw["documentation"].value,
                                       "labels": [*own[cls.name], *extra]}
    return found


def _dict_keys(tree: ast.Module, keys: set[str], function: str | None = None) -> list[str]:
    """The keys of the first dict literal holding all `keys` (inside `function` when given): a collector's labels."""
    scope = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function) if function else tree
    for node in ast.walk(scope):
        if isinstance(node, ast.Dict):
            found = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if keys <= set(found):
                return found
    raise LookupError(f"no label dict with {sorted(keys)} in {function or 'the module'}")


def render_metrics(package: Path) -> str:
    """The /metrics text: SGLang's definitions, these values, prometheus_client's multiprocess exposition (in a fresh
    process: prometheus_client picks its multiprocess value store when first imported)."""
    definitions = metric_definitions(package)
    with tempfile.TemporaryDirectory() as directory:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # read by prometheus_client's value class at import
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
        for name, extra, value in METRIC_VALUES:
            d = definitions[name]
            labels = {**SCHEDULER_LABELS, **extra}
            labels = {k: labels.get(k, "") for k in d["labels"]}
            if d["type"] == "gauge":
                Gauge(name, d["help"], labelnames=d["labels"], multiprocess_mode="mostrecent", registry=None).labels(**labels).set(value)
            else:
                Counter(name, d["help"], labelnames=d["labels"], registry=None).labels(**labels).inc(value)
        text = generate_latest(registry).decode()
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    return text


def server_info() -> dict:
    """A /server_info body (trimmed to the fields spectune reads and the ones that give its structure)."""
    launch_args = {
        "model_path": "/models/target", "served_model_name": SERVED, "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": "/models/eagle-draft", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4, "speculative_adaptive": True,
        "speculative_adaptive_config": "/configs/adaptive_spec.json", "enable_metrics": True,
    }  # fmt: skip
    live = {**launch_args, "speculative_num_steps": 1, "speculative_num_draft_tokens": 2}  # adapted down to 1 step
    return {
        **launch_args,
        "launch_command": "python -m sglang.launch_server --model-path /models/target --speculative-adaptive ...",
        "status": "ready", "max_total_num_tokens": 431072, "max_req_input_len": 8186, "startup_time": 41.7,
        "kv_events": None,
        "internal_states": [{
            **live,
            "world_size": 1, "startup_time": 41.7, "effective_max_running_requests_per_dp": 48, "last_gen_throughput": 812.4,
            "memory_usage": {"weight": 15.2, "kvcache": 52.9, "startup_available": 79.1, "token_capacity": 431072,
                             "token_capacity_swa": None, "graph": {"decode": 0.8, "target_verify": 0.2, "draft_decode": 0.1}},
            "avg_spec_accept_length": 2.4375,
        }],
        "version": "0.5.23",
        "frontend": "python",
    }  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sglang_compat import sglang_package_dir

    METRICS_FILE.write_text(render_metrics(sglang_package_dir()))
    SERVER_INFO_FILE.write_text(json.dumps(server_info(), indent=2) + "\n")
    print(f"wrote {METRICS_FILE} and {SERVER_INFO_FILE}")
