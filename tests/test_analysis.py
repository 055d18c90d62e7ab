"""Metric definitions on hand-built records, acceptance from scrapes, and the speedup table."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from spectune.analysis import (
    Slo,
    acceptance,
    chunk_gaps,
    recommendation_table,
    request_frame,
    speedup_table,
    summarize_cell,
    t_quantile_975,
)
from spectune.errors import SpectuneError
from spectune.records import RequestRecord, Scrape

MS = 1_000_000


def record(index: int, send_ms: float, chunks: list[tuple[float, int]], *, end_ms: float | None = None, **kwargs):
    """A record whose chunks arrive at the given (ms, tokens); usage total = the sum of tokens."""
    return RequestRecord(
        index=index,
        send_ns=int(send_ms * MS),
        chunk_ns=[int(t * MS) for t, _ in chunks],
        chunk_tokens=[k for _, k in chunks],
        end_ns=int((end_ms if end_ms is not None else chunks[-1][0] + 1) * MS),
        output_tokens=kwargs.pop("output_tokens", sum(k for _, k in chunks)),
        token_source="usage",
        **kwargs,
    )


def test_definitions_on_one_request():
    # send at 0; chunks at 50 ms (2 tokens), 80 ms (3), 100 ms (1)
    r = record(0, 0, [(50, 2), (80, 3), (100, 1)], end_ms=102)
    row = request_frame([r]).iloc[0]
    assert row["ttft_ms"] == pytest.approx(50)
    assert row["e2e_ms"] == pytest.approx(100)  # last token chunk, not stream end
    assert row["tpot_ms"] == pytest.approx((100 - 50) / (6 - 1))
    assert row["tokens_per_chunk"] == pytest.approx(2.0)
    assert row["num_chunks"] == 3 and row["output_tokens"] == 6
    icl, itl = chunk_gaps([r])
    assert icl == pytest.approx([30, 20])
    assert itl == pytest.approx([10, 10, 10, 20])  # 30 ms over 3 tokens, then 20 ms over 1
    summary = summarize_cell([r])
    assert summary["duration_s"] == pytest.approx(0.102)
    assert summary["output_throughput_tps"] == pytest.approx(6 / 0.102)
    assert summary["request_throughput_rps"] == pytest.approx(1 / 0.102)
    assert summary["itl_ms_p50"] == pytest.approx(10)


def test_single_token_request_has_no_tpot():
    row = request_frame([record(0, 0, [(40, 1)])]).iloc[0]
    assert math.isnan(row["tpot_ms"]) and row["ttft_ms"] == pytest.approx(40)


def test_pooling_failures_and_warmup():
    good_a = record(0, 0, [(10, 1), (20, 1), (30, 1)])  # icl 10, 10
    good_b = record(1, 5, [(25, 2), (65, 4)])  # icl 40; itl 10 x4
    failed = record(2, 0, [(500, 1)], error="http 503: busy", end_ms=900)
    warm = record(0, -1000, [(-900, 1), (-100, 1)], warmup=True)
    records = [warm, good_a, good_b, failed]
    summary = summarize_cell(records)
    assert summary["num_requests"] == 3 and summary["num_failed"] == 1
    assert summary["failure_rate"] == pytest.approx(1 / 3)
    assert summary["icl_ms_mean"] == pytest.approx(np.mean([10, 10, 40]))  # pooled over gaps
    assert summary["itl_ms_mean"] == pytest.approx(np.mean([10, 10, 10, 10, 10, 10]))
    assert summary["ttft_ms_mean"] == pytest.approx(np.mean([10, 20]))  # one per successful request
    assert summary["ttft_ms_p99"] == pytest.approx(np.percentile([10, 20], 99))
    assert summary["output_tokens_total"] == 3 + 6
    # window: first send (0) -> last end (the failed request, 900 ms); warm-up outside it
    assert summary["duration_s"] == pytest.approx(0.9)
    assert summary["request_throughput_rps"] == pytest.approx(2 / 0.9)
    assert list(request_frame(records)["index"]) == [0, 1, 2]


def test_goodput_counts_requests_meeting_every_limit():
    fast = record(0, 0, [(10, 1), (20, 1)])  # ttft 10, tpot 10, e2e 20
    slow_start = record(1, 0, [(80, 1), (90, 1)])  # ttft 80
    one_token = record(2, 0, [(15, 1)], end_ms=100)  # no tpot
    records = [fast, slow_start, one_token]
    assert summarize_cell(records, Slo(ttft_ms=50, tpot_ms=15))["goodput_rps"] == pytest.approx(2 / 0.1)
    assert summarize_cell(records, Slo(e2e_ms=18))["goodput_rps"] == pytest.approx(1 / 0.1)
    assert "goodput_rps" not in summarize_cell(records)


def test_empty_and_all_failed_cells_give_nan_latencies():
    failed = record(0, 0, [(5, 1)], error="timeout")
    summary = summarize_cell([failed])
    assert summary["num_failed"] == 1 and summary["failure_rate"] == 1.0
    assert math.isnan(summary["ttft_ms_mean"]) and summary["output_throughput_tps"] == 0.0
    empty = summarize_cell([])
    assert empty["num_requests"] == 0 and math.isnan(empty["duration_s"])


def test_token_mismatch_is_flagged_not_scaled():
    r = record(0, 0, [(10, 1), (20, 1)], output_tokens=5)
    row = request_frame([r]).iloc[0]
    assert row["output_tokens"] == 5 and row["counted_tokens"] == 2 and row["token_mismatch"]
    assert row["tpot_ms"] == pytest.approx(10 / 4)


def test_acceptance_from_vllm_counters():
    before = Scrape(num_drafts=10, num_draft_tokens=40, num_accepted_tokens=20, accepted_per_pos=(8, 6, 4, 2))
    after = Scrape(num_drafts=110, num_draft_tokens=440, num_accepted_tokens=220, accepted_per_pos=(88, 66, 44, 22))
    a = acceptance(before, after)
    assert a.rate == pytest.approx(200 / 400)
    assert a.mean_length == pytest.approx(1 + 200 / 100)
    assert a.per_pos == pytest.approx((0.8, 0.6, 0.4, 0.2))
    assert not a.is_lifetime


def test_acceptance_sglang_fallback_and_idle_window():
    a = acceptance(Scrape(avg_accept_length=2.0), Scrape(avg_accept_length=2.5, num_steps=3))
    assert a.mean_length == 2.5 and a.is_lifetime and a.rate is None
    same = Scrape(num_drafts=5, num_draft_tokens=20, num_accepted_tokens=9)
    idle = acceptance(same, same)
    assert idle.rate is None and idle.mean_length is None
    assert acceptance(Scrape(), Scrape()).mean_length is None


def cell(server: str, g: int | None, batch_size: int, repeat: int, tps: float, tpot: float, status: str = "ok") -> dict:
    return dict(
        server=server, is_speculative=g is not None, num_speculative_tokens=g, batch_size=batch_size, repeat=repeat,
        status=status, output_throughput_tps=tps, tpot_ms_mean=tpot,
    )


def cells_frame() -> pd.DataFrame:
    rows = []
    target_tps = {1: [100.0, 110.0, 90.0], 8: [400.0, 420.0, 380.0]}
    spec_ratio = {1: [1.5, 1.6, 1.4], 8: [0.9, 1.0, 0.8]}
    for bs in (1, 8):
        for rep in range(3):
            t, ratio = target_tps[bs][rep], spec_ratio[bs][rep]
            rows.append(cell("target", None, bs, rep, t, 20.0))
            rows.append(cell("draft-g4", 4, bs, rep, t * ratio, 20.0 / ratio))
    rows.append(cell("draft-g4", 4, 8, 3, 1e9, 0.001, status="failed"))
    rows.append(cell("ngram-g3", 3, 1, 0, 120.0, 16.0))
    rows.append(cell("ngram-g3", 3, 32, 0, 1.0, 1.0))  # no target-only cell at batch size 32
    return pd.DataFrame(rows)


def test_speedup_table_pairs_repeats_with_target_only_at_the_same_batch_size():
    table = speedup_table(cells_frame()).set_index(["server", "batch_size"])
    for bs, ratios in {1: [1.5, 1.6, 1.4], 8: [0.9, 1.0, 0.8]}.items():
        row = table.loc[("draft-g4", bs)]
        logs = np.log(ratios)
        half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
        assert row["num_repeats"] == 3  # the failed repeat 3 does not count
        assert row["speedup"] == pytest.approx(np.exp(logs.mean()))
        assert row["speedup_ci_low"] == pytest.approx(np.exp(logs.mean() - half), rel=1e-4)
        assert row["speedup_ci_high"] == pytest.approx(np.exp(logs.mean() + half), rel=1e-4)
        assert row["tpot_speedup"] == pytest.approx(np.exp(logs.mean()))
    one = table.loc[("ngram-g3", 1)]
    assert one["speedup"] == pytest.approx(120.0 / 100.0) and one["tpot_speedup"] == pytest.approx(20.0 / 16.0)
    assert math.isnan(one["speedup_ci_low"]) and math.isnan(one["speedup_ci_high"])  # one repeat: no interval
    no_target = table.loc[("ngram-g3", 32)]
    assert no_target["num_repeats"] == 0 and math.isnan(no_target["speedup"])
    assert table.loc[("draft-g4", 8), "speedup_ci_low"] < 1 < table.loc[("draft-g4", 1), "speedup_ci_low"]


def test_speedup_table_needs_one_baseline():
    cells = cells_frame()
    second = cells[cells["server"] == "target"].assign(server="target-b")
    both = pd.concat([cells, second])
    with pytest.raises(SpectuneError, match="name one as baseline"):
        speedup_table(both)
    assert len(speedup_table(both, baseline="target-b")) == 4
    with pytest.raises(SpectuneError, match="missing column"):
        speedup_table(cells.drop(columns=["repeat"]))


def test_a_run_with_two_target_only_servers_finalizes_against_the_plans_first(tmp_path):
    # A sweep whose plan lists two target-only servers used to measure every cell and then fail in finalize
    # ("name one as baseline"); the plan's first is its baseline.
    from spectune.store import RunStore, load_run
    from spectune.summary import build_summary

    cells = cells_frame().assign(method=lambda f: f["server"].str.split("-").str[0].where(f["is_speculative"]),
                                 failure_rate=0.0, acceptance_rate=0.6, acceptance_length=2.5, adaptive_config=None)
    slow = cells[cells["server"] == "target"].assign(server="target-b", output_throughput_tps=lambda f: f["output_throughput_tps"] / 2)
    servers = [{"name": "target-b"}, {"name": "target"}, {"name": "draft-g4", "method": "draft_model"}, {"name": "ngram-g3", "method": "ngram"}]
    store = RunStore.create(tmp_path / "run", {"name": "run", "plan": {"servers": servers}})
    for row in pd.concat([cells, slow]).to_dict("records"):
        store.write_cell(row, None)
    store.finalize()
    summary = pd.read_parquet(tmp_path / "run" / "summary.parquet").set_index(["server", "batch_size"])
    assert summary.loc[("ngram-g3", 1), "speedup"] == pytest.approx(120.0 / 50.0)  # over target-b, listed first
    assert len(load_run(tmp_path / "run").cells) == len(cells) + len(slow)
    # the closing table of `spectune sweep` compares with the same baseline: at batch 8 draft-g4 is 0.9x target but
    # 1.8x target-b
    rows = {r[0]: r for r in build_summary(tmp_path / "run").rows}
    assert rows["8"][1] == "draft" and rows["8"][3] == f"{2 * np.exp(np.log([0.9, 1.0, 0.8]).mean()):.2f}x"


def test_recommendation_picks_the_fastest_server_per_batch_size_and_target_only_where_none_pays():
    cells = cells_frame().assign(method=lambda f: f["server"].str.split("-").str[0].where(f["is_speculative"]),
                                 failure_rate=0.0, acceptance_rate=0.6, acceptance_length=2.5, adaptive_config=None)
    rec = recommendation_table(cells).set_index("batch_size")
    assert list(rec.index) == [1, 8]  # 32 has no target-only cell to compare with
    small = rec.loc[1]
    assert small["server"] == "draft-g4" and small["method"] == "draft" and small["steps"] == 4
    assert small["speedup"] == pytest.approx(np.exp(np.log([1.5, 1.6, 1.4]).mean()))  # beats ngram-g3's 1.2
    assert small["speedup_ci_low"] > 1 and small["is_clear"]
    large = rec.loc[8]  # draft-g4 measured 0.9x there: target-only is the answer, not clearly (its CI spans 1)
    assert large["method"] == "target-only" and large["steps"] == 0 and large["speedup"] == 1.0
    assert not large["is_clear"] and large["compared"] and small["compared"]
    no_spec_at_8 = recommendation_table(cells[~(cells["is_speculative"] & (cells["batch_size"] == 8))]).set_index("batch_size")
    assert no_spec_at_8.loc[8, "method"] == "target-only" and not no_spec_at_8.loc[8, "compared"]  # nothing to compare with
    adaptive = cells.assign(adaptive_config=np.where(cells["server"] == "draft-g4", "a.json", None))
    assert recommendation_table(adaptive).set_index("batch_size").loc[1, "server"] == "ngram-g3"


def test_t_quantile_matches_scipy():
    for df in range(1, 300):
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-4)
