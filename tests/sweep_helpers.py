"""Shared by the sweep tests: small plans on the embedded engine, and watching a sweep from outside."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

SMALL_PLAN = """
name = "small"
workload = "quote"
batch_sizes = [1, 3]
repeats = 1
max_tokens = 12
prompts_per_slot = 2
min_prompts = 4
warmup_per_slot = 0

[[servers]]
name = "target"

[[servers]]
name = "draft"
method = "draft_model"
num_speculative_tokens = 2

[[servers]]
name = "ngram"
method = "ngram"
num_speculative_tokens = 2
prompt_lookup_min = 1
prompt_lookup_max = 3
"""

# target-only and n-gram at g = 2, batch 1 and 2, 8 tokens: four cells of a few seconds
TINY_NGRAM_PLAN = """
name = "tiny"
workload = "code"
batch_sizes = [1, 2]
repeats = 1
max_tokens = 8
prompts_per_slot = 1
min_prompts = 2
warmup_per_slot = 0

[[servers]]
name = "target"
engine = "embedded"

[[servers]]
name = "ngram"
engine = "embedded"
method = "ngram"
num_speculative_tokens = [2]
prompt_lookup_min = 1
prompt_lookup_max = 2
"""


def write_plan(tmp_path: Path, text: str = SMALL_PLAN) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(text)
    return path


def sweep_cmd(*args: str, stages: bool = False) -> list[str]:
    """`spectune sweep`, measuring only (--no-tune --no-report) unless `stages`: the measurement tests leave the
    later stages to the tests of the pipeline (tests/test_pipeline.py)."""
    return [sys.executable, "-m", "spectune.cli", "sweep", *args, *(() if stages else ("--no-tune", "--no-report"))]


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    """Poll until predicate() is truthy (returns it); fail if the sweep process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"sweep exited with {proc.returncode} before: {what}\n{proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {what}")


def finished_cells(root: Path) -> dict[str, dict]:
    out = {}
    for p in (root / "cells").glob("*.json"):
        out[p.stem] = json.loads(p.read_text())
    return out


def server_processes(root: Path) -> list[psutil.Process]:
    """Engine processes launched for this results dir (their round-log path names it)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if " serve " in cmd and str(root) in cmd:
            found.append(proc)
    return found
