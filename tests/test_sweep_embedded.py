"""`spectune sweep` end to end on the embedded engine: the files, identical traffic, lossless outputs."""

import json
import subprocess

import pandas as pd
import pytest

from sweep_helpers import SMALL_PLAN, sweep_cmd, write_plan

# the shipped EAGLE and dflash heads too, launched like the others (no `draft_model`: the engine's default heads)
PLAN = SMALL_PLAN + '\n[[servers]]\nname = "eagle"\nmethod = "eagle"\nnum_speculative_tokens = 3\n' \
    + '\n[[servers]]\nname = "dflash"\nmethod = "dflash"\nnum_speculative_tokens = 5\n'


def test_sweep_writes_results_with_identical_traffic_and_identical_greedy_text(tmp_path, spectune_cmd):
    out = tmp_path / "run"
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp_path, PLAN)), "--out", str(out)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["progress"]["done"] == 10 and manifest["progress"]["failed"] == 0
    assert set(manifest["traffic_digests"]) == {"1", "3"}

    cells = pd.read_parquet(out / "cells.parquet")
    assert len(cells) == 10 and (cells["status"] == "ok").all()
    assert set(cells.loc[cells["server"] == "dflash", "method"]) == {"dflash"}  # the method is recorded
    # Identical traffic: every server got the byte-identical request list at each batch size.
    for bs, group in cells.groupby("batch_size"):
        assert set(group["traffic_digest"]) == {manifest["traffic_digests"][str(bs)]}
    spec = cells[cells["is_speculative"]]
    assert spec["acceptance_rate"].between(0, 1).all() and (spec["acceptance_rate"] > 0).all()
    assert (spec["acceptance_length"] >= 1).all()
    target = cells[~cells["is_speculative"]]
    assert target["acceptance_rate"].isna().all()
    assert (cells["output_throughput_tps"] > 0).all() and (cells["mem_peak_mb"] > 0).all()

    # Lossless: same request, same greedy output text on every server.
    requests = pd.read_parquet(out / "requests.parquet")
    requests["server"] = requests["cell"].str.split("__").str[0]
    requests["bs"] = requests["cell"].str.split("__").str[1]
    texts = requests.pivot_table(index=["bs", "index"], columns="server", values="text", aggfunc="first")
    assert len(texts) == 4 + 6
    for server in ("draft", "eagle", "dflash", "ngram"):
        assert (texts[server] == texts["target"]).all(), texts[texts[server] != texts["target"]]
    assert (requests["output_tokens"] == 12).all()

    summary = pd.read_parquet(out / "summary.parquet")
    assert set(summary["server"]) == {"draft", "eagle", "dflash", "ngram"} and set(summary["batch_size"]) == {1, 3}

    rep = subprocess.run([*spectune_cmd, "report", str(out), "--out", str(tmp_path / "report")], capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    page = (tmp_path / "report" / "report.html").read_text()
    assert "speedup" in page and "data:image/png;base64" in page
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| draft |" in md or "draft" in md


def test_interleaved_sweep_runs_repeat_by_repeat_with_every_server_up_once(tmp_path):
    """interleave = true: cells go repeat by repeat and, at each batch size, server after server (speedups pair cells
    measured seconds apart); each server launches once and the outputs are still lossless."""
    plan = SMALL_PLAN.replace("repeats = 1", "repeats = 2\ninterleave = true")
    out = tmp_path / "run"
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp_path, plan)), "--out", str(out)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    finished = [line.split()[:3] for line in lines if " r=" in line and " ok" in line]
    servers = ["[target]", "[draft]", "[ngram]"]
    assert finished == [[s, f"bs={bs}", f"r={r}"] for r in (0, 1) for bs in (1, 3) for s in servers], finished
    assert [line.split()[0] for line in lines if line.endswith("starting embedded server")] == servers
    cells = pd.read_parquet(out / "cells.parquet")
    assert len(cells) == 12 and (cells["status"] == "ok").all()
    assert json.loads((out / "run.json").read_text())["plan"]["interleave"] is True
    requests = pd.read_parquet(out / "requests.parquet")
    requests["server"] = requests["cell"].str.split("__").str[0]
    requests["bs"] = requests["cell"].str.split("__").str[1]
    requests["repeat"] = requests["cell"].str.split("__").str[2]
    texts = requests.pivot_table(index=["bs", "repeat", "index"], columns="server", values="text", aggfunc="first")
    assert len(texts) == 2 * (4 + 6)
    assert (texts["draft"] == texts["target"]).all() and (texts["ngram"] == texts["target"]).all()


@pytest.mark.parametrize("interleave", [False, True])
def test_relaunch_measures_every_repeat_on_a_fresh_launch_of_each_server(tmp_path, interleave):
    """relaunch = true: each server is launched once per repeat and measures that repeat's cells on it (the launch's
    pid recorded per cell): server by server and within a server repeat by repeat, or interleaved repeat by repeat with
    each server relaunched at its first cell of the next repeat; outputs stay lossless."""
    plan = SMALL_PLAN.replace("repeats = 1", f"repeats = 2\nrelaunch = true\ninterleave = {str(interleave).lower()}")
    plan = plan.replace("batch_sizes = [1, 3]", "batch_sizes = [1, 2]")
    plan = plan[: plan.index('[[servers]]\nname = "draft"')]  # target-only and n-gram: two launches each
    plan += '[[servers]]\nname = "ngram"\nmethod = "ngram"\nnum_speculative_tokens = 2\nprompt_lookup_min = 1\nprompt_lookup_max = 3\n'
    out = tmp_path / "run"
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp_path, plan)), "--out", str(out)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    finished = [line.split()[:3] for line in lines if " r=" in line and " ok" in line]
    servers = ("target", "ngram")
    if interleave:
        expected = [[f"[{s}]", f"bs={bs}", f"r={r}"] for r in (0, 1) for bs in (1, 2) for s in servers]
    else:
        expected = [[f"[{s}]", f"bs={bs}", f"r={r}"] for s in servers for r in (0, 1) for bs in (1, 2)]
    assert finished == expected, finished
    starts = [line.split()[0] for line in lines if line.endswith("starting embedded server")]
    assert starts == (["[target]", "[ngram]"] * 2 if interleave else ["[target]"] * 2 + ["[ngram]"] * 2)
    assert sum(line.endswith("repeat 1 on a fresh launch (relaunch = true)") for line in lines) == 2
    cells = pd.read_parquet(out / "cells.parquet")
    assert len(cells) == 8 and (cells["status"] == "ok").all()
    launches = cells.groupby(["server", "repeat"])["server_pid"].agg(["nunique", "first"]).reset_index()
    assert (launches["nunique"] == 1).all()  # one launch per repeat
    assert launches.groupby("server")["first"].nunique().eq(2).all()  # and a fresh one for the next repeat
    requests = pd.read_parquet(out / "requests.parquet")
    requests["server"] = requests["cell"].str.split("__").str[0]
    requests["key"] = requests["cell"].str.split("__").str[1:].str.join("/")
    texts = requests.pivot_table(index=["key", "index"], columns="server", values="text", aggfunc="first")
    assert len(texts) == 2 * (4 + 4) and (texts["ngram"] == texts["target"]).all()
