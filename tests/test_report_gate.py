"""Reports (HTML + Markdown, escaped) and the CI gate, on a real embedded-engine sweep."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from sweep_helpers import sweep_cmd, write_plan

PLAN = """
name = "rep"
workload = "{workload}"
batch_sizes = [1, 2]
repeats = 2
max_tokens = 8
min_prompts = 3
prompts_per_slot = 1
warmup_per_slot = 0

[[servers]]
name = "target"

[[servers]]
name = "ngram"
method = "ngram"
num_speculative_tokens = 2
prompt_lookup_min = 1
prompt_lookup_max = 3
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rep")
    workload = tmp / "xss.jsonl"
    prompts = ["<script>alert(1)</script> Repeat: a b c a b c", "plain | pipe text", "third prompt here"]
    workload.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp / "run"
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp, PLAN.format(workload=workload))), "--out", str(out)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_report_has_tables_plots_definitions_and_escapes_prompts(run, tmp_path, spectune_cmd):
    proc = subprocess.run([*spectune_cmd, "report", str(run), "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "r" / "report.html").read_text()
    md = (tmp_path / "r" / "report.md").read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown, not run
    assert "<script>" not in md and "&lt;script&gt;" in md
    for text in (page, md):
        assert "Speedup vs target-only" in text and "tpot_ms" in text and "inter-chunk latency" in text
    assert page.count("data:image/png;base64") == 3
    assert (tmp_path / "r" / "speedup.png").stat().st_size > 1000


def test_gate_passes_against_itself_and_fails_on_an_injected_regression(run, tmp_path, spectune_cmd):
    same = subprocess.run([*spectune_cmd, "gate", str(run), "--baseline", str(run), "--junit", str(tmp_path / "ok.xml")],
                          capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "PASS" in same.stdout
    assert 'failures="0"' in (tmp_path / "ok.xml").read_text()
    # Inject a regression: a copy of the run with one server's throughput halved (a real run cannot be made slower on demand).
    slow = tmp_path / "slow"
    shutil.copytree(run, slow)
    for cell in (slow / "cells").glob("ngram__*.json"):
        row = json.loads(cell.read_text())
        row["output_throughput_tps"] *= 0.5
        cell.write_text(json.dumps(row))
    bad = subprocess.run([*spectune_cmd, "gate", str(slow), "--baseline", str(run), "--max-regression", "0.2",
                          "--junit", str(tmp_path / "bad.xml")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "REGRESSION" in bad.stdout and "FAIL" in bad.stdout
    assert bad.stdout.count("REGRESSION") == 2  # both ngram batch sizes, not the target
    assert 'failures="2"' in (tmp_path / "bad.xml").read_text()


def test_gate_on_a_directory_with_no_run_is_a_clear_error(tmp_path, run, spectune_cmd):
    proc = subprocess.run([*spectune_cmd, "gate", str(tmp_path), "--baseline", str(run)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "run.json" in proc.stderr
