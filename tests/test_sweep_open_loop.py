"""Open-loop sweeps: trace replay past the concurrency cap, and Poisson request rates as the plan's axis, end to end
through `spectune sweep` (real processes on 127.0.0.1), the report and the tuner."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pandas as pd
import pytest
from scripted_server import ScriptedServer, Step, serve_in_thread
from sweep_helpers import sweep_cmd, write_plan

pytestmark = pytest.mark.timeout(600)


def run_sweep(tmp_path, plan: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp_path, plan)), "--out", str(tmp_path / "run"), *args),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_a_trace_over_the_cap_shows_the_queue_in_ttft_and_keeps_the_servers_own(tmp_path):
    workload = tmp_path / "burst.jsonl"  # 8 requests due at once, at most 2 in flight: 4 waves of >= 60 ms
    workload.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 3, "arrival_s": 0.0}) + "\n" for i in range(8)))
    plan = f"""
name = "burst"
workload = "{workload}"
schedule = "trace"
batch_sizes = [2]
repeats = 1
max_tokens = 3
min_prompts = 8
prompts_per_slot = 1
warmup_per_slot = 0

[[servers]]
name = "scripted"
engine = "openai"
url = "{{url}}"
"""
    with serve_in_thread(ScriptedServer(steps=(Step(0.02, 1), Step(0.02, 1), Step(0.02, 1)))) as url:
        run_sweep(tmp_path, plan.replace("{url}", url))
    cell = pd.read_parquet(tmp_path / "run" / "cells.parquet").iloc[0]
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet").sort_values("index")
    # both clocks, per request and per cell
    wave = requests["index"].to_numpy() // 2
    ttft = requests.groupby(wave)["ttft_ms"].mean()
    assert ttft.is_monotonic_increasing and ttft.iloc[-1] - ttft.iloc[0] >= 180  # each wave waits >= 60 ms more
    assert (requests.groupby(wave)["queue_delay_ms"].min().to_numpy() >= 60 * np.arange(4)).all()
    assert np.allclose(requests["ttft_ms"], requests["ttft_from_send_ms"] + requests["queue_delay_ms"])
    assert cell["ttft_ms_mean"] >= cell["ttft_from_send_ms_mean"] + 60 and cell["queue_delay_ms_mean"] >= 60
    assert cell["e2e_ms_mean"] > cell["e2e_from_send_ms_mean"] and cell["schedule"] == "trace"
    assert 1 < cell["batch_size_ran"] <= 2  # the server ran up to the cap


POISSON_PLAN = """
name = "rates"
workload = "quote"
schedule = "poisson"
request_rates = [20.0, 40.0]
burstiness = 0.5
batch_sizes = [4]
repeats = 2
max_tokens = 4
min_prompts = 6
prompts_per_slot = 1
warmup_per_slot = 0
slo_ttft_ms = 60000

[[servers]]
name = "scripted"
engine = "openai"
url = "{url}"
"""


def test_request_rates_are_the_axis_with_identical_arrivals_and_resume(tmp_path):
    with serve_in_thread(ScriptedServer(steps=(Step(0.005, 1), Step(0.005, 2)))) as url:
        run_sweep(tmp_path, POISSON_PLAN.format(url=url))
        resumed = subprocess.run(sweep_cmd("--resume", str(tmp_path / "run")), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "0 cells measured, 0 failed, 4 already done" in resumed.stdout, resumed.stdout
    root = tmp_path / "run"
    manifest = json.loads((root / "run.json").read_text())
    assert set(manifest["traffic_digests"]) == {"4@20", "4@40"}
    cells = pd.read_parquet(root / "cells.parquet")
    assert sorted(cells["cell"]) == ["scripted__bs4__rate20__r0", "scripted__bs4__rate20__r1",
                                     "scripted__bs4__rate40__r0", "scripted__bs4__rate40__r1"]
    assert (cells["status"] == "ok").all() and (cells["batch_size"] == 4).all()
    for rate, group in cells.groupby("request_rate"):
        assert set(group["traffic_digest"]) == {manifest["traffic_digests"][f"4@{rate:g}"]}
    assert (cells["goodput_rps"] == cells["request_throughput_rps"]).all()  # every request within a 60 s TTFT
    # identical traffic: every repeat at a rate sends at the same offsets (the plan's seed), the rates differ
    requests = pd.read_parquet(root / "requests.parquet")
    offsets = {c: (g.sort_values("index")["intended_ns"] - g["intended_ns"].min()).to_numpy() / 1e9
               for c, g in requests.groupby("cell")}
    assert np.array_equal(offsets["scripted__bs4__rate20__r0"], offsets["scripted__bs4__rate20__r1"])
    assert np.allclose(offsets["scripted__bs4__rate20__r0"], 2 * offsets["scripted__bs4__rate40__r0"])
    assert offsets["scripted__bs4__rate20__r0"][-1] > 0.05


ENGINE_PLAN = """
name = "engine-rates"
workload = "quote"
schedule = "poisson"
request_rates = [2.0, 6.0]
batch_sizes = [4]
repeats = 1
max_tokens = 16
min_prompts = 6
prompts_per_slot = 1
warmup_per_slot = 1

[[servers]]
name = "target"

