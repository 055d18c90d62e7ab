"""Request sets (shipped and user files), schedules and the traffic digest."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from scripted_server import ScriptedServer, Step

from spectune.errors import SpectuneError
from spectune.loadgen import run_requests
from spectune.records import Request
from spectune.workload import WORKLOADS_DIR, ClosedLoop, Poisson, Trace, builtin_workloads, load_requests, traffic_digest

pytestmark = pytest.mark.timeout(120)  # a hung stream fails fast instead of after 600 s
SHIPPED = ("code", "quote", "random", "phase")


def test_shipped_sets_load_with_short_prompts():
    assert set(SHIPPED) <= set(builtin_workloads())
    for name in SHIPPED:
        requests = load_requests(name)
        assert 64 <= len(requests) <= 200, name
        assert [r.index for r in requests] == list(range(len(requests)))
        assert all(150 <= len(r.prompt) <= 600 and r.max_tokens > 0 for r in requests), name
        assert len({r.prompt for r in requests}) == len(requests), f"{name}: repeated prompts would hit the prefix cache"


def test_quote_prompts_repeat_their_own_context():
    for r in load_requests("quote"):
        text, again = r.prompt.split("\n", 1)[1].split("\n\n", 1)
        assert text.startswith(again) and len(again) > 20


def test_phase_set_alternates_acceptance_and_burst_size():
    requests = load_requests("phase")
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    burst_sizes = [arrivals.count(t) for t in sorted(set(arrivals))]
    assert {1, 4, 16} <= set(burst_sizes)
    tags = [r.tag for r in requests]
    runs = [tags[0]] + [t for prev, t in zip(tags, tags[1:]) if t != prev]  # the phases in order
    assert len(runs) >= 6 and all((a == "random") != (b == "random") for a, b in zip(runs, runs[1:]))
    assert Trace().send_offsets(requests) == arrivals


def test_swing_set_is_long_phases_of_copying_and_random_words_for_a_closed_loop():
    requests = load_requests("swing")
    tags = [r.tag for r in requests]
    assert tags == ["quote"] * 24 + ["random"] * 24 + ["quote"] * 24 + ["random"] * 24
    assert all(r.arrival_s is None for r in requests)  # closed loop: the load generator paces it
    assert len({r.prompt for r in requests}) == len(requests), "repeated prompts would hit the prefix cache"


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="the committed sets were built from CPython 3.11.7's stdlib")
def test_builder_reproduces_the_committed_files():
    spec = importlib.util.spec_from_file_location("build_workloads", WORKLOADS_DIR / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    for name, rows in build.build().items():
        committed = (WORKLOADS_DIR / f"{name}.jsonl").read_text(encoding="utf-8")
        assert committed == "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), name


def test_num_prompts_takes_the_first_n_and_cycles_deterministically():
    full = load_requests("quote")
    assert [r.prompt for r in load_requests("quote", num_prompts=5)] == [r.prompt for r in full[:5]]
    n = len(full) * 2 + 3
    a = load_requests("quote", num_prompts=n, seed=1)
    assert [r.index for r in a] == list(range(n))
    assert [r.prompt for r in a[: len(full)]] == [r.prompt for r in full]
    assert a == load_requests("quote", num_prompts=n, seed=1)
    assert [r.prompt for r in a] != [r.prompt for r in load_requests("quote", num_prompts=n, seed=2)]
    assert sorted(r.prompt for r in a[len(full) : 2 * len(full)]) == sorted(r.prompt for r in full)  # a full pass


def test_max_tokens_overrides_every_request():
    assert {r.max_tokens for r in load_requests("code", max_tokens=9)} == {9}


def test_user_jsonl_with_prompts_messages_and_blank_lines(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"prompt": "hello", "max_tokens": 4, "tag": "a"}\n'
        "\n"
        '{"messages": [{"role": "user", "content": "hi"}], "arrival_s": 1.5}\n'
    )
    first, second = load_requests(path)
    assert first == Request(index=0, prompt="hello", messages=None, max_tokens=4, tag="a")
    assert second.messages == (("user", "hi"),) and second.prompt is None and second.arrival_s == 1.5


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "x", "max_tokens": "ten"}', '"max_tokens" must be a positive integer, got "ten"'),
        ('{"prompt": "x", "max_tokens": 0}', '"max_tokens" must be a positive integer, got 0'),
        ('{"prompt": "x", "maxtokens": 5}', "unknown key 'maxtokens'; valid keys: prompt, messages, max_tokens, arrival_s, tag"),
        ('{"prompt": "x"', "not valid JSON"),
        ('["x"]', "expected a JSON object"),
        ('{"prompt": "x", "messages": []}', 'exactly one of "prompt" or "messages"'),
        ('{"messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"prompt": "x", "arrival_s": -1}', '"arrival_s" must be a number >= 0'),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(SpectuneError) as err:
        load_requests(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)


def test_unknown_source_lists_the_shipped_sets():
    with pytest.raises(SpectuneError, match="code, heldout, phase, quote, random, shift, swing"):
        load_requests("no-such-set")


def test_sharegpt_uses_the_first_human_turn(tmp_path):
    path = tmp_path / "sg.json"
    data = [
        {"conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": "answer"}]},
        {"conversations": [{"from": "gpt", "value": "no human here"}]},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "second"}, {"from": "human", "value": "x"}]},
    ]
    path.write_text(json.dumps(data))
    requests = load_requests(path)
    assert [r.messages for r in requests] == [(("user", "first question"),), (("user", "second"),)]
    assert [r.index for r in requests] == [0, 1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"turns": []}]))
    with pytest.raises(SpectuneError, match="entry 0"):
        load_requests(bad)


def test_poisson_offsets_are_deterministic_from_the_seed():
    requests = [Request(index=i, prompt="p", messages=None, max_tokens=1) for i in range(4000)]
    a = Poisson(rate_per_s=20.0, seed=1).send_offsets(requests)
    assert a == Poisson(rate_per_s=20.0, seed=1).send_offsets(requests)
    assert a != Poisson(rate_per_s=20.0, seed=2).send_offsets(requests)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0.0 and min(gaps) > 0
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = Poisson(rate_per_s=20.0, burstiness=0.25, seed=1).send_offsets(requests)
    bursty_gaps = [y - x for x, y in zip(bursty, bursty[1:])]
    assert statistics.mean(bursty_gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert statistics.pstdev(bursty_gaps) / statistics.mean(bursty_gaps) == pytest.approx(2.0, rel=0.15)  # gamma: CV 1/sqrt(k)


def test_schedule_validation_and_shapes():
    requests = load_requests("code", num_prompts=3)
    assert ClosedLoop(2).send_offsets(requests) == [None, None, None]
    assert ClosedLoop(2).max_concurrency == 2
    with pytest.raises(SpectuneError, match="concurrency"):
        ClosedLoop(0)
    with pytest.raises(SpectuneError, match="rate_per_s"):
        Poisson(rate_per_s=0)
    with pytest.raises(SpectuneError, match='no "arrival_s"'):
        Trace().send_offsets(requests)
    cycled = load_requests("phase", num_prompts=200)  # a second pass restarts the arrivals
    with pytest.raises(SpectuneError, match="sort the file by arrival_s"):
        Trace().send_offsets(cycled)


def test_traffic_digest_changes_with_anything_that_is_sent():
    requests = load_requests("phase", num_prompts=10)
    sampling = {"temperature": 0.0, "seed": 0, "ignore_eos": True}
    base = traffic_digest(requests, Trace(), sampling)
    assert base == traffic_digest(load_requests("phase", num_prompts=10), Trace(), dict(sampling))
    changed_prompt = [replace(requests[0], prompt=requests[0].prompt + "!")] + requests[1:]
    variants = [
        traffic_digest(changed_prompt, Trace(), sampling),
        traffic_digest(requests, Trace(), sampling | {"seed": 1}),
        traffic_digest(requests, Trace(), sampling | {"temperature": 0.5}),
        traffic_digest(requests[::-1], ClosedLoop(4), sampling),
        traffic_digest([replace(r, max_tokens=r.max_tokens + 1) for r in requests], Trace(), sampling),
        traffic_digest(requests, Trace(max_concurrency=4), sampling),
        traffic_digest(requests, ClosedLoop(4), sampling),
        traffic_digest(requests, Poisson(rate_per_s=5.0, seed=1), sampling),
    ]
    assert base not in variants and len(set(variants)) == len(variants)
    assert traffic_digest(requests, Poisson(rate_per_s=5.0, seed=1), sampling) != traffic_digest(
        requests, Poisson(rate_per_s=5.0, seed=2), sampling
    )


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_closed_loop_never_exceeds_n_in_flight(concurrency):
    server = ScriptedServer(steps=(Step(0.01, 1), Step(0.01, 2)))

    async def scenario():
        url = await server.start()
        try:
            return await run_requests(url, "m", load_requests("random", num_prompts=20, max_tokens=3), ClosedLoop(concurrency))
        finally:
            await server.stop()

    records = asyncio.run(scenario())
    assert server.max_open == concurrency  # reached and never exceeded, measured by the server
    assert len(records) == 20 and all(r.error is None for r in records)


def test_workloads_are_package_data_linked_to_the_top_level_folder():
    package = Path(__import__("spectune").__file__).resolve().parent
    assert WORKLOADS_DIR == package / "_data" / "workloads"
    # in the repository, one copy: the package's folder is the top-level workloads/ folder
    assert WORKLOADS_DIR.resolve() == package.parent / "workloads"
