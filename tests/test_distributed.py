"""A sweep shared by workers through one Optuna study on a real PostgreSQL server (spectune.distributed).

Embedded engine, a tiny plan. Worker A claims a cell and is SIGKILLed (with its engine) while measuring it; workers B
and C then share the rest and, once A's heartbeat is stale, its cell. Every cell must finish exactly once, and
`spectune collect` must write a results directory with the plan's cell set that `spectune tune`'s loader reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import optuna
from optuna.trial import TrialState

from spectune.distributed import study_name
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
