"""`spectune gate` on real embedded-engine sweeps: a run against itself, a second run of the same plan (noise), a
run with a much worse draft (a real slowdown), and baselines that cannot be compared."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from spectune.errors import SpectuneError
from spectune.gate import DEFAULT_RULES, compare_values, load_rules
from sweep_helpers import sweep_cmd, write_plan

REPO = Path(__file__).resolve().parent.parent
# A draft made from the shipped target plus noise (plan key draft_noise): 0.02 drafts almost what the target
# says, 1.0 almost never; the server and its traffic are otherwise the same. Interleaved: this host's speed drifts
# by a quarter within a minute, and speedups pair each draft cell with the target cell measured just before it.
# Relaunched: two launches differ by more than one launch's repeats (without it, 2 of 56 pairings of eight runs
# failed a second run of this plan at batch 1, -13% speedup; with it, 0 of 56), so each repeat is a launch.
PLAN = """
name = "gate"
workload = "code"
batch_sizes = [1, 2]
repeats = 5
max_tokens = 16
prompts_per_slot = 2
min_prompts = 4
warmup_per_slot = 1
interleave = true
relaunch = true

[[servers]]
name = "target"

[[servers]]
name = "draft"
method = "draft_model"
num_speculative_tokens = {steps}
draft_noise = {noise}
"""


def _sweep(tmp_path_factory, name: str, noise: float, steps: int = 3) -> Path:
    tmp = tmp_path_factory.mktemp(name)
    out = tmp / "run"
    stop = ["--no-tune", "--no-report"] if "--no-tune" in subprocess.run(sweep_cmd("--help"), capture_output=True, text=True).stdout else []
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp, PLAN.format(noise=noise, steps=steps))), "--out", str(out), *stop),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return _sweep(tmp_path_factory, "base", 0.02)


@pytest.fixture(scope="module")
def again(tmp_path_factory, base) -> Path:
    return _sweep(tmp_path_factory, "again", 0.02)


@pytest.fixture(scope="module")
def slow(tmp_path_factory, base) -> Path:
    # drafts that are almost never accepted, and twice as many of them: each round costs more and yields less.
    return _sweep(tmp_path_factory, "slow", 1.0, steps=6)


def _gate(spectune_cmd, results: Path, baseline: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*spectune_cmd, "gate", str(results), "--baseline", str(baseline), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_gate_passes_a_run_against_itself(base, tmp_path, spectune_cmd):
    proc = _gate(spectune_cmd, base, base, "--junit", str(tmp_path / "ok.xml"), "--summary", str(tmp_path / "ok.md"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    suite = ET.parse(tmp_path / "ok.xml").getroot()
    assert suite.get("failures") == "0" and suite.get("errors") == "0" and int(suite.get("tests")) >= 8
    assert suite.find("testcase/failure") is None
    assert (tmp_path / "ok.md").read_text().startswith("## ✅ spectune gate: PASS")


# Figures that compare servers inside one run: a second run minutes later on this shared 2-core machine may run
# faster or slower as a whole (other work, not spectune), which moves absolute tok/s and latencies together.
PAIRED_RULES = """
[[rules]]
name = "speedup"
metric = "speedup"
threshold = 0.10

[[rules]]
name = "TPOT speedup"
metric = "tpot_speedup"
threshold = 0.10

