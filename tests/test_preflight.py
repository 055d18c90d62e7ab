"""Bad input caught before anything launches: one line naming file and field, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

from spectune.engine import shipped
from spectune.tokenizer_check import SAMPLE


def _sweep(spectune_cmd, plan_text: str, tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text)
    out = tmp_path / "run"
    proc = subprocess.run([*spectune_cmd, "sweep", str(plan), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not out.exists()
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    return lines[0]


def test_adaptive_config_sglang_would_crash_on_is_refused(tmp_path, spectune_cmd):
    bad = tmp_path / "adaptive_spec.json"
    bad.write_text(json.dumps({"1": {"candidate_steps": [1, 3], "update_interval": 0}}))
    line = _sweep(spectune_cmd, f'[[servers]]\nname = "t"\n[[servers]]\nname = "a"\nmethod = "draft_model"\nadaptive_config = "{bad}"\n', tmp_path)
    assert str(bad) in line and "update_interval" in line


def test_sglang_adaptive_with_topk_above_1_is_refused(tmp_path, spectune_cmd):
    good = tmp_path / "adaptive_spec.json"
    good.write_text(json.dumps({"1": {"candidate_steps": [1, 3]}}))
    plan = (f'[[servers]]\nname = "t"\nengine = "sglang"\nmodel = "m"\n[[servers]]\nname = "s"\nengine = "sglang"\nmodel = "m"\n'
            f'method = "eagle"\ndraft_model = "d"\nnum_speculative_tokens = 3\nadaptive_config = "{good}"\n'
            'extra_args = ["--speculative-eagle-topk", "4"]\n')
    line = _sweep(spectune_cmd, plan, tmp_path)
    assert "topk" in line and "'s'" in line


def _copy_draft(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(shipped.draft_path(), draft)
    return draft


def test_draft_with_another_vocab_size_is_refused(tmp_path, spectune_cmd):
    draft = _copy_draft(tmp_path)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] * 2}))
    line = _sweep(spectune_cmd, f'[[servers]]\nname = "t"\n[[servers]]\nname = "d"\nmethod = "draft_model"\n'
                                f'draft_model = "{draft}"\nnum_speculative_tokens = 2\n', tmp_path)
    assert "vocab size" in line and str(draft) in line


def test_draft_whose_tokenizer_maps_text_differently_is_refused(tmp_path, spectune_cmd):
    from tokenizers import Tokenizer

    draft = _copy_draft(tmp_path)
    ids = Tokenizer.from_file(str(draft / "tokenizer.json")).encode(SAMPLE).ids
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    by_id = {v: k for k, v in vocab.items()}
    a, b = by_id[ids[0]], by_id[next(i for i in ids if i != ids[0])]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two tokens swapped: a different tokenizer
    (draft / "tokenizer.json").write_text(json.dumps(data))
    line = _sweep(spectune_cmd, f'[[servers]]\nname = "t"\n[[servers]]\nname = "d"\nmethod = "draft_model"\n'
                                f'draft_model = "{draft}"\nnum_speculative_tokens = 2\n', tmp_path)
    assert "tokenizes sample text differently" in line


def test_port_in_use_is_refused_before_launch(tmp_path, spectune_cmd):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = _sweep(spectune_cmd, f'[[servers]]\nname = "t"\nport = {port}\n', tmp_path)
    assert f"127.0.0.1:{port}" in line and "in use" in line


def test_workload_with_a_bad_line_is_refused(tmp_path, spectune_cmd):
    bad = tmp_path / "w.jsonl"
    bad.write_text('{"prompt": "hello"}\n{"prompt": "x", "max_tokens": "ten"}\n')
    line = _sweep(spectune_cmd, f'workload = "{bad}"\n[[servers]]\nname = "t"\n', tmp_path)
    assert f"{bad}:2" in line and "max_tokens" in line
