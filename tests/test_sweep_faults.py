"""Sweeps that survive: real processes on 127.0.0.1, faults injected, nothing measured lost.

Fault counts from these tests are summed in the README's fault table.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess

import pandas as pd
import pytest

from fault_proxy import FaultProxy
from spectune.report.data import collect
from spectune.report.render import header_items
from sweep_helpers import finished_cells, server_processes, sweep_cmd, wait_for, write_plan

LONG_PLAN = """
name = "long"
workload = "quote"
batch_sizes = [1, 2]
repeats = 2
max_tokens = 24
prompts_per_slot = 3
min_prompts = 6
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


def _cells_frame(root) -> pd.DataFrame:
    return pd.DataFrame(finished_cells(root).values()).set_index("cell").sort_index()


def _comparable(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[["server", "batch_size", "repeat", "status", "traffic_digest", "num_requests", "output_tokens_total"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("baseline")
    out = tmp / "run"
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp, LONG_PLAN)), "--out", str(out)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.parametrize("kill_after_cells", [1, 4, 6])
def test_sigkill_at_a_cell_boundary_then_resume_equals_uninterrupted(tmp_path, uninterrupted, kill_after_cells):
    out = tmp_path / "run"
    proc = subprocess.Popen(sweep_cmd(str(write_plan(tmp_path, LONG_PLAN)), "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: len(finished_cells(out)) >= kill_after_cells if (out / "cells").exists() else False, 300, "cells written", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # The directory loads as it is, every finished cell intact.
    from spectune.store import load_run

    partial = load_run(out)
    assert len(partial.cells) >= kill_after_cells and set(partial.cells["status"]) <= {"ok"}
    wait_for(lambda: not server_processes(out), 30, "the orphaned engine to die with its parent")

    resumed = subprocess.run(sweep_cmd("--resume", str(out)), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "already done" in resumed.stdout
    pd.testing.assert_frame_equal(_comparable(_cells_frame(out)), _comparable(_cells_frame(uninterrupted)))
    assert json.loads((out / "run.json").read_text())["traffic_digests"] == json.loads((uninterrupted / "run.json").read_text())["traffic_digests"]


def test_sigkill_at_a_random_moment_then_resume_equals_uninterrupted(tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = subprocess.Popen(sweep_cmd(str(write_plan(tmp_path, LONG_PLAN)), "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (out / "run.json").exists(), 120, "run started", proc)
    delay = random.Random(os.getpid()).uniform(0.5, 8.0)  # the fault's timing, not synchronisation
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    resumed = subprocess.run(sweep_cmd("--resume", str(out)), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    pd.testing.assert_frame_equal(_comparable(_cells_frame(out)), _comparable(_cells_frame(uninterrupted)))


def test_sigint_stops_cleanly_marks_partial_and_says_how_to_resume(tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = subprocess.Popen(sweep_cmd(str(write_plan(tmp_path, LONG_PLAN)), "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: len(finished_cells(out)) >= 2 if (out / "cells").exists() else False, 300, "two cells", proc)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert f"spectune sweep --resume {out}" in output
    assert not server_processes(out)  # stopped on the way out, not orphaned
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "interrupted"
    statuses = {c["status"] for c in finished_cells(out).values()}
    assert statuses <= {"ok", "partial"}
    resumed = subprocess.run(sweep_cmd("--resume", str(out)), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    pd.testing.assert_frame_equal(_comparable(_cells_frame(out)), _comparable(_cells_frame(uninterrupted)))


def test_resume_refuses_a_changed_plan(tmp_path, uninterrupted, spectune_cmd):
    changed = write_plan(tmp_path, LONG_PLAN.replace("max_tokens = 24", "max_tokens = 25"))
    proc = subprocess.run(sweep_cmd(str(changed), "--resume", str(uninterrupted)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "plan changed" in proc.stderr and "run.json" in proc.stderr


def test_resume_with_more_repeats_measures_only_them_on_fresh_launches(tmp_path, uninterrupted):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    proc = subprocess.run(sweep_cmd("--resume", str(out), "--repeats", "3"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = _cells_frame(out)
    before = _cells_frame(uninterrupted)
    pd.testing.assert_frame_equal(cells.loc[before.index], before)  # what was measured is kept as it was
    added = cells.drop(index=before.index)
    assert sorted(zip(added["server"], added["batch_size"], added["repeat"])) == [
        (s, bs, 2) for s in ("ngram", "target") for bs in (1, 2)]
    assert (added["status"] == "ok").all()
    assert set(added["server_pid"]).isdisjoint(before["server_pid"])  # the new repeats ran on new launches
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["plan"]["repeats"] == 3 and manifest["progress"]["total"] == 12
    assert [(a["from"], a["to"]) for a in manifest["repeats_added"]] == [(2, 3)]
    header = dict(header_items(collect(out)))  # the report says the run grew and that its time spans the pause
    assert header["repeats"] == "3 (2 at the start, more added on resume)"
    assert header["measured"].endswith("from start to end, resumed 1x")

    fewer = subprocess.run(sweep_cmd("--resume", str(out), "--repeats", "2"), capture_output=True, text=True, timeout=120)
    assert fewer.returncode == 2
    assert "repeats = 2 is fewer than the 3" in fewer.stderr and "run.json" in fewer.stderr
    pd.testing.assert_frame_equal(_cells_frame(out), cells)


def test_server_sigkilled_mid_sweep_fails_one_cell_and_the_sweep_goes_on(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(sweep_cmd(str(write_plan(tmp_path, LONG_PLAN)), "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: len(finished_cells(out)) >= 1 if (out / "cells").exists() else False, 300, "first cell", proc)
    victims = wait_for(lambda: server_processes(out), 60, "the engine process", proc)
    for v in victims:
        v.send_signal(signal.SIGKILL)
    output, _ = proc.communicate(timeout=600)
    cells = _cells_frame(out)
    assert len(cells) == 8, output  # every cell has a row: none lost
    failed = cells[cells["status"] == "failed"]
    assert 1 <= len(failed) <= 2, output  # the cell in flight (and at most the one starting as it died)
    assert failed["error"].str.len().gt(0).all()
    assert (cells["status"] == "ok").sum() >= 6
    assert proc.returncode == 1 and "failed" in output


def test_server_that_never_starts_fails_its_cells_with_log_lines(tmp_path):
    plan = LONG_PLAN.replace('name = "ngram"\n', 'name = "ngram"\nextra_args = ["--no-such-flag"]\n')
    out = tmp_path / "run"
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp_path, plan)), "--out", str(out)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cells = _cells_frame(out)
    assert (cells[cells["server"] == "target"]["status"] == "ok").all()
    bad = cells[cells["server"] == "ngram"]
    assert len(bad) == 4 and (bad["status"] == "failed").all()
    assert bad["error"].str.contains("no-such-flag").all()  # the engine's own complaint, from its log tail


def _fault_plan(n: int) -> str | None:
    return {2: "http503", 5: "http429", 8: "reset", 11: "truncate", 14: "malformed", 17: "stall"}.get(n)


def test_injected_http_and_stream_faults_are_counted_never_dropped(tmp_path):
    from spectune.servers import make_server
    from spectune.servers.base import ServerSpec

    engine = make_server(ServerSpec(name="engine", method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3),
                         tmp_path / "logs")
    engine.start()
    try:
        with FaultProxy(engine.base_url, _fault_plan, stall_s=20) as proxy:
            plan = f"""
name = "faults"
workload = "quote"
batch_sizes = [2]
repeats = 1
max_tokens = 16
min_prompts = 20
warmup_per_slot = 0
stall_timeout_s = 3
request_timeout_s = 60

[[servers]]
name = "proxied"
engine = "openai"
url = "{proxy.url}"
model = "{engine.model_name}"
"""
            out = tmp_path / "run"
            proc = subprocess.run(sweep_cmd(str(write_plan(tmp_path, plan)), "--out", str(out)), capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            injected = sum(proxy.injected.values())
    finally:
        engine.stop()
    assert injected == 6
    cell = next(iter(finished_cells(out).values()))
    assert cell["num_requests"] == 20 and cell["num_failed"] == 6
    assert cell["failure_rate"] == pytest.approx(6 / 20)
    requests = pd.read_parquet(out / "requests.parquet")
    errors = " ".join(requests["error"].dropna())
    for cause in ("503", "429", "malformed"):
        assert cause in errors
    assert len(requests) == 20  # failed requests are rows too, with their cause
    # Flagged in the report and kept out of tuning: failure rate above the plan's limit.
    from spectune.report.data import collect

    data = collect(out)
    assert len(data.flagged) == 1 and data.per_cell.empty