[[rules]]
name = "acceptance length"
metric = "acceptance_length"
threshold = 0.05
"""


def test_gate_passes_a_second_run_of_the_same_plan(base, again, tmp_path, spectune_cmd):
    rules = tmp_path / "paired.toml"
    rules.write_text(PAIRED_RULES)
    proc = _gate(spectune_cmd, again, base, "--rules", str(rules))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: 6 checks, 0 regression(s)" in proc.stdout


def test_gate_says_when_a_runs_repeats_shared_one_launch(base, tmp_path, spectune_cmd):
    """Repeats on one launch hold no launch-to-launch noise, which a second run adds: the gate says so, naming the run."""
    one_launch = tmp_path / "one-launch"
    shutil.copytree(base, one_launch)
    manifest = json.loads((one_launch / "run.json").read_text())
    manifest["plan"]["relaunch"] = False
    (one_launch / "run.json").write_text(json.dumps(manifest))
    wide = {**os.environ, "COLUMNS": "1000"}  # a long tmp path is folded mid-word at 80 columns
    proc = _gate(spectune_cmd, one_launch, base, env=wide)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert f"the repeats of {one_launch} each ran on one launch of every server" in out and "relaunch = true" in out
    assert "each ran on one launch" not in " ".join(_gate(spectune_cmd, base, base).stdout.split())


def test_gate_fails_a_real_slowdown_naming_the_rule(base, slow, tmp_path, spectune_cmd):
    summary = tmp_path / "step-summary.md"
    summary.write_text("earlier step\n")
    env = {**__import__("os").environ, "GITHUB_STEP_SUMMARY": str(summary)}
    # The rules that compare servers within one run (the default rules' absolute figures, target-only tok/s and p99
    # latencies, also move when the machine as a whole runs slower in the second run).
    rules = tmp_path / "within-run.toml"
    rules.write_text('[[rules]]\nname = "speedup at small batch sizes"\nmetric = "speedup"\nthreshold = 0.10\n'
                     'smallest_batch_sizes = 2\n\n[[rules]]\nname = "acceptance length"\nmetric = "acceptance_length"\n'
                     'threshold = 0.05\nspeculative = true\n')
    proc = _gate(spectune_cmd, slow, base, "--rules", str(rules), "--junit", str(tmp_path / "bad.xml"), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REGRESSION: rule 'speedup at small batch sizes'" in proc.stdout and "FAIL" in proc.stdout
    assert "REGRESSION: rule 'acceptance length'" in proc.stdout
    failures = ET.parse(tmp_path / "bad.xml").getroot().findall("testcase/failure")
    assert failures and all(f.get("type") == "regression" for f in failures)
    assert any("speedup at small batch sizes" in f.get("message") for f in failures)
    assert all("target" != f.get("message").split()[0] for f in failures)
    text = summary.read_text()  # appended to GitHub's step summary, after what was there
    assert text.startswith("earlier step\n") and "## ❌ spectune gate: FAIL" in text and "| speedup at small batch sizes | draft |" in text


def test_gate_knows_lower_is_better(base, slow, tmp_path, spectune_cmd):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rules]]\nname = "mean TPOT"\nmetric = "tpot_ms_mean"\nthreshold = 0.10\nservers = ["draft"]\n')
    worse = _gate(spectune_cmd, slow, base, "--rules", str(rules))
    assert worse.returncode == 1, worse.stdout + worse.stderr
    assert "REGRESSION: rule 'mean TPOT'" in worse.stdout
    better = _gate(spectune_cmd, base, slow, "--rules", str(rules))  # the same change the other way: an improvement
    assert better.returncode == 0, better.stdout + better.stderr
    assert "improved" in better.stdout and "REGRESSION" not in better.stdout


def test_gate_errors_on_baselines_it_cannot_compare(base, tmp_path, spectune_cmd):
    # a zero baseline (written by hand: no real run measures 0 tok/s and finishes)
    zero = tmp_path / "zero"
    shutil.copytree(base, zero)
    cell = zero / "cells" / "target__bs1__r0.json"
    rows = [json.loads(p.read_text()) for p in sorted(zero.glob("cells/target__bs1__r*.json"))]
    for p, row in zip(sorted(zero.glob("cells/target__bs1__r*.json")), rows):
        p.write_text(json.dumps(row | {"output_throughput_tps": 0.0}))
    assert cell.exists()
    proc = _gate(spectune_cmd, base, zero)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rule 'target-only throughput', server target, batch size 1: the baseline's output_throughput_tps is 0" in proc.stderr
    assert proc.stderr.count("\n") == 1
    # a missing baseline: the baseline never measured the draft server
    missing = tmp_path / "missing"
    shutil.copytree(base, missing)
    for p in missing.glob("cells/draft__*.json"):
        p.unlink()
    proc = _gate(spectune_cmd, base, missing)
    assert proc.returncode == 2 and "server draft, batch size 1: no baseline value" in proc.stderr
    # a baseline measured on other traffic at one batch size (its digest edited by hand: another plan's output
    # lengths would do it): a change there is no regression, and nothing is judged on it
    other = tmp_path / "other"
    shutil.copytree(base, other)
    for p in other.glob("cells/*__bs2__r*.json"):
        p.write_text(json.dumps(json.loads(p.read_text()) | {"traffic_digest": "0" * 64}))
    proc = _gate(spectune_cmd, base, other)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"error: {other} measured other traffic (workload, prompts, output lengths or schedule) than "
                                   "this run at draft bs=2, target bs=2; a change there is not a regression: refresh the "
                                   "baseline with the current plan")
    assert " 2 │" not in proc.stdout.split("note:")[0] and " 1 │" in proc.stdout  # batch 1 still judged, batch 2 not
    # a rule on a metric whose direction spectune does not know
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rules]]\nname = "mystery"\nmetric = "kv_cache_usage"\nthreshold = 0.1\n')
    proc = _gate(spectune_cmd, base, base, "--rules", str(rules))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {rules}: rule 1 ('mystery'): metric 'kv_cache_usage' has no known direction; "
                                   'add direction = "higher" or "lower" (which is better)')


def test_the_shipped_rules_file_is_the_default():
    assert load_rules(REPO / "configs" / "gate-rules.toml") == DEFAULT_RULES


def test_bad_rules_are_one_line_errors(tmp_path):
    path = tmp_path / "r.toml"
    for text, expected in [
        ('[[rules]]\nmetric = "tpot_ms_p99"\n', '"threshold" must be a relative change'),
        ('[[rules]]\nmetric = "tpot_ms_p99"\nthreshold = 0.1\ndirection = "up"\n', 'direction \'up\' must be "higher" or "lower"'),
        ('[[rules]]\nmetric = "tpot_ms_p99"\nthreshold = 0.1\nbatch = [1]\n', "unknown key(s) batch"),
        ("rules = 1\n", "no [[rules]] tables"),
    ]:
        path.write_text(text)
        with pytest.raises(SpectuneError, match="^" + str(path).replace(".", r"\.")) as e:
            load_rules(path)
        assert expected in str(e.value) and "\n" not in str(e.value)


def test_welch_decisions():
    # beyond the threshold and beyond the noise: a regression; higher is better
    assert compare_values([100, 101, 99], [80, 81, 79], "higher", 0.1)[3] == "regression"
    # the same means, noisy repeats: the interval spans zero, so within noise
    change, low, high, verdict = compare_values([100, 130, 70], [80, 110, 50], "higher", 0.1)
    assert verdict == "within noise" and low < 0 < high and change == pytest.approx(-0.2)
    # lower is better: a rise is the regression, a fall an improvement
    assert compare_values([10, 10.1, 9.9], [13, 13.1, 12.9], "lower", 0.1)[3] == "regression"
    assert compare_values([13, 13.1, 12.9], [10, 10.1, 9.9], "lower", 0.1)[3] == "improved"
    # one repeat: no noise estimate, the threshold alone decides
    change, low, high, verdict = compare_values([100], [85], "higher", 0.1)
    assert verdict == "regression" and low != low
    assert compare_values([100], [95], "higher", 0.1)[3] == "ok"
    # identical repeats (a deterministic metric such as greedy acceptance): any change beyond the threshold counts
    assert compare_values([2.5, 2.5], [2.0, 2.0], "higher", 0.05)[3] == "regression"


def test_intervals_hold_for_all_checks_together():
    """CI once failed a second run of the same plan: one of six checks had its 95% interval just below zero. Alone,
    that change is a regression; as one of six checks, whose intervals hold at 95% together, it is noise."""
    base, now = [100, 110, 90, 105, 95], [88, 98, 78, 93, 83]
    alone = compare_values(base, now, "higher", 0.1)
    assert alone[3] == "regression" and alone[2] < 0
    change, low, high, verdict = compare_values(base, now, "higher", 0.1, checks=6)
    assert verdict == "within noise" and low < alone[1] and high > 0 and change == alone[0]
    # a clear regression stays one however many checks run
    assert compare_values([100, 101, 99], [80, 81, 79], "higher", 0.1, checks=50)[3] == "regression"
