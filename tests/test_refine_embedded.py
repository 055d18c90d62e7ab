"""`spectune tune --refine` end to end on the real embedded engine: a closed-loop sweep at two batch sizes, a tune,
a confirm to its cap, then the refined config (the best measured slots per batch size) written as the deployable
config and measured again by `spectune confirm` on new passes (RESULTS/confirm-2), never on the ones it was chosen on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from spectune.adaptive import AdaptiveConfig
from spectune.emit import never_drafts
from spectune.refine import choose_slots, merge_slots, slot_sources
from sweep_helpers import sweep_cmd

PLAN = """
name = "refine-fit"
workload = "phase"
batch_sizes = [1, 4]
repeats = 1
max_tokens = 12
prompts_per_slot = 2
min_prompts = 8
warmup_per_slot = 1

[[servers]]
name = "target"

[[servers]]
name = "ngram"
method = "ngram"
num_speculative_tokens = [1, 3]
prompt_lookup_min = 1
prompt_lookup_max = 4
"""


def _run(cmd: list[str], ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_refine_keeps_the_best_measured_slot_per_batch_size_and_measures_it_on_new_passes(tmp_path):
    cli = sweep_cmd(stages=True)[:-1]  # python -m spectune.cli
    run = tmp_path / "run"
    (tmp_path / "plan.toml").write_text(PLAN)
    _run(sweep_cmd(str(tmp_path / "plan.toml"), "--out", str(run)))
    _run([*cli, "tune", str(run), "--method", "ngram", "--trials", "5", "--no-exhaustive"])
    early = _run([*cli, "tune", str(run), "--refine", "--no-exhaustive"], ok=False)
    assert early.returncode == 2 and "no measured verdict" in early.stderr + early.stdout  # nothing measured yet
    # the pass-rejection rules are confirm's own tests' business: here every pass counts
    confirm = [*cli, "confirm", str(run), "--max-passes", "2", "--min-passes", "2", "--max-slowdown", "100", "--max-foreign-cores", "100"]
    _run(confirm)
    first_passes = sorted(p.name for p in (run / "confirm").glob("pass-*"))
    tuned_dir = run / "tuned"
    before = json.loads((tuned_dir / "tuning.json").read_text())
    verdict = before["verdict"]
    assert verdict["source"] == "measured" and verdict["finished"] and [r["batch_size"] for r in verdict["by_batch_size"]] == [1, 4]
    choices = choose_slots(verdict["by_batch_size"])
    refined = _run([*cli, "tune", str(run), "--refine", "--no-exhaustive"], ok=False)
    tuned = AdaptiveConfig.from_dict(before["policies"]["tuned_adaptive"])
    expected = merge_slots(choices, slot_sources(tuned, int(before["policies"]["best_static"]["steps"])))
    # one config best everywhere, the winners' slots already the tuned ones (e.g. tuned runs the static g there), or no slot drafts
    if len({c.kept for c in choices}) == 1 or expected.to_dict() == tuned.to_dict() or never_drafts(expected):
        assert refined.returncode == 2 and ("nothing to" in refined.stderr or "never draft" in refined.stderr), refined.stderr
        assert json.loads((tuned_dir / "tuning.json").read_text()) == before  # nothing rewritten
        return
    assert refined.returncode == 0, refined.stdout[-3000:] + refined.stderr[-3000:]
    after = json.loads((tuned_dir / "tuning.json").read_text())
    deployed = json.loads((tuned_dir / "adaptive_spec.json").read_text())
    assert AdaptiveConfig.from_dict(deployed).to_dict() == expected.to_dict() == after["policies"]["tuned_adaptive"]
    assert after["refined"]["round"] == 2 and [c["kept"] for c in after["refined"]["slots_kept"]] == [c.kept for c in choices]
    assert after["verdict"]["source"] == "simulated"  # chosen on the measured passes: not measured until new ones
    assert json.loads((tuned_dir / "round-1" / "adaptive_spec.json").read_text()) == before["policies"]["tuned_adaptive"]
    assert "refined (round 2" in refined.stdout
    _run(confirm)
    assert sorted(p.name for p in (run / "confirm").glob("pass-*")) == first_passes  # the first round's passes untouched
    assert json.loads((run / "confirm-2" / "tuned-adaptive.json").read_text()) == deployed
    second = json.loads((tuned_dir / "tuning.json").read_text())["verdict"]
    assert second["source"] == "measured" and second["confirm_dir"] == str(run / "confirm-2")
    assert second["passes"] == 2 and sorted(p.name for p in (run / "confirm-2").glob("pass-*")) == ["pass-01", "pass-02"]
