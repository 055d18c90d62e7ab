"""The engine's Llama matches transformers' LlamaForCausalLM on the same weights, with and without its KV cache."""

from __future__ import annotations

import pytest
import torch
from engine_models import llama

from spectune.engine.model import ModelConfig, load_model
from spectune.errors import SpectuneError

torch.set_num_threads(1)  # two busy shared cores: more threads only spin
VOCAB = 96


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tie=False, kv_heads=2),  # GQA, separate lm_head
        dict(tie=True, kv_heads=4, rope_theta=500000.0),  # tied embeddings, MHA, another rope_theta
        dict(tie=False, kv_heads=1, dtype=torch.bfloat16),  # a bf16 checkpoint is computed in fp32
    ],
    ids=["gqa", "tied", "bf16"],
)
def test_logits_match_transformers(tmp_path, kwargs):
    path = llama(tmp_path / "m", VOCAB, **kwargs)
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(path, ids)
    model = load_model(path)
    cache = model.new_cache(num_slots=3)
    with torch.inference_mode():
        got = model.logits(model.forward(ids, [0, 1, 2], cache))
    assert expected.abs().max() > 0.1  # not a degenerate all-zero comparison
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_cached_ragged_decode_and_rollback_match_full_forward(tmp_path):
    """Rows of different lengths in odd slots, appended several tokens at a time, with rejected tokens rolled back."""
    path = llama(tmp_path / "m", VOCAB)
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(2))
    expected = hf_logits(path, ids)
    model = load_model(path)
    cache = model.new_cache(num_slots=5)
    slots = [4, 1, 2]  # not a contiguous run: exercises the gathered (not viewed) cache read
    with torch.inference_mode():
        # ragged prefill: 6, 3 and 9 prompt tokens, padded to 9
        got = model.logits(model.forward(ids[:, :9], slots, cache, num_new=[6, 3, 9]))
        for row, n in enumerate([6, 3, 9]):
            torch.testing.assert_close(got[row, :n], expected[row, :n], atol=1e-4, rtol=1e-4)
        assert [cache.lengths[s] for s in slots] == [6, 3, 9]
        # append 4 tokens to every row (a verify of 3 drafts), then roll two of them back on row 0
        chunk = torch.stack([ids[0, 6:10], ids[1, 3:7], ids[2, 9:13]])
        got = model.logits(model.forward(chunk, slots, cache))
        torch.testing.assert_close(got[0], expected[0, 6:10], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], expected[1, 3:7], atol=1e-4, rtol=1e-4)
        cache.lengths[4] = 8  # keep 8 of row 0's 10 positions
        got = model.logits(model.forward(ids[:1, 8:12], [4], cache))  # batch-1 path writes over the rolled-back part
        torch.testing.assert_close(got[0], expected[0, 8:12], atol=1e-4, rtol=1e-4)
        got = model.logits(model.forward(ids[:1, 12:13], [4], cache))  # batch-1, one token: the decode fast path
        torch.testing.assert_close(got[0], expected[0, 12:13], atol=1e-4, rtol=1e-4)
    assert cache.lengths[4] == 13


def test_config_reads_rope_theta_both_spellings_and_rejects_rope_scaling(tmp_path):
    import json

    path = llama(tmp_path / "m", VOCAB, rope_theta=1234.0)
    raw = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_dir(path).rope_theta == 1234.0
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 4321.0  # transformers 4.x spelling
    (path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(path).rope_theta == 4321.0
    raw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(SpectuneError, match="RoPE scaling"):
        ModelConfig.from_dir(path)
    with pytest.raises(SpectuneError, match="config.json"):
        ModelConfig.from_dir(tmp_path / "nowhere")
