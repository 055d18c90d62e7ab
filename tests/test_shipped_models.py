"""The shipped tokenizer, target and draft: they load as standard HF Llama dirs, the draft imitates the
target, noisy drafts degrade with noise, llama.cpp can run the target, and the training script
reproduces its output bit for bit."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spectune.engine import shipped, train  # noqa: E402

LLAMA_SERVER = shipped.cache_dir() / "llama.cpp" / "bin" / "llama-server"
SAMPLES = [
    "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs)  # never empty\n",
    "class Foo(Base):\n\t'''Docs.'''\n\n    x = {'a': [1, 2.5e-3, None]}\r\n",
    "naïve café — 日本語のテキスト, emoji 🚀😶\u200d🌫️, Ελληνικά, ‘quotes’ \x00\x7f",
    "   leading spaces and trailing   \n\n\n",
]


@pytest.fixture(scope="module", autouse=True)
def _few_threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def target():
    return transformers.LlamaForCausalLM.from_pretrained(shipped.target_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft():
    return transformers.LlamaForCausalLM.from_pretrained(shipped.draft_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def held_out():
    """The training script's held-out stdlib files as one token stream."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(shipped.target_path() / "tokenizer.json"))
    _, held_out_files = train.split_corpus(train.corpus_files())
    return train.encode_stream(tokenizer, train.read_texts(held_out_files))


@pytest.fixture(scope="module")
def paths(target, held_out):
    """The target's greedy paths on the held-out evaluation prompts, per workload."""
    cfg = train.TrainConfig(eval_prompts=8)  # half the training script's set, to keep the test quick
    return train.target_paths(target, train.eval_prompts(held_out, cfg, seed=0), cfg.eval_new_tokens)


def test_tokenizer_round_trips_code_and_unicode_through_auto_tokenizer():
    tokenizer = transformers.AutoTokenizer.from_pretrained(shipped.target_path())
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        assert tokenizer.eos_token_id not in ids  # no BOS/EOS added: prompts are plain text
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode(SAMPLES[0])) < len(SAMPLES[0]) / 2  # BPE compresses code


def test_target_and_draft_share_tokenizer_and_vocab(target, draft):
    for name in shipped.TOKENIZER_FILES:
        assert (shipped.target_path() / name).read_bytes() == (shipped.draft_path() / name).read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(shipped.draft_path())
    assert target.config.vocab_size == draft.config.vocab_size == len(tokenizer)
    assert (target.config.num_hidden_layers, draft.config.num_hidden_layers) == (4, 1)
    assert torch.equal(target.model.embed_tokens.weight, draft.model.embed_tokens.weight)


def test_shipped_weights_are_small_fp16_safetensors():
    from safetensors import safe_open

    total = 0
    for model_dir in (shipped.target_path(), shipped.draft_path(), shipped.eagle_path(), shipped.dflash_path()):
        with safe_open(model_dir / shipped.WEIGHTS, framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys() if k != "draft_vocab"} == {"F16"}
        total += sum(p.stat().st_size for p in model_dir.iterdir())
    assert total < 25e6


def test_target_models_held_out_code_better_than_the_draft_and_far_better_than_chance(target, draft, held_out):
    target_loss = train.held_out_loss(target, held_out, seq_len=256)
    draft_loss = train.held_out_loss(draft, held_out, seq_len=256)
    uniform = torch.log(torch.tensor(float(target.config.vocab_size))).item()  # 7.62 nats
    assert target_loss < draft_loss < uniform - 2
    assert target_loss < uniform - 3


def test_draft_agrees_with_target_far_more_than_an_untrained_layer(draft, paths):
    torch.manual_seed(0)
    untrained = transformers.LlamaForCausalLM(train.llama_config(draft.config.vocab_size, num_layers=1)).eval()
    trained, random_init = train.agreement(draft, paths), train.agreement(untrained, paths)
    assert trained.code > 0.5
    assert random_init.code < 0.1
    assert trained.quote > random_init.quote + 0.2


def test_eagle_head_agrees_with_target_far_more_than_an_untrained_head(target, held_out, paths):
    from safetensors.torch import load_file

    from spectune.engine.eagle import EagleConfig

    config = EagleConfig.from_dir(shipped.eagle_path())
    weights = load_file(str(shipped.eagle_path() / shipped.WEIGHTS))
    vocab = weights.pop("draft_vocab").long()
    lm_head = (target.model.norm.weight[:, None] * target.lm_head.weight.t()).detach()[:, vocab]

    def head_agreement(seed: int | None) -> train.Agreement:
        torch.manual_seed(seed or 0)
        head = train.EagleTrainHead(config.hidden_size, config.head_size, config.intermediate_size, config.rms_norm_eps)
        if seed is None:
            head.load_state_dict({k: v.float() for k, v in weights.items()})
        return train.eagle_agreement(target, train.Eagle(head.eval(), vocab, lm_head, 0.0, [], 0.0), paths)

    trained, untrained = head_agreement(None), head_agreement(1)
    assert trained.code > 0.5
    assert untrained.code < 0.1
    assert trained.random > untrained.random


