"""The real server (`python -m spectune.cli serve` in a subprocess on a free 127.0.0.1 port), spoken to over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import aiohttp
import pytest
import torch
from engine_models import llama, noisy_copy, write_tokenizer

from spectune.engine.config import EngineConfig
from spectune.engine.engine import LLMEngine
from spectune.engine.scheduler import SamplingParams
from spectune.engine.server import IncrementalText, TextCodec

torch.set_num_threads(1)
K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("server")
    vocab = write_tokenizer(root / "target")
    target = llama(root / "target", vocab)
    return {"target": target, "draft": noisy_copy(target, root / "draft", 0.02), "vocab": vocab, "root": root}


@pytest.fixture(scope="module")
def server(models):
    log = models["root"] / "rounds.jsonl"
    spec = json.dumps({"method": "draft_model", "model": str(models["draft"]), "num_speculative_tokens": K})
    stderr = (models["root"] / "server.err").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "spectune.cli", "serve", "--port", "0", "--model", str(models["target"]), "--served-model-name", "tiny",
         "--speculative-config", spec, "--max-num-seqs", "4", "--round-log", str(log), "--threads", "1"],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    line = proc.stdout.readline()  # the ready line, printed once the socket is bound
    match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if not match:
        proc.kill()
        pytest.fail(f"server did not start: {line!r} {(models['root'] / 'server.err').read_text()[-2000:]}")
    yield {"url": f"http://127.0.0.1:{match.group(1)}", "log": log}
    proc.terminate()
    proc.wait(timeout=30)
    stderr.close()


def run(coro):
    return asyncio.run(coro)


async def post(url: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=json.dumps(body) if not isinstance(body, str) else body) as resp:
            return resp.status, await resp.json(content_type=None)


async def stream(url: str, body: dict) -> list:
    """SSE events in order: dicts, then the string '[DONE]'."""
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={**body, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def get_text(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            return resp.status, await resp.text()


def scrape(url: str) -> dict[str, float]:
    status, text = run(get_text(url + "/metrics"))
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            assert 'model_name="tiny"' in name and 'engine="0"' in name
            position = re.search(r'position="(\d+)"', name)
            key = name.split("{")[0] + (f"[{position.group(1)}]" if position else "")
            values[key] = float(value)
    return values


def prompt_ids(vocab: int, i: int) -> list[int]:
    return torch.randint(2, vocab, (4 + i,), generator=torch.Generator().manual_seed(i)).tolist()


def test_streamed_chunks_carry_all_tokens_of_a_step_and_usage_counts_them(server, models):
    before = scrape(server["url"])
    body = {"model": "tiny", "prompt": prompt_ids(models["vocab"], 0), "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = run(stream(server["url"] + "/v1/completions", body))
    assert events[-1] == "[DONE]"
    final_usage, chunks = events[-2], events[:-2]
    assert final_usage["choices"] == [] and final_usage["usage"]["completion_tokens"] == 40
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    per_chunk = [b - a for a, b in zip([0] + counts, counts)]
    assert sum(per_chunk) == 40 and all(n >= 1 for n in per_chunk)
    assert per_chunk[0] == 1  # the prefill step yields one token
    assert max(per_chunk) > 1 and len(chunks) < 40  # speculation: several tokens per chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    after = scrape(server["url"])
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 40
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == len(body["prompt"])
    # lossless through HTTP: the text equals target-only greedy decoding of the same prompt
    text = "".join(c["choices"][0]["text"] for c in chunks)
    plain_engine = LLMEngine(EngineConfig(model=models["target"]))
    plain = plain_engine.generate([body["prompt"]], [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)])[0]
    from tokenizers import Tokenizer

    assert text == Tokenizer.from_file(str(models["target"] / "tokenizer.json")).decode(plain, skip_special_tokens=True)


def test_concurrent_requests_move_metrics_consistently(server, models):
    before = scrape(server["url"])

    async def many():
        bodies = [{"prompt": prompt_ids(models["vocab"], i), "max_tokens": 10 + 3 * i, "temperature": 0.0 if i % 2 else 1.0,
                   "seed": i, "ignore_eos": True} for i in range(6)]
        return await asyncio.gather(*(post(server["url"] + "/v1/completions", b) for b in bodies)), bodies

    results, bodies = run(many())
    for (status, body), sent in zip(results, bodies):
        assert status == 200 and body["usage"]["completion_tokens"] == sent["max_tokens"]
        assert body["usage"]["prompt_tokens"] == len(sent["prompt"]) and body["choices"][0]["finish_reason"] == "length"
    after = scrape(server["url"])
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < d["vllm:spec_decode_num_accepted_tokens_total"] <= d["vllm:spec_decode_num_draft_tokens_total"]
    assert d["vllm:spec_decode_num_draft_tokens_total"] <= K * d["vllm:spec_decode_num_drafts_total"]
    per_pos = [d[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(K)]
    assert sum(per_pos) == d["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True)  # position i+1 is accepted only after position i
    assert d["vllm:generation_tokens_total"] == sum(b["max_tokens"] for b in bodies)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    # /server_info reports the live step and the lifetime mean accept length (bonus included)
    status, text = run(get_text(server["url"] + "/server_info"))
    state = json.loads(text)["internal_states"][0]
    assert status == 200 and state["speculative_num_steps"] == K
    assert 1.0 < state["avg_spec_accept_length"] <= K + 1
    # the round log saw the same rounds
    rounds = [r for r in map(json.loads, server["log"].read_text().splitlines()) if not r.get("prefill")]
    assert sum(sum(r["accepted"]) for r in rounds) == after["vllm:spec_decode_num_accepted_tokens_total"]
    assert max(r["batch_size"] for r in rounds) == 4  # six requests, four slots: continuous batching with a queue


def test_chat_streams_role_first_then_content(server):
    body = {"messages": [{"role": "user", "content": "the cat sat on"}], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events = run(stream(server["url"] + "/v1/chat/completions", body))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[-2]["usage"]["completion_tokens"] == 12 and events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    status, whole = run(post(server["url"] + "/v1/chat/completions", {**body, "stream": False}))
    assert status == 200 and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": streamed}


@pytest.mark.parametrize(
    "body, needle",
    [
        ("{broken", "not valid JSON"),
        ({"max_tokens": 5}, "prompt"),
        ({"prompt": "hi", "n": 2}, "n="),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": [1, 2, 10**6]}, "token ids"),
        ({"prompt": "hi", "max_tokens": 10**6}, "max_model_len"),
        ({"prompt": "hi", "top_p": 0.5}, "top_p"),
    ],
)
def test_bad_requests_get_400_with_an_openai_error(server, body, needle):
    status, reply = run(post(server["url"] + "/v1/completions", body))
    assert status == 400
    assert reply["error"]["code"] == 400 and needle in reply["error"]["message"]


def test_service_endpoints(server):
    status, text = run(get_text(server["url"] + "/v1/models"))
    assert status == 200 and json.loads(text)["data"][0]["id"] == "tiny"
    assert run(get_text(server["url"] + "/health"))[0] == 200

    async def resets():
        async with aiohttp.ClientSession() as session:
            return [(await session.post(server["url"] + path)).status for path in ("/reset_prefix_cache", "/flush_cache")]

    assert run(resets()) == [200, 200]


def test_incremental_text_equals_whole_decode_across_split_characters(models):
    """Byte-level tokens split multi-byte characters; deltas must hold them back and still add up exactly."""
    codec = TextCodec(models["target"])
    ids = codec.encode("the cat 고양이 sat 🐈 on the mat, naïve")
    for step in (1, 2, 3):
        text = IncrementalText(codec)
        deltas = [text.push(ids[i : i + step], final=i + step >= len(ids)) for i in range(0, len(ids), step)]
        assert "".join(deltas) == codec.decode(ids)
        assert not any("\ufffd" in d for d in deltas)
