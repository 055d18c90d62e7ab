"""`spectune tune` on a real (tiny) embedded-engine sweep, through the CLI: the files, every comparison, a tuned
config that SGLang's own loader reads, and an embedded server that runs with it. Behaviour, not timings."""

from __future__ import annotations

import json
import math
import subprocess

import pandas as pd

from sglang_compat import sglang_adaptive_module
from spectune.adaptive import AdaptiveConfig
from spectune.emit import sglang_launch_steps
from sweep_helpers import sweep_cmd, write_plan

COMPARISONS = {"best_static", "best_per_batch_schedule", "sglang_default", "conservative", "aggressive", "oracle", "tuned_adaptive"}

TINY_PLAN = """
name = "tiny-ngram"
workload = "quote"
batch_sizes = [1, 2]
repeats = 1
max_tokens = 16
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
"""

ADAPTIVE_PLAN = """
name = "tiny-adaptive"
workload = "quote"
batch_sizes = [2]
repeats = 1
max_tokens = 16
prompts_per_slot = 2
min_prompts = 4
warmup_per_slot = 0

[[servers]]
name = "target"

[[servers]]
name = "tuned"
method = "ngram"
adaptive_config = "{config}"
prompt_lookup_min = 1
prompt_lookup_max = 3
"""


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_tune_on_an_embedded_sweep_writes_configs_sglang_loads_and_the_engine_runs(tmp_path, spectune_cmd):
    sweep_dir = tmp_path / "sweep"
    run(sweep_cmd(str(write_plan(tmp_path, TINY_PLAN)), "--out", str(sweep_dir)))
    run([*spectune_cmd, "tune", str(sweep_dir), "--method", "ngram", "--trials", "10"])

    tuned = sweep_dir / "tuned"
    assert {p.name for p in tuned.iterdir()} >= {"adaptive_spec.json", "tuning.json", "vllm_speculative_config.json", "llamacpp_flags.txt"}
    report = json.loads((tuned / "tuning.json").read_text())
    assert report["engine"] == "embedded" and report["method"] == "ngram"
    assert {row["batch_size"] for row in report["cost_fit"]} == {1, 2}
    assert report["traces"][0]["name"] == "ngram-g2"  # the largest static g's round log
    scores = {c["name"]: c["speedup"] for c in report["comparisons"]}
    assert set(scores) >= COMPARISONS
    # before any measured confirmation the verdict is the simulation's, labelled so; the grid bounds the search
    assert report["verdict"]["source"] == "simulated" and "spectune confirm" in report["verdict"]["text"]
    assert report["exhaustive"]["best_speedup"] >= scores["tuned_adaptive"] - 1e-12
    assert all(math.isfinite(s) and s > 0 for s in scores.values()), scores
    # The study starts from the best static g >= 1 and the best schedule (when it speculates at all), so
    # tuning never ends below either, however few the trials.
    floor = [s for g, s in report["policies"]["static_speedups"].items() if int(g) > 0]
    if any(report["policies"]["best_per_batch_schedule"]["best_steps_by_batch_size"].values()):
        floor.append(scores["best_per_batch_schedule"])
    assert scores["tuned_adaptive"] >= max(floor) * (1 - 1e-9)
    assert report["study"]["complete"] == 10

    config_path = tuned / "adaptive_spec.json"
    run([*spectune_cmd, "validate-config", str(config_path), "--engine", "sglang"])
    cfg = AdaptiveConfig.from_file(config_path)
    sglang = sglang_adaptive_module()
    _, entries = sglang._load_adaptive_config(str(config_path))
    assert sorted(entries) == sorted(cfg.slots)
    launch = sglang_launch_steps(cfg)
    assert launch in sglang.resolve_candidate_steps_from_config(str(config_path))  # SGLang's launch check
    params = sglang.AdaptiveSpeculativeParams(initial_steps=launch, cfg_path=str(config_path))
    assert {bound: slot.candidate_steps for bound, slot in params._slots.items()} == {b: s.candidate_steps for b, s in cfg.slots.items()}

    # The embedded engine serves with the tuned config, through a sweep cell, losslessly.
    run_dir = tmp_path / "adaptive-run"
    (tmp_path / "adaptive-plan").mkdir()
    plan = write_plan(tmp_path / "adaptive-plan", ADAPTIVE_PLAN.format(config=config_path))
    run(sweep_cmd(str(plan), "--out", str(run_dir)))
    cells = pd.read_parquet(run_dir / "cells.parquet").set_index("server")
    assert (cells["status"] == "ok").all()
    assert cells.loc["tuned", "adaptive_config"] == str(config_path)
    union = {s for slot in cfg.slots.values() for s in slot.candidate_steps}
    assert int(cells.loc["tuned", "live_num_steps"]) in union
    requests = pd.read_parquet(run_dir / "requests.parquet")
    requests["server"] = requests["cell"].str.split("__").str[0]
    texts = requests.pivot_table(index="index", columns="server", values="text", aggfunc="first")
    assert (texts["tuned"] == texts["target"]).all()
