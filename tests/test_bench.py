"""`spectune bench` against an already-running server writes the same files as a sweep."""

import json
import math
import subprocess
from pathlib import Path

import pandas as pd
from scripted_server import ScriptedServer, Step, serve_in_thread
from tokenizers import Tokenizer

import spectune
from spectune.servers import make_server
from spectune.servers.base import ServerSpec, free_port

SHIPPED_TOKENIZER = Path(spectune.__file__).parent / "engine" / "assets" / "target"


def test_bench_one_cell_against_a_running_engine(tmp_path, spectune_cmd):
    engine = make_server(ServerSpec(name="engine", method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                                    prompt_lookup_max=3), tmp_path / "logs")
    engine.start()
    try:
        out = tmp_path / "bench"
        proc = subprocess.run([*spectune_cmd, "bench", "--url", engine.base_url, "--concurrency", "2", "--num-prompts", "6",
                               "--max-tokens", "10", "--workload", "quote", "--out", str(out)], capture_output=True, text=True, timeout=300)
    finally:
        engine.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"attaching to openai server at {engine.base_url}" in proc.stdout and "starting" not in proc.stdout
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "complete" and manifest["plan"]["servers"][0]["url"] == engine.base_url
    assert manifest["engines"]["server"]["exposes"] == ["/metrics (vllm:)", "/server_info (sglang)"]  # what it found
    cells = pd.read_parquet(out / "cells.parquet")
    assert len(cells) == 1 and cells.loc[0, "status"] == "ok" and cells.loc[0, "batch_size"] == 2
    for metric in ("ttft_ms", "icl_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert cells.loc[0, f"{metric}_{stat}"] > 0
    assert cells.loc[0, "output_throughput_tps"] > 0 and cells.loc[0, "num_requests"] == 6
    # acceptance from the attached server's own spec_decode counters (n-gram lookup on quotes accepts some drafts)
    assert 0 < cells.loc[0, "acceptance_rate"] <= 1 and cells.loc[0, "acceptance_length"] > 1
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 6 and (requests["output_tokens"] == 10).all()


def test_a_sweep_refuses_an_attached_server_that_speculates_as_target_only_and_keeps_the_rest(tmp_path, spectune_cmd):
    """Attached with engine "openai" (no method), a speculating server would be counted as target-only and every speedup
    against it would be wrong: its first cell fails naming the counters and the fix, its other cells are not measured,
    the real target-only server's cells are kept."""
    engine = make_server(ServerSpec(name="engine", method="eagle", num_speculative_tokens=2), tmp_path / "logs")
    plan = tmp_path / "plan.toml"
    plan.write_text('name = "attached"\nworkload = "code"\nbatch_sizes = [1, 2]\nrepeats = 1\nmax_tokens = 8\n'
                    'min_prompts = 2\nprompts_per_slot = 1\n[[servers]]\nname = "target"\n'
                    f'[[servers]]\nname = "spec"\nengine = "openai"\nurl = "{{url}}"\n')
    engine.start()
    try:
        plan.write_text(plan.read_text().replace("{url}", engine.base_url))
        out = tmp_path / "run"
        proc = subprocess.run([*spectune_cmd, "sweep", str(plan), "--out", str(out), "--no-tune", "--no-report"],
                              capture_output=True, text=True, timeout=600)
    finally:
        engine.stop()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("[spec] server 'spec' speculates" in proc.stdout and "2.0 draft tokens a round" in proc.stdout
            and "num_speculative_tokens = 2" in proc.stdout), proc.stdout
    cells = {c["cell"]: c for c in map(json.loads, map(Path.read_text, (out / "cells").glob("*.json")))}
    assert cells["target__bs1__r0"]["status"] == cells["target__bs2__r0"]["status"] == "ok"
    assert cells["spec__bs1__r0"]["status"] == "failed" and cells["spec__bs1__r0"]["num_drafts"] > 0
    assert cells["spec__bs2__r0"]["status"] == "failed" and "has no `method`" in cells["spec__bs2__r0"]["error"]
    assert not (out / "requests" / "spec__bs2__r0.parquet").exists()  # not measured: it would speculate there too


def test_bench_against_nothing_exits_1_with_the_cause(tmp_path, spectune_cmd):
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "bench"
    proc = subprocess.run([*spectune_cmd, "bench", "--url", url, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "could not attach" in proc.stdout and "is the server running" in proc.stdout
    assert "the cell failed" in proc.stderr
    [cell] = [json.loads(p.read_text()) for p in (out / "cells").glob("*.json")]
    assert cell["status"] == "failed" and "could not attach" in cell["error"]


def _bench_k_tokens(tmp_path, spectune_cmd, *extra: str) -> tuple[pd.Series, pd.DataFrame, ScriptedServer]:
    """bench against a server streaming 3 tokens per chunk with only a final usage total."""
    server = ScriptedServer(steps=tuple(Step(0.02, 3) for _ in range(6)), counting="final_only",
                            tokenizer=Tokenizer.from_file(str(SHIPPED_TOKENIZER / "tokenizer.json")))
    out = tmp_path / "bench"
    with serve_in_thread(server) as url:
        proc = subprocess.run([*spectune_cmd, "bench", "--url", url, "--concurrency", "2", "--num-prompts", "4",
                               "--max-tokens", "18", "--out", str(out), *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = pd.read_parquet(out / "cells.parquet")
    return cells.iloc[0], pd.read_parquet(out / "requests.parquet"), server


def test_bench_counts_tokens_per_chunk_with_the_models_tokenizer_and_scores_goodput(tmp_path, spectune_cmd):
    cell, requests, _ = _bench_k_tokens(tmp_path, spectune_cmd, "--tokenizer", str(SHIPPED_TOKENIZER),
                                        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "0.001")
    assert set(requests["token_source"]) == {"tokenizer"} and not requests["per_token_unknown"].any()
    assert all(list(t) == [3] * 6 for t in requests["chunk_tokens"])
    assert cell["per_token_unknown"] == 0 and cell["itl_ms_mean"] < cell["icl_ms_mean"] / 2
    assert cell["goodput_rps"] == 0  # no request makes a 0.001 ms TPOT
    assert cell["tokens_per_chunk_mean"] == 3


def test_bench_without_a_tokenizer_says_per_token_latency_is_unknown(tmp_path, spectune_cmd):
    cell, requests, _ = _bench_k_tokens(tmp_path, spectune_cmd, "--slo-ttft-ms", "60000")
    assert set(requests["token_source"]) == {"unknown"} and requests["per_token_unknown"].all()
    assert cell["per_token_unknown"] == 4 and math.isnan(cell["itl_ms_mean"]) and cell["icl_ms_mean"] > 0
    assert cell["goodput_rps"] == cell["request_throughput_rps"] > 0  # every request meets a 60 s TTFT
    assert cell["tokens_per_chunk_mean"] == 3  # from the total: still right


def test_bench_open_loop_at_a_request_rate(tmp_path, spectune_cmd):
    cell, requests, server = _bench_k_tokens(tmp_path, spectune_cmd, "--request-rate", "50", "--tokenizer", str(SHIPPED_TOKENIZER))
    assert cell["request_rate"] == 50 and cell["schedule"] == "poisson" and cell["cell"] == "server__bs2__rate50__r0"
    assert cell["batch_size"] == 2 and 0 < cell["batch_size_ran"] <= 2 and cell["batch_size_ran_source"] == "client"
    manifest = json.loads((tmp_path / "bench" / "run.json").read_text())
    assert set(manifest["traffic_digests"]) == {"2@50"}
    assert (requests["queue_delay_ms"] >= 0).all() and (requests["intended_ns"] <= requests["send_ns"]).all()
