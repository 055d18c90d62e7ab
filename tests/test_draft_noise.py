"""`draft_noise`: a draft of controllable acceptance (the shipped target plus relative noise), from a plan or
`spectune serve --draft-noise`, launched for real."""

from __future__ import annotations

import subprocess
import sys

import pytest
from engine_fixtures import stream_completion

from spectune.errors import SpectuneError
from spectune.plan import load_plan
from spectune.servers import make_server

PLAN = """
name = "noise"
workload = "code"
batch_sizes = [1]

[[servers]]
name = "target"

[[servers]]
name = "noisy"
method = "draft_model"
num_speculative_tokens = 3
draft_noise = {noise}
"""


def _plan(tmp_path, noise: str, extra: str = ""):
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.format(noise=noise) + extra)
    return load_plan(path)


def _acceptance(tmp_path, noise: float) -> float:
    spec = _plan(tmp_path, str(noise)).servers[1]
    server = make_server(spec, tmp_path / f"logs-{noise}")
    try:
        server.start()
        before = server.scrape()
        for prompt in ("def mean(xs):\n    return", "import os\n\nclass Path:", "for i in range(10):\n    print("):
            stream_completion(server.base_url, server.model_name, prompt, max_tokens=24)
        after = server.scrape()
    finally:
        server.stop()
    return (after.num_accepted_tokens - before.num_accepted_tokens) / (after.num_draft_tokens - before.num_draft_tokens)


def test_draft_noise_sets_the_acceptance_level(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path / "cache"))  # the noisy copies are made here, on first use
    exact, noisy = _acceptance(tmp_path, 0.0), _acceptance(tmp_path, 0.5)
    assert exact == 1.0  # the target itself as draft
    assert noisy < 0.9
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "cache" / "models").iterdir()) == ["0", "0.5"]


@pytest.mark.parametrize(
    "noise, extra, message",
    [
        ("-0.1", "", "draft_noise = -0.1: must be a number >= 0"),
        ('"high"', "", "must be a number >= 0"),
        ("0.1", 'draft_model = "/some/dir"\n', "no draft_model"),
    ],
)
def test_bad_draft_noise_names_the_key(tmp_path, noise, extra, message):
    with pytest.raises(SpectuneError, match=message):
        _plan(tmp_path, noise, extra)


def test_draft_noise_with_another_method_is_refused(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.format(noise="0.1").replace('method = "draft_model"', 'method = "eagle"'))
    with pytest.raises(SpectuneError, match=r"servers\[1\].draft_noise: applies to engine"):
        load_plan(path)


def test_serve_draft_noise_without_draft_model_is_one_clear_error():
    done = subprocess.run([sys.executable, "-m", "spectune.cli", "serve", "--draft-noise", "0.1", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 2}'], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --draft-noise: needs --speculative-config with method draft_model and no model (it makes the draft from the shipped target)"]


def test_serve_negative_draft_noise_names_the_flag():
    done = subprocess.run([sys.executable, "-m", "spectune.cli", "serve", "--draft-noise", "-0.5", "--speculative-config",
                           '{"method": "draft_model", "num_speculative_tokens": 2}'], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: --draft-noise: -0.5 is negative; use a relative noise scale >= 0, e.g. 0.05"]
