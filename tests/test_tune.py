"""The tuner on SYNTHETIC results (tests/synthetic_sweep.py: a known cost and acceptance model written as
real sweep files), with real Optuna storages: SQLite, and a real PostgreSQL server started here."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import optuna
import pytest
from optuna.trial import TrialState

from spectune.emit import schedule_from_optima, validate_sglang_config, validate_vllm_config
from spectune.costmodel import AcceptanceProfile
from spectune.scoring import make_bench
from spectune.search import SearchSpace, run_trials, storage_for
from spectune.tune import TuneOptions, load_results, sglang_method, tune
from synthetic_sweep import SYNTHETIC_COST, write_synthetic_results

COMPARISONS = {"target_only", "best_static", "best_per_batch_schedule", "sglang_default", "conservative", "aggressive",
               "oracle", "tuned_adaptive"}
PG_INSTALL = "apt-get install -y postgresql"


@pytest.fixture(scope="module")
def synthetic_results(tmp_path_factory) -> Path:
    return write_synthetic_results(tmp_path_factory.mktemp("synthetic") / "synthetic-run")


@pytest.fixture
def results(synthetic_results, tmp_path) -> Path:
    """A private copy: tune writes study.db and tuned/ into the results directory."""
    return Path(shutil.copytree(synthetic_results, tmp_path / "synthetic-run"))


def test_tune_synthetic_results_recovers_model_and_writes_valid_configs(results, tmp_path, monkeypatch):
    (tmp_path / "models" / "draft").mkdir(parents=True)
    (tmp_path / "models" / "draft" / "config.json").write_text("{}")  # a Hugging Face directory: what vLLM loads
    monkeypatch.chdir(tmp_path)
    outcome = tune(TuneOptions(results_dir=results, trials=60, seed=0, draft_model="models/draft", exhaustive=False), log=lambda _: None)
    tuned = results / "tuned"
    assert {p.name for p in outcome.files} == {"adaptive_spec.json", "vllm_speculative_config.json", "llamacpp_flags.txt",
                                               "deploy.md", "tuning.json"}
    assert all(p.is_absolute() for p in outcome.files)
    report = json.loads((tuned / "tuning.json").read_text())

    # Every comparison, scored; the oracle bounds them all; per-batch-size statics beat one static g.
    scores = {c["name"]: c["speedup"] for c in report["comparisons"]}
    assert set(scores) == COMPARISONS
    assert scores["target_only"] == pytest.approx(1.0)
    assert all(scores["oracle"] >= s for s in scores.values())
    assert scores["best_per_batch_schedule"] >= scores["best_static"] > 1.0
    # The tuned adaptive config beats the best static g, overall and on the phase-shifting trace alone.
    assert scores["tuned_adaptive"] > scores["best_static"]
    by_name = {c["name"]: c for c in report["comparisons"]}
    assert by_name["tuned_adaptive"]["phase-shifting: tokens/s"] > by_name["best_static"]["phase-shifting: tokens/s"]

    # The fit inside recovers the synthetic truth; the failing cells are listed as excluded.
    for row, per_step in zip(report["cost_fit"], SYNTHETIC_COST.per_step_ms, strict=True):
        assert row["per_step_ms"] == pytest.approx(per_step, rel=0.1)
    assert report["cost_fit_tpot_abs_rel_error"]["median"] < 0.03
    assert sorted(c["reason"] for c in report["excluded_cells"]) == ["failure_rate > 0.05", "status failed"]
    assert report["acceptance"]["quote"]["rates"][0] == pytest.approx(0.95)
    assert report["breakeven_batch_size"]["quote"] is None and 4 < report["breakeven_batch_size"]["random"] < 8
    assert {r["batch_size"] for r in report["recommended_steps"]} == set(SYNTHETIC_COST.batch_sizes)
    assert report["study"]["complete"] == 60 and report["study"]["failed"] == 0

    # Written configs pass the engines' validators and say what the comparisons found.
    cfg = validate_sglang_config(tuned / "adaptive_spec.json")
    assert cfg.to_dict() == report["policies"]["tuned_adaptive"]
    vllm = validate_vllm_config(tuned / "vllm_speculative_config.json")
    optima = {int(b): k for b, k in report["policies"]["best_per_batch_schedule"]["best_steps_by_batch_size"].items()}
    assert vllm.num_speculative_tokens_per_batch_size == schedule_from_optima(optima)
    assert vllm.num_speculative_tokens == max(optima.values()) and vllm.model == str(tmp_path / "models" / "draft")
    deploy = {d["engine"]: d for d in report["deploy"]}
    assert deploy["vllm"]["method"] == "draft_model" and deploy["vllm"]["file"] == str(tuned / "vllm_speculative_config.json")
    # llama.cpp needs the draft as GGUF; this directory holds no weights, so no GGUF can be made and it says so
    flags = (tuned / "llamacpp_flags.txt").read_text().split()
    assert "-md" not in flags and flags[:2] == ["--spec-type", "ngram-simple"]
    assert deploy["llamacpp"]["method"] == "ngram" and "NOT MEASURED" in deploy["llamacpp"]["note"]
    assert "draft_model measured faster but has no llama.cpp equivalent here: llama.cpp needs a GGUF file" in deploy["llamacpp"]["note"]


def test_a_tuned_config_running_step_counts_the_sweep_never_measured_says_so():
    from spectune.adaptive import AdaptiveConfig
    from spectune.costmodel import fit_sweep
    from spectune.deploy import unmeasured_steps
    from synthetic_sweep import synthetic_cells

    cells = synthetic_cells()
    inside = AdaptiveConfig.from_dict({"1": {"candidate_steps": [2, 4]}, "8": {"candidate_steps": [0, 2]}})
    swept = cells[cells["num_speculative_tokens"].isin([0, 2, 4])]
    fit = fit_sweep(swept)  # a sweep of g = 2 and 4 only
    assert unmeasured_steps(fit, inside, swept) is None  # 0 (no drafting) needs no speculative cell
    note = unmeasured_steps(fit, AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 4]}, "8": {"candidate_steps": [3]}}), swept)
    assert note is not None and "runs draft_model at g = 1, 3, which the sweep never measured (it measured g = 2, 4)" in note
    assert "add 1, 3 to the plan's num_speculative_tokens" in note


def test_the_simulated_verdict_of_a_sweep_of_attached_servers_does_not_send_the_user_to_confirm(tmp_path):
    results = write_synthetic_results(tmp_path / "attached")
    manifest = json.loads((results / "run.json").read_text())
    manifest["plan"]["servers"] = [{"name": "target", "engine": "embedded", "url": "http://127.0.0.1:9"},
                                   {"name": "draft", "engine": "embedded", "method": "draft_model", "url": "http://127.0.0.1:10"}]
    (results / "run.json").write_text(json.dumps(manifest))
    tune(TuneOptions(results_dir=results, trials=4, seed=0, draft_model="d", exhaustive=False), log=lambda _: None)
    verdict = json.loads((results / "tuned" / "tuning.json").read_text())["verdict"]
    assert verdict["source"] == "simulated" and "run spectune confirm" not in verdict["text"]
    assert "not measured: spectune confirm launches servers of its own, and this sweep attached target and draft" in verdict["text"]


def test_single_workload_run_takes_phase_acceptance_from_its_round_log(tmp_path):
    # One workload per run (as a sweep writes it); its round log alternates easy and hard stretches.
    root = write_synthetic_results(tmp_path / "phase-run", profiles={"phase": AcceptanceProfile((0.6,))})
    bench = make_bench(load_results(root), "throughput", seed=0)
    assert [t.name for t in bench.traces] == ["draft-g8-phase", "phase-shifting"]
    phase = bench.traces[1]
    labels = np.array(phase.phases)
    per_request = lambda label: phase.accepted[labels == label].sum() / phase.batch_sizes[labels == label].sum()
    # The log's quote stretches accept ~5.5 of 8 drafts, its random ones ~0.4: the trace keeps that contrast.
    assert per_request("high") > 4 > 1 > per_request("low")


def test_configs_invalid_for_the_sglang_version_are_fail_trials_and_the_study_goes_on(results):
    # SGLang 0.5.13 has no step 0: every trial whose ladders hold 0 is invalid there.
    outcome = tune(TuneOptions(results_dir=results, trials=15, seed=0, sglang_version="0.5.13", draft_model="d", exhaustive=False), log=lambda _: None)
    assert outcome.num_failed >= 1 and outcome.num_complete >= 1 and outcome.num_failed + outcome.num_complete == 15
    study = optuna.load_study(study_name=outcome.study_name, storage=f"sqlite:///{results / 'study.db'}")
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert all("step 0 needs SGLang >= 0.5.14" in t.user_attrs["error"] for t in failed)
    written = validate_sglang_config(results / "tuned" / "adaptive_spec.json", version="0.5.13")
    assert all(0 not in slot.candidate_steps for slot in written.slots.values())


def test_fault_injected_failing_objective_is_recorded_fail_and_the_study_goes_on():
    calls = []

    def flaky_objective(cfg):  # fault injection: a simulation cannot be made to crash on demand
        calls.append(cfg)
        if len(calls) % 3 == 0:
            raise RuntimeError("injected simulator crash")
        return type("Score", (), {"speedup": 1.0 + len(calls) / 100, "figures": {}})()

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    messages = []
    run_trials(study, SearchSpace(batch_sizes=(1, 4, 16), steps=(0, 1, 3)), flaky_objective, 12, messages.append)
    states = [t.state for t in study.trials]
    assert len(states) == 12 and states.count(TrialState.FAIL) == 4 and states.count(TrialState.COMPLETE) == 8
    assert all(t.user_attrs["error"] == "RuntimeError: injected simulator crash" for t in study.trials if t.state == TrialState.FAIL)
    assert len(messages) == 4 and study.best_value == pytest.approx(1.11)


def test_cli_worker_runs_trials_only_then_trials_0_writes_configs(results, spectune_cmd):
    worker = subprocess.run([*spectune_cmd, "tune", str(results), "--worker", "--trials", "4"], capture_output=True, text=True)
    assert worker.returncode == 0, worker.stderr
    assert "4 complete" in worker.stdout and not (results / "tuned").exists()
    final = subprocess.run([*spectune_cmd, "tune", str(results), "--trials", "0", "--draft-model", "d", "--out", str(results / "cfg"), "--no-exhaustive"],
                           capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    report = json.loads((results / "cfg" / "tuning.json").read_text())
    assert report["study"]["complete"] == 4
    # the console names the method tuned, its steps per batch size and what each engine's config runs
    steps = report["policies"]["best_per_batch_schedule"]["best_steps_by_batch_size"]
    assert "tuned method: draft_model on the embedded engine (the fastest measured over target-only)" in final.stdout
    assert "steps per batch size (best per-batch-size schedule, simulated): " + ", ".join(
        f"batch {b}: {steps[str(b)]}" for b in SYNTHETIC_COST.batch_sizes) in final.stdout
    for d in report["deploy"]:
        assert f"({d['method'] or 'no equivalent'}): {d['file']}" in final.stdout
    assert {c["name"] for c in report["comparisons"]} == COMPARISONS
    bad = subprocess.run([*spectune_cmd, "tune", str(results), "--objective", "fast"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --objective 'fast': must be one of throughput, latency, ttft, tpot, e2e"


# --- a real PostgreSQL server ---------------------------------------------------------------------------------


def _postgres_bindir() -> Path | None:
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "postgresql"], capture_output=True, timeout=600,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    return Path(sorted(found)[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """A throw-away PostgreSQL on 127.0.0.1 (as the postgres user when run as root: it refuses root)."""
    bindir = _postgres_bindir()
    if bindir is None:
        pytest.skip(f"PostgreSQL is not installed and could not be installed; run: {PG_INSTALL}")
    home = Path(tempfile.mkdtemp(prefix="spectune-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(home, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = home / "data", _free_port()
    run = lambda *cmd: subprocess.run([*as_user, *map(str, cmd)], check=True, capture_output=True, timeout=120)
    run(bindir / "initdb", "-D", data, "-A", "trust", "-U", "postgres", "--no-sync")
    run(bindir / "pg_ctl", "-D", data, "-l", home / "server.log", "-w", "-o",
        f"-c listen_addresses=127.0.0.1 -p {port} -k {home} -c fsync=off", "start")
    try:
        run(bindir / "createdb", "-h", "127.0.0.1", "-p", port, "-U", "postgres", "spectune")
        yield f"postgresql://postgres:secret@127.0.0.1:{port}/spectune"
    finally:
        run(bindir / "pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
        shutil.rmtree(home, ignore_errors=True)


def test_two_workers_share_one_postgresql_study(results, postgres_url, spectune_cmd):
    cmd = [*spectune_cmd, "tune", str(results), "--storage", postgres_url, "--worker", "--trials", "5"]
    workers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [w.communicate(timeout=300) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [o[1][-3000:] for o in outputs]
    (name,) = optuna.get_all_study_names(storage_for(postgres_url))
    assert name.startswith("spectune-synthetic-run-draft_model-throughput-")  # and the bench's digest
    study = optuna.load_study(study_name=name, storage=storage_for(postgres_url))
    # Every trial the two workers asked for is in the one study, finished: COMPLETE, or FAIL with its cause kept
    # (a trial may fail, e.g. on a race inside Optuna's RDB storage; the study goes on, by design).
    others = [(t.number, t.state.name, t.user_attrs) for t in study.trials if t.state != TrialState.COMPLETE]
    logged = [line for out, _ in outputs for line in out.splitlines() if "failed" in line]
    assert len(study.trials) == 10 and all(state == "FAIL" and attrs.get("error") for _, state, attrs in others), (others, logged)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(complete) >= 8, (others, logged)
    by_worker = {t.user_attrs["worker"] for t in complete}
    assert by_worker == {f"{socket.gethostname()}:{w.pid}" for w in workers}  # both contributed

    final = subprocess.run([*spectune_cmd, "tune", str(results), "--storage", postgres_url, "--trials", "0", "--draft-model", "d", "--no-exhaustive"],
                           capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    text = (results / "tuned" / "tuning.json").read_text()
    report = json.loads(text)
    # the final run reports the study as it stands: every trial the workers finished, complete or failed
    assert (report["study"]["complete"], report["study"]["failed"]) == (len(complete), len(others))
    assert "secret" not in text and report["study"]["storage"].startswith("postgresql://postgres:***@")
    assert report["policies"]["tuned_adaptive"] == max(complete, key=lambda t: t.value).user_attrs["config"]


def test_a_study_resumes_on_the_same_bench_and_starts_afresh_when_the_cells_change(results):
    options = TuneOptions(results_dir=results, trials=3, seed=0, draft_model="d", exhaustive=False)
    first = tune(options, log=lambda _: None)
    again = tune(options, log=lambda _: None)
    assert again.study_name == first.study_name and again.num_complete == first.num_complete + 3
    # A re-measured target-only cell changes every trial's score: the old trials must not compete with the new ones.
    cell = next(p for p in sorted((results / "cells").glob("*.json")) if json.loads(p.read_text())["is_speculative"] is False)
    row = json.loads(cell.read_text())
    row["output_throughput_tps"] *= 1.2
    cell.write_text(json.dumps(row))
    changed = tune(options, log=lambda _: None)
    assert changed.study_name != first.study_name and changed.num_complete == first.num_complete
    assert changed.study_name.rsplit("-", 1)[0] == first.study_name.rsplit("-", 1)[0]  # same run, method, objective


def test_without_method_tune_picks_the_fastest_method_sglang_runs_adaptive_steps_with():
    def cells(speedups: dict[str, float]) -> pd.DataFrame:
        rows = [{"server": "target", "method": None, "is_speculative": False, "num_speculative_tokens": 0, "tps": 100.0}]
        rows += [{"server": f"{m}-g2", "method": m, "is_speculative": True, "num_speculative_tokens": 2, "tps": 100.0 * x}
                 for m, x in speedups.items()]
        frame = pd.DataFrame([r | {"batch_size": bs} for r in rows for bs in (1, 4)]).rename(columns={"tps": "output_throughput_tps"})
        return frame.assign(engine="embedded", status="ok", failure_rate=0.0, adaptive_config=None, repeat=0)

    # dflash measured fastest, but adaptive_spec.json is SGLang's, which runs adaptive steps with EAGLE only
    assert sglang_method(cells({"dflash": 1.4, "eagle": 1.3, "ngram": 1.1})) == "eagle"
    assert sglang_method(cells({"dflash": 1.4, "eagle": 1.3, "eagle3": 1.35})) == "eagle3"
    assert sglang_method(cells({"dflash": 1.4, "ngram": 1.1})) is None  # then the fastest measured