def test_dflash_head_agrees_with_target_far_more_than_an_untrained_head(target, paths):
    """The shipped block drafter, loaded as its trainer's module, against the same module with random weights:
    first-draft agreement along the target's greedy path, and the share of whole 4-token blocks it gets right."""
    from safetensors.torch import load_file

    from spectune.engine import train_dflash
    from spectune.engine.dflash import DFlashConfig

    config = DFlashConfig.from_dir(shipped.dflash_path())
    weights = load_file(str(shipped.dflash_path() / shipped.WEIGHTS))
    vocab = weights.pop("draft_vocab").long()
    lm_head = (target.model.norm.weight[:, None] * target.lm_head.weight.t()).detach()[:, vocab]

    def survival(trained: bool) -> torch.Tensor:
        torch.manual_seed(1)
        head = train_dflash.DFlashTrainHead(config)
        if trained:
            head.load_state_dict({k: v.float() for k, v in weights.items()})
        dflash = train_dflash.DFlash(head.eval(), vocab, lm_head, 0.0, [], 0.0, 0.0)
        return train_dflash.block_survival(target, dflash, paths.tokens["code"], paths.choices["code"], 4)

    trained, untrained = survival(True), survival(False)
    assert trained[0] > 0.5 and untrained[0] < 0.1
    assert trained[3] > untrained[3] + 0.2


def test_noisy_drafts_agree_less_as_noise_grows(monkeypatch, tmp_path, paths):
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path))
    rates = []
    for noise in (0.0, 0.1, 0.5):
        model_dir = shipped.noisy_draft_path(noise)
        assert model_dir.parent == tmp_path / "models"
        assert shipped.noisy_draft_path(noise) == model_dir  # cached
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        rates.append(train.agreement(model, paths).code)
    assert rates[0] == 1.0
    assert 1.0 > rates[1] > rates[2]
    assert rates[2] < 0.9


def test_noisy_draft_rejects_negative_noise():
    from spectune.errors import SpectuneError

    with pytest.raises(SpectuneError, match="noise"):
        shipped.noisy_draft_path(-0.1)


def test_gguf_convert_without_llama_cpp_says_how_to_install_it(monkeypatch, tmp_path):
    from spectune.errors import SpectuneError

    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path))
    with pytest.raises(SpectuneError, match="install-engines.sh llamacpp"):
        shipped.gguf_convert(shipped.draft_path(), tmp_path / "draft.gguf")
    assert not (tmp_path / "draft.gguf").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@pytest.mark.skipif(not LLAMA_SERVER.is_file(), reason=f"llama.cpp not built ({LLAMA_SERVER}); run scripts/install-engines.sh llamacpp")
def test_gguf_conversion_runs_in_llama_server_with_the_same_tokens(tmp_path, target):
    gguf = shipped.gguf_convert(shipped.target_path(), tmp_path / "target.gguf")
    assert shipped.gguf_convert(shipped.target_path(), gguf).stat().st_mtime == gguf.stat().st_mtime  # cached
    tokenizer = transformers.AutoTokenizer.from_pretrained(shipped.target_path())
    port = _free_port()
    server = subprocess.Popen(
        [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "1024", "-np", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # readiness poll: /health answers 200 once the model is loaded
            assert server.poll() is None, server.stderr.read()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "llama-server did not become ready in 60 s"
                time.sleep(0.2)
        base = f"http://127.0.0.1:{port}"
        for text in SAMPLES:
            assert _post(f"{base}/tokenize", {"content": text})["tokens"] == tokenizer.encode(text)
        prompt = SAMPLES[0] + "\n\ndef "
        body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "top_k": 1, "return_tokens": True, "cache_prompt": False,
                "ignore_eos": True}
        served = _post(f"{base}/completion", body)["tokens"]
        prompt_ids = torch.tensor([tokenizer.encode(prompt)])
        expected = train.greedy_generate(target, prompt_ids, len(served))[0].tolist()
        # llama.cpp computes in f16, transformers in f32: allow a late near-tie to diverge
        assert served[:8] == expected[:8]
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_training_script_is_deterministic_end_to_end(tmp_path):
    args = ["--steps", "2", "--draft-steps", "1", "--eagle-steps", "2", "--dflash-steps", "2", "--dflash-sequences", "4",
            "--batch-size", "4", "--corpus-mb", "0.3", "--seed", "3", "--eval-prompts", "2"]
    for name in ("a", "b"):
        train.main(["--out", str(tmp_path / name), *args])
    for model in ("target", "draft"):
        for name in (shipped.WEIGHTS, "tokenizer.json", "config.json"):
            assert (tmp_path / "a" / model / name).read_bytes() == (tmp_path / "b" / model / name).read_bytes()
    head = (tmp_path / "a" / "eagle" / shipped.WEIGHTS).read_bytes()
    assert head == (tmp_path / "b" / "eagle" / shipped.WEIGHTS).read_bytes()
    assert "--seed 3" in (tmp_path / "a" / "README.md").read_text()
    # --eagle-only remakes exactly the head a full run made from the same target
    shutil.rmtree(tmp_path / "b" / "eagle")
    train.main(["--out", str(tmp_path / "b"), "--eagle-only", *args])
    assert (tmp_path / "b" / "eagle" / shipped.WEIGHTS).read_bytes() == head
    # and --dflash-only the dflash head
    block = (tmp_path / "a" / "dflash" / shipped.WEIGHTS).read_bytes()
    assert block == (tmp_path / "b" / "dflash" / shipped.WEIGHTS).read_bytes()
    shutil.rmtree(tmp_path / "b" / "dflash")
    train.main(["--out", str(tmp_path / "b"), "--dflash-only", *args])
    assert (tmp_path / "b" / "dflash" / shipped.WEIGHTS).read_bytes() == block
    assert not [p for p in tmp_path.rglob(".*")]  # no staging dirs left behind
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "a" / "draft")
    assert loaded.config.num_hidden_layers == 1
