"""`spectune report` on a real embedded-engine sweep: the answer first, every section, escaping in both files, the
tuning results once `spectune tune` has run, missing data, and the page as Chromium draws it."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from spectune.holdout import NONE_INSIDE
from spectune.report import write_report
from spectune.report.data import describe_policy
from spectune.report.render import code_span, fence, md_escape
from sweep_helpers import sweep_cmd, write_plan

PLAN = """
name = "rep"
workload = "{workload}"
batch_sizes = [1, 2]
repeats = 2
max_tokens = 8
min_prompts = 3
prompts_per_slot = 1
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
XSS = "<script>alert(1)</script> Repeat: a b c a b c"
SECTIONS = ["The answer", "Speedup vs batch size", "Latency: TTFT, TPOT and inter-chunk latency", "Output throughput",
            "Acceptance", "Memory per server", "Tuning: the tuned config", "Per speculative method", "Flagged cells",
            "Sample output", "Per cell (mean over repeats)", "What the metrics mean"]
# What tune writes under the CONTRACT's keys "deploy", "verdict" and "exhaustive" (written here by hand, so that
# this test does not depend on the stage that fills them).
DEPLOY = [
    {"engine": "sglang", "method": "eagle", "file": "/abs/tuned/adaptive_spec.json",
     "command": "python -m sglang.launch_server --model-path T --speculative-algorithm EAGLE --speculative-adaptive-config /abs/tuned/adaptive_spec.json",
     "note": "eagle: the fastest measured method"},
    {"engine": "vllm", "method": "ngram", "file": "/abs/tuned/vllm_speculative_config.json",
     "command": "vllm serve T --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 2}'",
     "note": "ngram: vLLM cannot load the embedded EAGLE head <head>"},
    {"engine": "llamacpp", "method": None, "file": None, "command": None, "note": "no equivalent of eagle in llama.cpp"},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("rep")
    workload = tmp / "xss.jsonl"
    prompts = [XSS, "plain | pipe text", "third prompt here"]
    workload.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp / "run"
    # measured only: the report's "not tuned yet" state (where the sweep tunes by default, --no-tune stops it)
    stop = ["--no-tune", "--no-report"] if "--no-tune" in subprocess.run(sweep_cmd("--help"), capture_output=True, text=True).stdout else []
    proc = subprocess.run(sweep_cmd(str(write_plan(tmp, PLAN.format(workload=workload))), "--out", str(out), *stop),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def tuned(run, tmp_path_factory) -> Path:
    """A copy of the run, tuned for real (2 trials: the study's start points), with the contract's deploy keys."""
    root = tmp_path_factory.mktemp("tuned") / "run"
    shutil.copytree(run, root)
    proc = subprocess.run([sys.executable, "-m", "spectune.cli", "tune", str(root), "--trials", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def _headings(text: str) -> list[str]:
    """The h2/h3 headings of the page, or the ##/### headings of the Markdown, in order."""
    found = re.findall(r"<h[23][^>]*>(.*?)</h[23]>", text) or re.findall(r"^#{2,3} (.+)$", text, re.M)
    assert found, "no headings"
    return found


def _section_positions(text: str) -> list[int]:
    headings = _headings(text)
    return [next(i for i, h in enumerate(headings) if h.startswith(s)) for s in SECTIONS]


def test_report_answers_first_escapes_in_both_files_and_says_how_to_tune(run, tmp_path, spectune_cmd):
    proc = subprocess.run([*spectune_cmd, "report", str(run), "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "r" / "report.html").read_text()
    md = (tmp_path / "r" / "report.md").read_text()
    # the <script> prompt is shown, never run: HTML-escaped in the page, backslash-escaped in Markdown (no entities)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>" not in md and r"\<script\>alert(1)\</script\>" in md
    assert not re.search(r"&(#x?[0-9a-fA-F]+|[a-z]+);", md), "Markdown must not show HTML entities"
    for text in (page, md):
        positions = _section_positions(text)
        assert positions == sorted(positions), f"sections out of order: {_headings(text)}"
        assert "Not tuned yet: run" in text
        assert "{'done'" not in text  # the status row is words, not a Python dict
    # the recommendation: one row per batch size, in the first table of both files
    first_table = md.split("## The answer", 1)[1].split("###", 1)[0]
    assert re.search(r"^\| 1 \|", first_table, re.M) and re.search(r"^\| 2 \|", first_table, re.M)
    # plots: inline in the page, files beside the Markdown, each linked
    pngs = sorted(p.stem for p in (tmp_path / "r").glob("*.png"))
    assert {"speedup", "latency", "throughput", "acceptance", "memory"} <= set(pngs) and "tuning" not in pngs
    assert page.count('src="data:image/png;base64,') == len(pngs)
    for stem in pngs:
        assert f"]({stem}.png)" in md
    # the per-method section: one entry per speculative method, with the throughput lost by a single g
    assert "### ngram" in md and "### eagle" in md
    assert re.search(r"Running g=\d at every batch size .* loses \d+\.\d% |One g for every batch size costs (almost )?nothing", md)
    assert "Only g=2 was measured" in md  # eagle has one g


def test_report_after_tune_includes_the_tuning_results(run, tuned, tmp_path, spectune_cmd):
    before = tmp_path / "before"
    write_report(run, before)
    proc = subprocess.run([*spectune_cmd, "report", str(tuned), "--out", str(tmp_path / "after")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    md_before, md = (before / "report.md").read_text(), (tmp_path / "after" / "report.md").read_text()
    assert md != md_before and "Not tuned yet" not in md.split("## Per speculative method")[0]
    tuning = json.loads((tuned / "tuned" / "tuning.json").read_text())
    section = md.split("## Tuning", 1)[1].split("## Per speculative method", 1)[0]
    for name in ("tuned adaptive", "best static g", "best g per batch size", "SGLang's default", "conservative preset",
                 "aggressive preset", "oracle"):
        assert name in section
    tuned_row = next(c for c in tuning["comparisons"] if c["name"] == "tuned_adaptive")
    assert f"{tuned_row['speedup']:.3f}×" in section and f"{tuned_row['speedup'] - 1:+.1%}" in section
    assert (tmp_path / "after" / "tuning.png").exists()
    # the cost model's held-out error, as tuning.json has it
    assert "The model on cells it did not see" in section and "one step count (g) left out" in section
    step = next(r for r in tuning["holdout"]["summary"] if r["holdout"] == "step_count" and r["method"] == "all")
    assert f"| {step['cells']} |" in section
    # and the noise floor beside it (repeats = 2): the error a model cannot go below
    assert f"Noise floor: {tuning['holdout']['noise_floor_pct']:.1f}%." in section
    # measured on one launch per server, the report says what the floor leaves out and how to put it in
    assert tuning["holdout"]["noise_floor_one_launch"] is True and "relaunch = true in the plan" in section
    # its command to add repeats names this run, not the RESULTS that tuning.json keeps
    assert "spectune sweep --resume RESULTS" not in section and "spectune sweep --resume " in section
    # two batch sizes: target-only's anchor has nothing to be smoothed over, and the report does not say it was
    assert tuning["holdout"]["anchor_smoothed"] is False and "smoothed over batch sizes" not in section
    # nor a batch size held out: leaving one of two would carry the other's draft terms over; the report says why
    assert not any(r["holdout"] == "batch_size" for r in tuning["holdout"]["summary"])
    assert "Leave one batch size out: not computed (no method measured at three batch sizes or more" in section
    # two step counts a method: each held-out g is its smallest or largest (extrapolated), and the report says so
    assert not any(r["holdout"] == "step_count_inside" for r in tuning["holdout"]["summary"])
    assert f"Leave one step count out, inside the measured range: {NONE_INSIDE}." in section


def test_report_shows_deploy_commands_verdict_and_exhaustive_from_tuning_json(tuned, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(tuned, root)
    path = root / "tuned" / "tuning.json"
    tuning = json.loads(path.read_text())
    tuning |= {"deploy": DEPLOY, "verdict": {"text": "tuned adaptive is better than SGLang's default by 4.1% [2.0, 6.2]", "source": "measured"},
               "exhaustive": {"best_speedup": 1.3, "search_share": 0.97, "oracle_share": 0.8, "text": "the search found 97% of the exhaustive best"},
               "holdout": tuning["holdout"] | {"anchor_smoothed": True},
               "unmeasured_steps": "the tuned config runs eagle at g = 1, which the sweep never measured (it measured g = 2, 4)"}
    path.write_text(json.dumps(tuning))
    page_path, md_path = write_report(root, tmp_path / "r")
    page, md = page_path.read_text(), md_path.read_text()
    answer_md = md.split("## Speedup vs batch size")[0]
    # commands verbatim in fenced blocks (a user copies them), escaped in HTML; every engine listed, even without one
    assert "```\n" + DEPLOY[0]["command"] + "\n```" in answer_md and "```\n" + DEPLOY[1]["command"] + "\n```" in answer_md
    assert "**llama.cpp**" in answer_md and "no equivalent of eagle in llama.cpp" in answer_md
    assert r"\<head\>" in answer_md
    assert "--speculative-config &#39;{&#34;method&#34;: &#34;ngram&#34;" in page and "&lt;head&gt;" in page
    assert "tuned adaptive is better than SGLang" in answer_md and "found 97% of the exhaustive best" in md
    # step counts the tuned config runs that the sweep never measured: named in the answer, under the verdict
    assert "Note: the tuned config runs eagle at g = 1, which the sweep never measured" in answer_md.split("### Deploy")[0]
    assert "Note: the tuned config runs eagle at g = 1, which the sweep never measured" in page.split("<h3>Deploy")[0]
    # a held-out error whose anchor was smoothed (four batch sizes or more) says so under it
    holdout = md.split("### The model on cells it did not see", 1)[1].split("##", 1)[0]
    assert "Here target-only's ms per token, which every prediction at its batch size starts from, is smoothed" in holdout
    assert "is smoothed over batch sizes" in page


def test_a_server_measured_alone_that_drafts_is_not_called_target_only(run, tmp_path):
    """`spectune bench` on a speculative server: the plan cannot know what it runs, its counters show it drafting.
    Cells edited by hand to that state (the bench run itself: tests/test_bench.py)."""
    alone = tmp_path / "alone"
    shutil.copytree(run, alone)
    for p in [*alone.glob("cells/*.json")]:
        cell = json.loads(p.read_text())
        if cell["is_speculative"]:
            p.unlink()
        else:
            p.write_text(json.dumps(cell | {"num_drafts": 40.0, "acceptance_rate": 0.5, "acceptance_length": 2.0}))
    (alone / "cells.parquet").unlink()
    page, md = (p.read_text() for p in write_report(alone, tmp_path / "r"))
    answer = md.split("## Speedup vs batch size")[0]
    assert "Nothing to compare: target drafted tokens (acceptance rate 0.50), and no target-only server ran beside it" in answer
    assert "| 2 | nothing to compare: the server speculates | – | – | 0.5 | 2 | target |" in answer
    assert "Only target-only servers were measured" not in answer and "target-only (no speculation)" not in answer
    # nothing a tune could fit, so the report does not send the user to run one
    assert "Not tuned yet" not in md and "Nothing to tune: tuning needs static speculative servers" in answer
    assert "No acceptance figures" not in md and "Nothing to compare: target drafted tokens" in page


def test_report_survives_missing_data(run, tmp_path):
    """Pieces removed from or added to a copy of a real run: by hand, to reach the states a run can be in."""
    # target-only: no speculative server, no tuning
    only_target = tmp_path / "only-target"
    shutil.copytree(run, only_target)
    for p in [*only_target.glob("cells/ngram*"), *only_target.glob("cells/eagle*")]:
        p.unlink()
    page, md = (p.read_text() for p in write_report(only_target, tmp_path / "r1"))
    assert "No speedup to plot" in page and "No static speculative servers measured" in md
    assert not (tmp_path / "r1" / "speedup.png").exists() and (tmp_path / "r1" / "throughput.png").exists()
    # one repeat, a failed cell (marked by hand: a real failure cannot be had on demand here), columns other
    # helpers add (goodput, queue delay), and a tuning.json with none of the keys the report reads
    mixed = tmp_path / "mixed"
    shutil.copytree(run, mixed)
    for p in mixed.glob("cells/*__r1.json"):
        p.unlink()
    failed = mixed / "cells" / "eagle__bs2__r0.json"
    row = json.loads(failed.read_text()) | {"status": "failed", "error": "server exited during the cell; last log lines: <boom>"}
    failed.write_text(json.dumps(row))
    for p in mixed.glob("cells/target__*.json"):
        p.write_text(json.dumps(json.loads(p.read_text()) | {"goodput_rps": 12.5, "queue_delay_ms_p50": 0.4}))
    (mixed / "tuned").mkdir()
    (mixed / "tuned" / "tuning.json").write_text("{}")
    page, md = (p.read_text() for p in write_report(mixed, tmp_path / "r2"))
    assert "one repeat per cell: no confidence intervals" in md
    flagged = md.split("### Flagged cells", 1)[1].split("###", 1)[0]
    assert "eagle" in flagged and r"server exited during the cell; last log lines: \<boom\>" in flagged
    assert "goodput (req/s)" in md and "queue delay p50 (ms)" in md and "- `goodput_rps`" in md
    assert "Method tuned: **unknown**" in md
    # every cell failed (an attached llama-server that refuses to erase its slots fails them all): the report is
    # written (it stopped on a KeyError) and says so
    failed = tmp_path / "all-failed"
    shutil.copytree(run, failed)
    for p in failed.glob("cells/*.json"):
        p.write_text(json.dumps(json.loads(p.read_text()) | {"status": "failed", "error": "refused to erase slot 0"}))
    (failed / "cells.parquet").unlink()
    page, md = (p.read_text() for p in write_report(failed, tmp_path / "r3"))
    cells = len(list(failed.glob("cells/*.json")))
    assert f"**No cell finished: all {cells} failed or were cut short; their causes are under Details, Flagged cells.**" in md
    assert md.count("No finished cell to plot.") == 2 and "No finished cell to plot." in page
    assert "Nothing to tune" in md and "Not tuned yet" not in md
    # adaptive servers only beside target-only (marked by hand): speedups, but nothing spectune tune can fit
    adaptive = tmp_path / "adaptive-only"
    shutil.copytree(run, adaptive)
    for p in adaptive.glob("cells/*.json"):
        cell = json.loads(p.read_text())
        if cell["is_speculative"]:
            p.write_text(json.dumps(cell | {"adaptive_config": "/abs/adaptive_spec.json"}))
    (adaptive / "cells.parquet").unlink()
    page, md = (p.read_text() for p in write_report(adaptive, tmp_path / "r4"))
    assert "Nothing to tune: tuning needs static speculative servers" in md and "Not tuned yet" not in md


def test_report_with_two_target_only_servers_compares_with_the_plans_first(run, tmp_path):
    """A second target-only server added by hand to a copy of a real run (its cells: target's, half as fast), listed
    first in the plan: speedups are over it, and the report says so."""
    two = tmp_path / "two"
    shutil.copytree(run, two)
    for p in two.glob("cells/target__*.json"):
        row = json.loads(p.read_text())
        row |= {"server": "target-b", "cell": row["cell"].replace("target", "target-b", 1),
                "output_throughput_tps": row["output_throughput_tps"] / 2}
        (p.parent / p.name.replace("target", "target-b", 1)).write_text(json.dumps(row))
    manifest = json.loads((two / "run.json").read_text())
    manifest["plan"]["servers"].insert(0, {"name": "target-b", "engine": "embedded"})
    (two / "run.json").write_text(json.dumps(manifest))
    _, md = (p.read_text() for p in write_report(two, tmp_path / "r"))
    assert "speedups are over target-b, the plan's first target-only server" in md and "(target)" in md
    assert "speedups not computed" not in md


def test_markdown_escaping_and_code():
    assert md_escape("<script>a|b</script> & *x* [l](u) `c`") == r"\<script\>a\|b\</script\> \& \*x\* \[l\](u) \`c\`"
    assert md_escape("two\nlines") == "two lines"
    assert code_span("a `b` c") == "``a `b` c``" and code_span("plain") == "`plain`"
    assert fence("x ``` y") == "````\nx ``` y\n````"
    assert describe_policy({"1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0, 1]}}, "?") == "bs ≥ 1: g in {1, 3}; bs ≥ 8: g in {0, 1}"
    assert describe_policy({"schedule": [[1, 7, 2], [8, 8, 0]]}, "?") == "bs 1–7: g=2; bs ≥ 8: g=0"


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.sources.append(dict(attrs).get("src", ""))


def _distinct_colours(png: bytes) -> int:
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    return len(np.unique(pixels, axis=0))


def test_report_renders_in_headless_chromium_with_every_plot_drawn(tuned, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (scripts/test.sh installs it with apt-get when run as root)")
    page_path, _ = write_report(tuned, tmp_path / "r")
    images = _Images()
    images.feed(page_path.read_text())
    plots = sorted(p.stem for p in (tmp_path / "r").glob("*.png"))
    assert len(images.sources) == len(plots) == 6  # speedup, latency, throughput, acceptance, memory, tuning
    for src in images.sources:
        assert src.startswith("data:image/png;base64,")
        assert _distinct_colours(base64.b64decode(src.split(",", 1)[1])) > 16  # a drawn plot, not a blank image
    shot = tmp_path / "screenshot.png"
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}",
                           "--window-size=1280,4000", page_path.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    assert _distinct_colours(shot.read_bytes()) > 200  # text, header band and plots drawn, not a blank page
