"""`spectune bench` against an already-running server writes the same files as a sweep."""

import json
import subprocess

import pandas as pd

from spectune.servers import make_server
from spectune.servers.base import ServerSpec


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
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "complete" and manifest["plan"]["servers"][0]["url"] == engine.base_url
    cells = pd.read_parquet(out / "cells.parquet")
    assert len(cells) == 1 and cells.loc[0, "status"] == "ok" and cells.loc[0, "batch_size"] == 2
    for metric in ("ttft_ms", "icl_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert cells.loc[0, f"{metric}_{stat}"] > 0
    assert cells.loc[0, "output_throughput_tps"] > 0 and cells.loc[0, "num_requests"] == 6
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 6 and (requests["output_tokens"] == 10).all()
