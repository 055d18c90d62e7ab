"""`spectune sweep` as the whole pipeline, through the CLI on the embedded engine: measure, tune, configs, report,
the closing summary, the stage flags, and failed later stages that keep the measurement. One real sweep; the other
cases resume copies of it (nothing left to measure), so they exercise the later stages alone."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from spectune.emit import validate_sglang_config, validate_vllm_config
from spectune.pipeline import report_dir_for
from spectune.resources import default_plan, resolve_plan, shipped_dir
from sweep_helpers import sweep_cmd, write_plan

PLAN = """
name = "pipeline"
workload = "quote"
batch_sizes = [1, 2]
repeats = 2
max_tokens = 12
prompts_per_slot = 2
min_prompts = 4
warmup_per_slot = 0

[[servers]]
name = "target"

[[servers]]
name = "ngram"
method = "ngram"
num_speculative_tokens = [1, 2]
prompt_lookup_min = 1
prompt_lookup_max = 3

[[servers]]
name = "eagle"
method = "eagle"
num_speculative_tokens = 2
"""
CELL_LINE = re.compile(r"^\[(target|ngram-g1|ngram-g2|eagle)\] bs=[12] r=[01] ok  [\d.]+ tok/s  TPOT [\d.]+ ms")


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("pipeline")
    out = tmp / "run"
    proc = run(sweep_cmd(str(write_plan(tmp, PLAN)), "--out", str(out), "--trials", "8", stages=True))
    return out, proc


def test_sweep_measures_tunes_writes_configs_and_report_then_summarises(pipeline_run):
    out, proc = pipeline_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (pd.read_parquet(out / "cells.parquet")["status"] == "ok").all()

    tuned = out / "tuned"
    assert {p.name for p in tuned.iterdir()} == {"adaptive_spec.json", "vllm_speculative_config.json", "llamacpp_flags.txt",
                                                 "deploy.md", "tuning.json"}
    report = json.loads((tuned / "tuning.json").read_text())
    assert report["study"]["complete"] == 8
    deploy = {d["engine"]: d for d in report["deploy"]}
    assert set(deploy) == {"sglang", "vllm", "llamacpp"} and all(d["note"] for d in deploy.values())
    assert all(Path(d["file"]).is_absolute() and Path(d["file"]).is_file() for d in deploy.values())
    validate_sglang_config(deploy["sglang"]["file"])
    vllm = validate_vllm_config(Path(deploy["vllm"]["file"]))
    assert vllm.method in ("ngram", "draft_model") and vllm.num_speculative_tokens_per_batch_size
    assert "eagle" not in (tuned / "llamacpp_flags.txt").read_text()
    report_dir = out / "report"  # --out outside a results/ folder: the report goes inside the run directory
    assert {p.name for p in report_dir.iterdir()} >= {"report.html", "report.md"}
    # the report's verdict names this run in its confirm command, as the console does (tuning.json says RESULTS)
    assert "spectune confirm RESULTS" in report["verdict"]["text"]
    assert all("spectune confirm RESULTS" not in (report_dir / f).read_text() for f in ("report.html", "report.md"))
    assert f"spectune confirm {out}" in (report_dir / "report.md").read_text()

    lines = proc.stdout.splitlines()
    # plain progress (stdout is not a terminal here): one line per cell, a line per server start, no escape codes
    assert len([line for line in lines if CELL_LINE.match(line)]) == 4 * 2 * 2
    assert [line for line in lines if line.endswith("embedded server")] == [f"[{s}] starting embedded server" for s in
                                                                             ("target", "ngram-g1", "ngram-g2", "eagle")]
    assert "\x1b[" not in proc.stdout
    # the tune stage names the method it tuned and the steps per batch size
    assert f"tuned method: {report['method']} on the embedded engine" in proc.stdout
    steps = report["policies"]["best_per_batch_schedule"]["best_steps_by_batch_size"]
    assert f"batch 1: {steps['1']}, batch 2: {steps['2']}" in proc.stdout
    # and whether the tuned config beats SGLang's default, with what to run to measure it on this run
    verdict = next(line for line in lines if line.startswith("verdict (simulated): "))
    assert report["verdict"]["text"].split(" (simulated over")[0] in verdict and f"spectune confirm {report['results_dir']})" in verdict
    assert f"exhaustive: {report['exhaustive']['text']}" in lines
    # the noise floor's command to add repeats on fresh launches names the run too (one launch a server here)
    floor = next(line for line in lines if line.startswith("noise floor: "))
    assert "RESULTS" not in floor and f"spectune sweep --resume {report['results_dir']} --repeats N" in floor

    # the closing summary: one row per batch size, with the recommendation_table's figures, then every file
    header = next(i for i, line in enumerate(lines) if line.startswith("batch size"))
    assert lines[header].split() == ["batch", "size", "method", "steps", "speedup", "95%", "CI", "clear?", "acceptance", "accept.", "length"]
    rows = [lines[header + 1].split(), lines[header + 2].split()]
    assert [r[0] for r in rows] == ["1", "2"] and all(r[1] in ("target-only", "ngram", "eagle") for r in rows)
    assert all(r[3].endswith("x") for r in rows)
    files = lines[lines.index("Files written:") + 1:]
    listed = [f.strip().split(" (")[0].rstrip("/") for f in files]
    assert str(out.resolve() / "run.json") in listed and str(tuned.resolve() / "deploy.md") in listed
    assert str(report_dir.resolve() / "report.html") in listed
    assert all(Path(p).exists() for p in listed)


def _copy_without_later_stages(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tuned", "report", "study.db"))
    return dst


def test_no_tune_and_no_report_stop_earlier(pipeline_run, tmp_path):
    out, _ = pipeline_run
    only_report = _copy_without_later_stages(out, tmp_path / "a")
    proc = run(sweep_cmd("--resume", str(only_report), "--no-tune", stages=True))
    assert proc.returncode == 0, proc.stderr
    assert not (only_report / "tuned").exists() and (only_report / "report" / "report.html").is_file()
    assert "Deploy" not in proc.stdout and "0 cells measured, 0 failed, 16 already done" in proc.stdout

    measured_only = _copy_without_later_stages(out, tmp_path / "b")
    proc = run(sweep_cmd("--resume", str(measured_only), "--no-tune", "--no-report", stages=True))
    assert proc.returncode == 0, proc.stderr
    assert not (measured_only / "tuned").exists() and not (measured_only / "report").exists()
    assert f"later: spectune tune {measured_only}" in proc.stdout and f"later: spectune report {measured_only}" in proc.stdout
    assert "batch size" in proc.stdout  # the measured recommendation is printed all the same


def test_failed_tune_and_report_stages_keep_the_measurement_and_exit_1(pipeline_run, tmp_path):
    out = _copy_without_later_stages(pipeline_run[0], tmp_path / "run")
    before = (out / "cells.parquet").read_bytes()
    # real faults: where each stage must make its directory there is a file
    (out / "tuned").write_text("in the way")
    (out / "report").write_text("in the way")
    proc = run(sweep_cmd("--resume", str(out), "--trials", "2", stages=True))
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[0].startswith("error: tune: ") and errors[1].startswith("error: report: ")
    assert f"spectune tune {out}" in errors[0]
    assert (out / "cells.parquet").read_bytes() == before
    listed = [f.strip().split(" (")[0].rstrip("/") for f in proc.stdout.split("Files written:\n")[1].splitlines()]
    assert str(out.resolve() / "cells.parquet") in listed and all(Path(p).exists() for p in listed)


def test_bad_plan_is_a_one_line_error_before_anything_runs(tmp_path, spectune_cmd):
    proc = run([*spectune_cmd, "sweep", "no-such-plan"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: no-such-plan: plan file not found; pass an existing TOML file or a shipped "
                                                f"plan: {', '.join(sorted(p.stem for p in shipped_dir('configs').glob('*.toml')))}"]
    assert list(tmp_path.iterdir()) == []
    proc = run([*spectune_cmd, "sweep", "--trials", "-1"], cwd=tmp_path)
    assert proc.returncode == 2 and "--trials" in proc.stderr and list(tmp_path.iterdir()) == []


def test_shipped_plans_resolve_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_plan(None) == default_plan() and default_plan().is_file()
    assert resolve_plan("vllm-cpu") == resolve_plan("configs/vllm-cpu.toml") == shipped_dir("configs") / "vllm-cpu.toml"
    (tmp_path / "vllm-cpu").write_text("a file of that name wins")
    assert resolve_plan("vllm-cpu") == Path("vllm-cpu")


def test_report_goes_beside_results_or_inside_the_run(tmp_path):
    assert report_dir_for(tmp_path / "results" / "embedded-1") == tmp_path / "reports" / "embedded-1"
    assert report_dir_for(tmp_path / "elsewhere" / "run") == tmp_path / "elsewhere" / "run" / "report"
