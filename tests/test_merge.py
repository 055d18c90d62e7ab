"""spectune merge: runs of one plan, measured apart on real embedded servers, as one results directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from spectune.holdout import one_launch
from spectune.report.data import collect
from spectune.report.render import header_items
from spectune.store import load_run
from sweep_helpers import TINY_NGRAM_PLAN, finished_cells, sweep_cmd, write_plan


def _merge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spectune.cli", "merge", *args], capture_output=True, text=True, timeout=120)


def _sweep(tmp, name: str, plan_text: str = TINY_NGRAM_PLAN, repeats: int = 1):
    out, plans = tmp / name, tmp / f"{name}-plan"
    plans.mkdir()
    plan = write_plan(plans, plan_text)
    proc = subprocess.run(sweep_cmd(str(plan), "--out", str(out), "--repeats", str(repeats)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("merge")
    return _sweep(tmp, "first", repeats=1), _sweep(tmp, "second", repeats=2)


def _snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_merged_run_holds_every_cell_of_both_runs_with_repeats_numbered_in_turn(tmp_path, runs):
    first, second = runs
    before = {r: _snapshot(r) for r in runs}
    out = tmp_path / "merged"
    proc = _merge(str(first), str(second), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{first}: repeats 0-0" in proc.stdout and f"{second}: repeats 1-2" in proc.stdout
    assert f"next: spectune tune {out}" in proc.stdout
    assert {r: _snapshot(r) for r in runs} == before  # the sources are untouched
    assert not (tmp_path / ".merged.merging").exists()  # written aside and renamed once whole

    merged = load_run(out)
    a, b = load_run(first), load_run(second)
    assert len(merged.cells) == len(a.cells) + len(b.cells) == 12
    assert sorted(merged.cells["repeat"].unique()) == [0, 1, 2]
    metrics = ["output_throughput_tps", "tpot_ms_mean", "server_pid", "status"]
    for src, offset in ((a, 0), (b, 1)):
        for row in src.cells.itertuples():
            new = merged.cells[(merged.cells["server"] == row.server) & (merged.cells["batch_size"] == row.batch_size)
                               & (merged.cells["repeat"] == row.repeat + offset)]
            assert len(new) == 1 and new.iloc[0]["cell"] == f"{row.server}__bs{row.batch_size}__r{row.repeat + offset}"
            assert new.iloc[0][metrics].tolist() == [getattr(row, m) for m in metrics]
            pd.testing.assert_frame_equal(merged.requests[merged.requests["cell"] == new.iloc[0]["cell"]].drop(columns="cell").reset_index(drop=True),
                                          src.requests[src.requests["cell"] == row.cell].drop(columns="cell").reset_index(drop=True))
    for server, log in merged.round_logs.items():  # each run's rounds, one after the other
        assert log.read_text() == (first / "rounds" / log.name).read_text() + (second / "rounds" / log.name).read_text()
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["plan"]["repeats"] == 3 and manifest["status"] == "complete"
    assert manifest["progress"] == {"total": 12, "done": 12, "failed": 0}
    assert [m["repeats"] for m in manifest["merged_from"]] == [[0, 0], [1, 2]]
    assert manifest["hardware"] == a.manifest["hardware"]
    assert one_launch(merged.cells) is False  # two runs: every server launched more than once
    header = dict(header_items(collect(out)))
    assert header["merged from"].startswith("2 runs (spectune merge): first (") and "repeats 1-2" in header["merged from"]
    assert header["measured"].endswith("from the first run's start to the last's end")


def test_runs_of_different_plans_or_hardware_are_refused_and_nothing_is_written(tmp_path, runs):
    first, second = runs
    other = _sweep(tmp_path, "other", TINY_NGRAM_PLAN.replace("max_tokens = 8", "max_tokens = 6"))
    out = tmp_path / "merged"
    proc = _merge(str(first), str(other), "--out", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert f"{other / 'run.json'}: plan differs from {first}'s in max_tokens" in proc.stderr

    manifest = json.loads((other / "run.json").read_text())  # a run from another machine, injected by editing run.json
    json.dump({**manifest, "plan": json.loads((second / "run.json").read_text())["plan"],
               "hardware": {**manifest["hardware"], "cpu_count": 64}}, open(other / "run.json", "w"))
    proc = _merge(str(first), str(other), "--out", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert "hardware differs" in proc.stderr and "never mixed" in proc.stderr

    json.dump({**json.loads((first / "run.json").read_text()), "status": "interrupted"}, open(other / "run.json", "w"))
    proc = _merge(str(first), str(other), "--out", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert f"status 'interrupted'; finish it first (spectune sweep --resume {other})" in proc.stderr

    proc = _merge(str(first), "--out", str(out))
    assert proc.returncode == 2 and "two or more" in proc.stderr

    taken = tmp_path / "taken"
    (taken / "notes").mkdir(parents=True)
    proc = _merge(str(first), str(second), "--out", str(taken))
    assert proc.returncode == 2 and f"{taken}: not empty; choose another --out" in proc.stderr
    assert [p.name for p in taken.iterdir()] == ["notes"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no half-merged directory left
    assert len(finished_cells(first)) == 4
