"""A sweep shared by workers through one Optuna study on a real PostgreSQL server (spectune.distributed).

Embedded engine, a tiny plan. Worker A claims a cell and is SIGKILLed (with its engine) while measuring it; workers B
and C then share the rest and, once A's heartbeat is stale, its cell. Every cell must finish exactly once, and
`spectune collect` must write a results directory with the plan's cell set that `spectune tune`'s loader reads.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from spectune.distributed import hardware_key, join_study, study_name
from spectune.errors import SpectuneError
from spectune.plan import load_plan
from spectune.search import storage_for
from spectune.store import load_run
from spectune.sweep import plan_cells
from sweep_helpers import TINY_NGRAM_PLAN as PLAN
from test_tune import postgres_url  # noqa: F401  (the fixture: a throw-away PostgreSQL server)


def _worker(spectune_cmd, plan: Path, url: str, scratch: Path) -> subprocess.Popen:
    return subprocess.Popen([*spectune_cmd, "sweep", str(plan), "--storage", url, "--worker", "--heartbeat", "1", "--out", str(scratch)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _read_until(proc: subprocess.Popen, prefix: str) -> str:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"worker exited ({proc.wait()}) before printing {prefix!r}:\n{''.join(seen)}")


def test_workers_share_cells_survive_a_sigkill_and_collect(tmp_path, postgres_url, spectune_cmd):  # noqa: F811
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN)
    plan = load_plan(plan_file)
    expected = {c.id for c in plan_cells(plan)}

    a = _worker(spectune_cmd, plan_file, postgres_url, tmp_path / "a")
    killed_cell = _read_until(a, "claimed ").split()[1]
    os.killpg(a.pid, signal.SIGKILL)  # the worker and the engine it launched: a machine gone mid-cell
    a.wait()
    a.stdout.close()
    study = optuna.load_study(study_name=study_name(plan), storage=storage_for(postgres_url))
    running = [t for t in study.get_trials(states=(TrialState.RUNNING,))]
    assert [t.params["cell"] for t in running] == [killed_cell]

    b, c = (_worker(spectune_cmd, plan_file, postgres_url, tmp_path / name) for name in ("b", "c"))
    outputs = [w.communicate(timeout=240)[0] for w in (b, c)]
    assert [w.returncode for w in (b, c)] == [0, 0], outputs

    trials = study.get_trials()
    complete = [t.params["cell"] for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(complete) == sorted(expected)  # every cell finished, and exactly once
    stale = [t for t in trials if t.state == TrialState.FAIL and "cell" in t.params]
    assert [t.params["cell"] for t in stale] == [killed_cell]  # A's claim, failed as stale and retried
    retried = [t for t in trials if t.state == TrialState.COMPLETE and t.params["cell"] == killed_cell]
    assert retried[0].system_attrs.get("failed_trial") == stale[0].number

    out = tmp_path / "collected"
    done = subprocess.run([*spectune_cmd, "collect", postgres_url, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run = load_run(out)
    assert set(run.cells["cell"]) == expected
    assert (run.cells["status"] == "ok").all()
    assert run.cells["hardware_key"].nunique() == 1 and run.manifest["hardware"]["cpu_count"] == os.cpu_count()
    assert set(run.requests["cell"]) == expected  # every cell's per-request frame came through the study
    assert run.manifest["status"] == "complete" and set(run.round_logs) == {"target", "ngram-g2"}
    assert not list(tmp_path.glob(".collected*"))  # written aside, then renamed into place
    again = subprocess.run([*spectune_cmd, "collect", postgres_url, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "not empty; choose another --out, or remove it to collect again" in again.stderr
    assert set(load_run(out).cells["cell"]) == expected  # the first collect untouched


def test_ctrl_c_hands_the_workers_cell_back_at_once(tmp_path, spectune_cmd):
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN)
    plan = load_plan(plan_file)
    url = f"sqlite:///{tmp_path / 's.db'}"
    a = _worker(spectune_cmd, plan_file, url, tmp_path / "a")
    cell = _read_until(a, "claimed ").split()[1]
    a.send_signal(signal.SIGINT)
    said = a.communicate(timeout=120)[0]
    assert a.returncode == 130, said
    assert f"interrupted: {cell} handed back to the study" in said and "the same command joins it again" in said
    study = optuna.load_study(study_name=study_name(plan), storage=storage_for(url))
    (stopped,) = study.get_trials(states=(TrialState.FAIL,))
    assert stopped.params["cell"] == cell and "Ctrl-C" in stopped.user_attrs["interrupted"]
    assert not study.get_trials(states=(TrialState.RUNNING,))  # waiting again, not held until its heartbeat is stale

    b = _worker(spectune_cmd, plan_file, url, tmp_path / "a")  # the same command again, same scratch directory
    assert b.communicate(timeout=240)[0] and b.returncode == 0
    complete = [t.params["cell"] for t in study.get_trials(states=(TrialState.COMPLETE,))]
    assert sorted(complete) == sorted(c.id for c in plan_cells(plan))  # every cell once, the handed-back one included


def test_collect_keeps_cells_of_other_hardware_apart_hardware_faked(tmp_path, spectune_cmd):
    # One machine cannot measure on two kinds of hardware, so after a real worker finished, the records of the ngram
    # server's cells are rewritten in the real storage as if a 64-core machine with a GPU had measured them.
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN)
    db = tmp_path / "s.db"
    w = _worker(spectune_cmd, plan_file, f"sqlite:///{db}", tmp_path / "w")
    assert w.communicate(timeout=240)[0] and w.returncode == 0
    other = None
    with sqlite3.connect(db) as conn:
        attrs = conn.execute("SELECT trial_id, key, value_json FROM trial_user_attributes WHERE key IN ('row', 'hardware')").fetchall()
        records: dict[int, dict] = {}
        for trial_id, key, value in attrs:
            records.setdefault(trial_id, {})[key] = json.loads(value)
        for trial_id, rec in records.items():
            if rec["row"]["server"] != "ngram-g2":
                continue
            hardware = {**rec["hardware"], "cpu_count": 64, "gpus": ["NVIDIA H100 80GB HBM3"]}
            other = hardware_key(hardware)
            for key, value in (("hardware", hardware), ("row", {**rec["row"], "hardware_key": other})):
                conn.execute("UPDATE trial_user_attributes SET value_json = ? WHERE trial_id = ? AND key = ?",
                             (json.dumps(value), trial_id, key))
    out = tmp_path / "collected"
    done = subprocess.run([*spectune_cmd, "collect", f"sqlite:///{db}", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    runs = {p.name: load_run(p) for p in sorted(out.glob("hw-*"))}
    assert len(runs) == 2 and f"hw-{other}" in runs and f"next: spectune tune {out / f'hw-{other}'}" in done.stdout
    gpu = runs.pop(f"hw-{other}")
    (cpu,) = runs.values()
    assert set(gpu.cells["server"]) == {"ngram-g2"} and set(cpu.cells["server"]) == {"target"}  # never mixed
    assert gpu.manifest["hardware"]["cpu_count"] == 64 and cpu.manifest["hardware"]["cpu_count"] == os.cpu_count()


def _join_after(barrier, url: str, plan_file: str, errors) -> None:
    barrier.wait()  # every worker opens the empty database at once, as workers started together do
    try:
        join_study(url, load_plan(plan_file), log=lambda _: None)
    except Exception as e:  # reported to the test, which names it
        errors.put(f"{type(e).__name__}: {str(e).splitlines()[0]}")
        raise


def test_workers_starting_together_on_an_empty_database_all_join(tmp_path):
    # Four workers opening a fresh SQLite study at the same moment used to lose the race to create Optuna's tables
    # ("table studies already exists", or the schema version's UNIQUE constraint) in 4 rounds of 5.
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN)
    ids = sorted(c.id for c in plan_cells(load_plan(plan_file)))
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        url = f"sqlite:///{tmp_path / f's{round_}.db'}"
        barrier, errors = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_join_after, args=(barrier, url, str(plan_file), errors)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        failed = [errors.get(timeout=5) for p in procs if p.exitcode != 0]
        assert [p.exitcode for p in procs] == [0] * 4, failed
        study = optuna.load_study(study_name=study_name(load_plan(plan_file)), storage=storage_for(url))
        assert sorted(t.system_attrs["fixed_params"]["cell"] for t in study.trials) == ids  # each cell enqueued once


def test_a_storage_that_cannot_be_opened_is_one_line_naming_it(tmp_path, spectune_cmd):
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for url in (f"postgresql://me:secret@127.0.0.1:{port}/spectune", f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}"):
        done = subprocess.run([*spectune_cmd, "sweep", str(plan_file), "--storage", url, "--worker"],
                              capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert "cannot open it as an Optuna storage" in lines[0] and url.replace("secret", "***") in lines[0]
        assert "secret" not in lines[0]


def test_postgresql_without_a_driver_says_what_to_install_driver_hidden(monkeypatch):
    # The test environment has psycopg2; a user's `pip install '.[engine]'` does not. Hidden here the way Python's
    # import system reads a module marked missing.
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    with pytest.raises(SpectuneError, match=r"^storage postgresql://me:\*\*\*@127.0.0.1/x: PostgreSQL needs a driver .* pip install psycopg2-binary"):
        storage_for("postgresql://me:secret@127.0.0.1/x")


def test_collect_names_the_study_when_there_is_none(tmp_path, spectune_cmd):
    done = subprocess.run([*spectune_cmd, "collect", f"sqlite:///{tmp_path / 'empty.db'}", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "0 sweep studies" in done.stderr


def test_storage_without_worker_is_refused_with_the_fix(tmp_path, spectune_cmd):
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN)
    done = subprocess.run([*spectune_cmd, "sweep", str(plan_file), "--storage", f"sqlite:///{tmp_path / 's.db'}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--storage and --worker go together" in done.stderr
    assert not (tmp_path / "s.db").exists()



def test_a_guided_plan_cannot_be_shared(tmp_path, spectune_cmd):
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN.replace('workload = "code"', 'workload = "code"\nbudget = 0.5'))
    done = subprocess.run([*spectune_cmd, "sweep", str(plan_file), "--storage", f"sqlite:///{tmp_path / 's.db'}", "--worker"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "remove budget" in done.stderr


def test_a_worker_measures_the_plan_as_its_command_line_overrides_it(tmp_path, spectune_cmd):
    # --batch-sizes and --max-tokens change a plan for a worker as for a sweep (they were dropped: the worker measured
    # the plan file's batch sizes); workers given the same overrides share one study
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN.replace('workload = "code"', 'workload = "code"\ninterleave = true'))  # as the default plan
    url = f"sqlite:///{tmp_path / 's.db'}"
    cmd = [*spectune_cmd, "sweep", str(plan_file), "--batch-sizes", "2", "--max-tokens", "4", "--storage", url, "--worker"]
    done = subprocess.run([*cmd, "--out", str(tmp_path / "w")], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    overridden = load_plan(plan_file, batch_sizes=[2], max_tokens=4)
    assert f"study {study_name(overridden)}: 2 cells enqueued" in done.stdout
    assert f"their server logs are in {tmp_path / 'w' / 'logs'}" in done.stdout and (tmp_path / "w" / "logs" / "target.log").exists()
    assert f"next: spectune collect {url} --out DIR" in done.stdout
    assert "interleave = true is for one machine: a worker keeps one server up at a time" in done.stdout
    out = tmp_path / "collected"
    collected = subprocess.run([*spectune_cmd, "collect", url, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stderr
    run = load_run(out)
    assert sorted(run.cells["cell"]) == sorted(c.id for c in plan_cells(overridden))
    assert set(run.cells["batch_size"]) == {2} and (run.requests["output_tokens"] <= 4).all()


@pytest.mark.parametrize("flag", [["--budget", "0.5"], ["--resume", "results/x"]])
def test_flags_a_worker_cannot_honour_are_refused(tmp_path, spectune_cmd, flag):
    plan_file = tmp_path / "shared.toml"
    plan_file.write_text(PLAN)
    done = subprocess.run([*spectune_cmd, "sweep", str(plan_file), *flag, "--storage", f"sqlite:///{tmp_path / 's.db'}", "--worker"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and f"error: {flag[0]} (" in done.stderr and "does not go with --worker; drop it" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "s.db").exists()
