"""What each adapter launches, and the mistakes caught before anything launches (no engine needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from spectune.errors import SpectuneError
from spectune.servers import make_server
from spectune.servers.base import ServerSpec
from spectune.servers.llamacpp import CTX_PER_SLOT
from spectune.servers.sglang import speculative_args


def _spec(engine: str, **fields) -> ServerSpec:
    return ServerSpec(name="s", engine=engine, model="/models/target", **fields)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_unknown_engine_lists_the_valid_ones(tmp_path):
    with pytest.raises(SpectuneError, match=r"unknown engine 'tgi'; use one of \['embedded', 'llamacpp', 'openai', 'sglang', 'vllm'\]"):
        make_server(ServerSpec(name="s", engine="tgi"), tmp_path)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 3, "draft_model": "/d"},
         {"method": "draft_model", "num_speculative_tokens": 3, "model": "/d"}),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
         {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
        ({"method": "suffix", "num_speculative_tokens": 8}, {"method": "suffix", "num_speculative_tokens": 8}),
        ({"method": "standalone", "num_speculative_tokens": 2, "draft_model": "/d"},
         {"method": "draft_model", "num_speculative_tokens": 2, "model": "/d"}),
        ({"method": "eagle3", "num_speculative_tokens": 4, "draft_model": "/e", "per_batch_size": ((1, 8, 4), (9, 64, 1))},
         {"method": "eagle3", "num_speculative_tokens": 4, "model": "/e",
          "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 1]]}),
    ],
)  # fmt: skip
def test_vllm_speculative_config_has_only_the_methods_keys(tmp_path, fields, expected):
    argv = make_server(_spec("vllm", **fields), tmp_path, max_batch_size=16).command(8000)
    assert json.loads(_flag(argv, "--speculative-config")) == expected
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert (_flag(argv, "--served-model-name"), _flag(argv, "--port"), _flag(argv, "--max-num-seqs")) == ("s", "8000", "16")


def test_vllm_target_only_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("SPECTUNE_VLLM_PYTHON", "/opt/vllm/bin/python")
    server = make_server(_spec("vllm", extra_args=("--max-num-seqs", "4"), env=(("VLLM_CPU_KVCACHE_SPACE", "2"),)), tmp_path, max_batch_size=16)
    argv = server.command(8000)
    assert argv[0] == "/opt/vllm/bin/python"
    assert "--speculative-config" not in argv
    assert argv.count("--max-num-seqs") == 1 and _flag(argv, "--max-num-seqs") == "4"  # the user's wins
    env = server.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # mounts POST /reset_prefix_cache
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # spec.env wins over the CPU default


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 3}, "model is missing"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min = 5 must be <="),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "medusa2", "num_speculative_tokens": 3}, "must be one of"),
        ({"method": "eagle", "num_speculative_tokens": 2, "draft_model": "/e", "per_batch_size": ((2, 8, 2),)}, "must start at batch size 1"),
        ({"method": "eagle", "num_speculative_tokens": 2, "draft_model": "/e", "adaptive_config": "/a.json"}, "adaptive_config is SGLang's"),
    ],
)  # fmt: skip
def test_vllm_rejects_bad_specs_naming_the_server(tmp_path, fields, message):
    with pytest.raises(SpectuneError, match=message) as err:
        make_server(_spec("vllm", **fields), tmp_path).command(8000)
    assert "server 's'" in str(err.value)


def test_sglang_static_flags(tmp_path):
    argv = make_server(_spec("sglang", method="eagle3", num_speculative_tokens=3, draft_model="/e"), tmp_path, max_batch_size=32).command(9000)
    assert argv[1:5] == ["-m", "sglang.launch_server", "--model-path", "/models/target"]
    assert _flag(argv, "--speculative-algorithm") == "EAGLE3"
    assert (_flag(argv, "--speculative-num-steps"), _flag(argv, "--speculative-eagle-topk")) == ("3", "1")
    assert _flag(argv, "--speculative-num-draft-tokens") == "4"
    assert _flag(argv, "--speculative-draft-model-path") == "/e"
    assert "--enable-metrics" in argv and _flag(argv, "--max-running-requests") == "32"
    assert "--speculative-adaptive" not in argv


def test_sglang_user_topk_sizes_its_own_tree():
    args = speculative_args(_spec("sglang", method="eagle", num_speculative_tokens=3, draft_model="/e",
                                  extra_args=("--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8")))
    assert "--speculative-eagle-topk" not in args and "--speculative-num-draft-tokens" not in args


def test_sglang_ngram_takes_no_draft_path():
    args = speculative_args(_spec("sglang", method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert args == ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]


def _adaptive_file(tmp_path: Path, slots: dict) -> str:
    path = tmp_path / "adaptive_spec.json"
    path.write_text(json.dumps(slots))
    return str(path)


def test_sglang_adaptive_flags(tmp_path):
    config = _adaptive_file(tmp_path, {"1": {"candidate_steps": [1, 3, 7]}, "8": {"candidate_steps": [1, 3]}})
    args = speculative_args(_spec("sglang", method="eagle", num_speculative_tokens=7, draft_model="/e", adaptive_config=config))
    assert _flag(args, "--speculative-num-steps") == "7"
    assert _flag(args, "--speculative-num-draft-tokens") == "8"  # SGLang forces steps + 1
    assert _flag(args, "--speculative-eagle-topk") == "1"
    assert "--speculative-adaptive" in args and _flag(args, "--speculative-adaptive-config") == config
    launched = speculative_args(_spec("sglang", method="eagle", draft_model="/e", adaptive_config=config))
    assert _flag(launched, "--speculative-num-steps") == "3"  # no step given: the smallest slot's middle rung


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 3, "draft_model": "/d"}, "needs method eagle or eagle3"),
        ({"method": "eagle", "num_speculative_tokens": 3, "draft_model": "/e", "extra_args": ("--speculative-eagle-topk", "2")},
         "needs --speculative-eagle-topk 1, got 2"),
        ({"method": "eagle", "num_speculative_tokens": 5, "draft_model": "/e"}, r"must be a positive step of the config's ladders \[1, 3, 7\]"),
    ],
)  # fmt: skip
def test_sglang_adaptive_mistakes_fail_before_launch(tmp_path, fields, message):
    config = _adaptive_file(tmp_path, {"1": {"candidate_steps": [1, 3, 7]}, "8": {"candidate_steps": [1, 3]}})
    with pytest.raises(SpectuneError, match=message) as err:
        speculative_args(_spec("sglang", adaptive_config=config, **fields))
    assert "server 's'" in str(err.value)


def test_sglang_adaptive_config_is_validated(tmp_path):
    config = _adaptive_file(tmp_path, {"strategy": "x", "1": {"candidate_steps": [1, 3]}})
    with pytest.raises(SpectuneError, match="strategy"):
        speculative_args(_spec("sglang", method="eagle", num_speculative_tokens=3, draft_model="/e", adaptive_config=config))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "needs draft_model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_model": "/d"}, "does not apply to method 'ngram'"),
        ({"method": "suffix", "num_speculative_tokens": 3}, "has no SGLang algorithm"),
        ({"method": "eagle", "num_speculative_tokens": 3, "draft_model": "/e", "per_batch_size": ((1, 8, 2),)}, "use adaptive_config"),
    ],
)  # fmt: skip
def test_sglang_rejects_bad_specs(fields, message):
    with pytest.raises(SpectuneError, match=message):
        speculative_args(_spec("sglang", **fields))


def _gguf(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(b"GGUF")  # a file path is used as is; only the engine reads it
    return str(path)


def test_llamacpp_draft_model_flags_and_slots(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_LLAMA_SERVER", sys.executable)  # any existing file: the command is only built
    target, draft = _gguf(tmp_path, "t.gguf"), _gguf(tmp_path, "d.gguf")
    spec = ServerSpec(name="d3", engine="llamacpp", model=target, method="draft_model", num_speculative_tokens=3, draft_model=draft)
    server = make_server(spec, tmp_path / "logs", max_batch_size=8)
    argv = server.command(7000)
    assert argv[0] == sys.executable and _flag(argv, "-m") == target and _flag(argv, "--alias") == "d3"
    assert (_flag(argv, "-np"), _flag(argv, "-c")) == ("8", str(8 * CTX_PER_SLOT))  # one slot per concurrent request
    assert (_flag(argv, "-md"), _flag(argv, "--spec-type"), _flag(argv, "--spec-draft-n-max")) == (draft, "draft-simple", "3")
    assert "--metrics" in argv and _flag(argv, "--cache-ram") == "0"
    assert Path(_flag(argv, "--slot-save-path")).is_dir()  # llama-server refuses a missing directory


def test_llamacpp_ngram_flags_and_user_context(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_LLAMA_SERVER", sys.executable)
    spec = ServerSpec(name="n", engine="llamacpp", model=_gguf(tmp_path, "t.gguf"), method="ngram", num_speculative_tokens=4,
                      prompt_lookup_min=2, prompt_lookup_max=5, extra_args=("-c", "512"))
    argv = make_server(spec, tmp_path).command(7000)
    assert _flag(argv, "--spec-type") == "ngram-simple"
    assert (_flag(argv, "--spec-ngram-simple-size-m"), _flag(argv, "--spec-ngram-simple-size-n")) == ("4", "2")
    assert argv.count("-c") == 1 and _flag(argv, "-c") == "512" and _flag(argv, "-np") == "1"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3, "draft_model": "/e"}, "use draft_model or ngram"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs draft_model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "per_batch_size": ((1, 4, 2),)}, "no per-batch-size steps"),
    ],
)  # fmt: skip
def test_llamacpp_rejects_bad_specs(tmp_path, monkeypatch, fields, message):
    monkeypatch.setenv("SPECTUNE_LLAMA_SERVER", sys.executable)
    spec = ServerSpec(name="s", engine="llamacpp", model=_gguf(tmp_path, "t.gguf"), **fields)
    with pytest.raises(SpectuneError, match=message):
        make_server(spec, tmp_path).command(7000)


def test_llamacpp_needs_a_gguf_or_hf_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_LLAMA_SERVER", sys.executable)
    with pytest.raises(SpectuneError, match="not a GGUF file nor a Hugging Face model directory"):
        make_server(ServerSpec(name="s", engine="llamacpp", model=str(tmp_path)), tmp_path).command(7000)


def test_llamacpp_missing_binary_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(SpectuneError, match="scripts/install-engines.sh llamacpp"):
        make_server(ServerSpec(name="s", engine="llamacpp", model=_gguf(tmp_path, "t.gguf")), tmp_path).command(7000)


def test_embedded_command_and_round_log(tmp_path):
    config = _adaptive_file(tmp_path, {"1": {"candidate_steps": [2, 4]}, "16": {"candidate_steps": [1]}})
    spec = _spec("embedded", method="draft_model", adaptive_config=config)
    server = make_server(spec, tmp_path / "logs", round_log=tmp_path / "r.jsonl", max_batch_size=4)
    argv = server.command(8100)
    assert argv[:4] == [sys.executable, "-m", "spectune.cli", "serve"]
    assert server.round_log == tmp_path / "r.jsonl" and _flag(argv, "--round-log") == str(tmp_path / "r.jsonl")
    # the engine defaults the draft to its shipped one; the launch step is the one SGLang would start at
    assert json.loads(_flag(argv, "--speculative-config")) == {"method": "draft_model", "num_speculative_tokens": 4}
    assert _flag(argv, "--speculative-adaptive-config") == config and _flag(argv, "--max-num-seqs") == "4"
    default = make_server(_spec("embedded"), tmp_path / "logs")
    assert default.round_log == tmp_path / "logs" / "s.rounds.jsonl" and "--speculative-config" not in default.command(8100)
    assert make_server(_spec("embedded", url="http://127.0.0.1:1"), tmp_path).round_log is None


def test_openai_is_attach_only(tmp_path):
    with pytest.raises(SpectuneError, match="set `url`"):
        make_server(ServerSpec(name="s", engine="openai"), tmp_path)
    with pytest.raises(SpectuneError, match="cannot configure speculative decoding"):
        make_server(ServerSpec(name="s", engine="openai", url="http://127.0.0.1:1", method="ngram", num_speculative_tokens=2), tmp_path)
