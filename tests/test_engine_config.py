"""Engine configuration: vLLM-named speculative config validation, step tables, EOS handling, CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_models import bigram_target

from spectune.engine.config import EngineConfig, SpeculativeConfig
from spectune.engine.engine import LLMEngine
from spectune.engine.scheduler import BatchSizeSteps, SamplingParams
from spectune.errors import SpectuneError

torch.set_num_threads(1)


def test_ngram_lookup_defaults_follow_vllm():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').prompt_lookup_min == 5
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    draft = SpeculativeConfig.parse({"model": "/some/dir", "num_speculative_tokens": 2})  # method inferred, as vLLM does
    assert draft.method == "draft_model" and draft.model == Path("/some/dir")


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("{not json", "not valid JSON"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "typo_key": 1}', "unknown key(s) typo_key"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min=4"),
        ('{"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 2}', "ngram only"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}', "draft_model, eagle, dflash only"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]}', "start at batch size 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 1], [3, 8, 0]]}', "overlap"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, -1]]}', "k >= 0"),
    ],
)
def test_bad_speculative_config_is_one_clear_error(raw, needle):
    with pytest.raises(SpectuneError) as info:
        SpeculativeConfig.parse(raw)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_batch_size_table_carries_k_over_gaps_and_caps_it():
    table = BatchSizeSteps.build(((1, 2, 5), (5, 6, 1)), max_batch_size=8, max_k=3)
    assert [table.steps_for_batch(bs) for bs in range(1, 9)] == [3, 3, 3, 3, 1, 1, 1, 1]


def test_eos_inside_accepted_drafts_stops_exactly_like_target_only(tmp_path):
    """EOS is a token of the bigram target's walk, so n-gram drafts run through it; output must stop right there."""
    model = bigram_target(tmp_path / "bigram", 64)
    walk = LLMEngine(EngineConfig(model=model)).generate([[7, 9]], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)])[0]
    eos = walk[-3]  # inside the repeating cycle, and not its first occurrence's position only
    raw = json.loads((model / "config.json").read_text())
    raw["eos_token_id"] = eos
    (model / "config.json").write_text(json.dumps(raw))
    prompt = [7, 9] + walk[:20]  # long enough to contain the cycle: the n-gram proposer drafts from the start
    params = [SamplingParams(max_tokens=30, temperature=0)]
    plain = LLMEngine(EngineConfig(model=model)).generate([prompt], params)[0]
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 2})
    e = LLMEngine(EngineConfig(model=model, speculative=spec))
    got = e.generate([prompt], params)[0]
    assert got == plain and got[-1] == eos and eos not in got[:-1]
    assert e.metrics.num_accepted_tokens > 0


def test_engine_config_rejects_adaptive_without_speculation(tmp_path):
    config = tmp_path / "a.json"
    config.write_text('{"1": {"candidate_steps": [1, 3]}}')
    with pytest.raises(SpectuneError, match="needs --speculative-config"):
        EngineConfig(adaptive_config=config)
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(SpectuneError, match="not found"):
        EngineConfig(speculative=spec, adaptive_config=tmp_path / "missing.json")


def test_cli_serve_bad_config_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spectune.cli", "serve", "--model", str(tmp_path), "--speculative-config", '{"method": "ngram", "k": 3}'],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown key(s) k" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = subprocess.run([sys.executable, "-m", "spectune.cli", "serve", "--model", str(tmp_path / "none"), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "config.json" in proc.stderr