[[servers]]
name = "ngram"
method = "ngram"
num_speculative_tokens = 2
prompt_lookup_min = 1
prompt_lookup_max = 3
"""


def test_a_rate_sweep_of_the_embedded_engine_reports_and_tunes(tmp_path, spectune_cmd):
    swept = run_sweep(tmp_path, ENGINE_PLAN)
    assert "Recommendation per request rate" in swept.stdout and "request rate (cap in flight)  method" in swept.stdout
    root = tmp_path / "run"
    cells = pd.read_parquet(root / "cells.parquet")
    assert len(cells) == 4 and (cells["status"] == "ok").all()
    # the batch size each server actually ran, from its own round log: what adaptive slots would see
    assert (cells["batch_size_ran_source"] == "round_log").all() and cells["batch_size_ran"].between(1, 4).all()
    summary = pd.read_parquet(root / "summary.parquet")
    assert sorted(summary["request_rate"]) == [2.0, 6.0]  # paired rate by rate
    # the arrivals set tok/s (every server the same), so the speedup is target-only's TPOT over the server's
    by = cells.set_index(["server", "request_rate"])
    for row in summary.itertuples():
        assert row.speedup == pytest.approx(by.loc[("target", row.request_rate), "tpot_ms_mean"]
                                            / by.loc[("ngram", row.request_rate), "tpot_ms_mean"])
    report = subprocess.run([*spectune_cmd, "report", str(root), "--out", str(tmp_path / "report")], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    assert "request_rate" in md and "| request rate (cap in flight) | use |" in md
    assert "| 2 req/s (cap 4) |" in md and "| 6 req/s (cap 4) |" in md  # one answer per rate, not one per cap
    assert "so a speedup here is target-only's mean TPOT / the server's on the same arrivals" in md
    # the answer's caption and the figure's heading say so too (they said per batch size, in output tokens/s)
    assert "Per request rate, of the static" in md and "Speedup: target-only's mean TPOT over the server's" in md
    assert "## Speedup vs request rate" in md and "output tokens/s over target-only on identical traffic" not in md
    # the gate judges each rate on its own, and speedup as the report gives it
    from spectune.gate import compare

    gate = compare(root, root)
    assert gate.exit_code == 0 and not gate.errors
    speedups = {c.place: c.current for c in gate.checks if c.rule.metric == "speedup"}
    assert set(speedups) == {"2 req/s (cap 4)", "6 req/s (cap 4)"}
    for row in summary.itertuples():
        ratio = by.loc[("target", row.request_rate), "tpot_ms_mean"] / by.loc[("ngram", row.request_rate), "tpot_ms_mean"]
        assert speedups[f"{row.request_rate:g} req/s (cap 4)"] == pytest.approx((ratio,))
    # tuned for what the answer is in: mean TPOT (tokens/s is the arrivals')
    tune = subprocess.run([*spectune_cmd, "tune", str(root), "--trials", "2"], capture_output=True, text=True, timeout=300)
    assert tune.returncode == 0, tune.stdout + tune.stderr
    assert (root / "tuned" / "adaptive_spec.json").exists() and "open loop: tuning for latency (mean TPOT" in tune.stdout
    assert json.loads((root / "tuned" / "tuning.json").read_text())["objective"] == "latency"
    # confirm measures both rates each pass (their arrivals differ: it once refused them as 'different traffic') in TPOT
    confirm = subprocess.run([*spectune_cmd, "confirm", str(root), "--max-passes", "2", "--min-passes", "2"],
                             capture_output=True, text=True, timeout=600)
    assert confirm.returncode == 0, confirm.stdout + confirm.stderr
    verdict = json.loads((root / "tuned" / "tuning.json").read_text())["verdict"]
    assert verdict["metric"] == "tpot_ms_mean" and "mean TPOT" in verdict["text"], verdict
    passes = sorted((root / "confirm").glob("pass-*"))
    assert passes and all(sorted(set(pd.read_parquet(p / "cells.parquet")["request_rate"])) == [2.0, 6.0] for p in passes)


def test_tune_counts_an_open_loop_cell_at_what_its_server_decoded_not_the_arrivals_rate(tmp_path):
    """Cells edited by hand to an open loop's state: the server ran 2 sequences at 5 ms a token, between arrivals
    that asked for 100 tokens/s in all; what it can decode there is 2 x 200 tokens/s."""
    from spectune.tune import load_results
    from synthetic_sweep import write_synthetic_results

    root = write_synthetic_results(tmp_path / "run")
    manifest = json.loads((root / "run.json").read_text())
    manifest["plan"]["schedule"] = "poisson"
    (root / "run.json").write_text(json.dumps(manifest))
    for p in (root / "cells").glob("*.json"):
        cell = json.loads(p.read_text())
        p.write_text(json.dumps(cell | {"schedule": "poisson", "request_rate": 2.0, "batch_size_ran": 2.2,
                                        "tpot_ms_mean": 5.0, "output_throughput_tps": 100.0}))
    (root / "cells.parquet").unlink()
    cells = load_results(root).cells
    assert (cells["batch_size"] == 2).all() and np.allclose(cells["output_throughput_tps"], 400.0)
    assert (cells["output_throughput_tps_measured"] == 100.0).all() and (cells["batch_size_cap"] > 0).all()
