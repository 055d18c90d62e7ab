"""The load-generator benchmark's emitter (benchmarks/emitter.c): what it sends, that its log is exact, and that
the harness matches a real client's records to it. Behaviour only; no timing tolerances."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
from loadgen_bench import clients, emitter  # noqa: E402
from loadgen_bench.figures import measure  # noqa: E402

import loadgen  # noqa: E402  (benchmarks/loadgen.py)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the emitter")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(tmp_path):
    """Start an emitter with a given schedule: returns (port, log dir, process); stopped at the end if still up."""
    binary = emitter.build(tmp_path / "cache")
    started = []

    def start(schedule: emitter.Schedule):
        port, out = _free_port(), tmp_path / f"out{len(started)}"
        proc = emitter.start(binary, schedule, port, out, cpu=None)
        started.append(proc)
        return port, out, proc

    yield start
    for proc in started:
        if proc.poll() is None:
            emitter.stop(proc)


def _events(conn: http.client.HTTPConnection, path: str, body: dict) -> list[str]:
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream"
    text = response.read().decode()  # chunked transfer decoded by http.client
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def test_streams_the_schedule_and_logs_every_chunk_never_early(serve):
    schedule = emitter.Schedule(ttft_ms=20, gap_ms=5, tokens_per_chunk=4, max_tokens=7, usage_per_chunk=True)
    port, out, proc = serve(schedule)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    first = _events(conn, "/v1/completions", {"prompt": "hi", "max_tokens": 10, "stream": True})
    second = _events(conn, "/v1/completions", {"prompt": "hi", "stream": True})  # same keep-alive connection
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    conn.close()

    assert models["data"][0]["id"] == "emitter"
    assert first[-1] == "[DONE]"
    chunks = [json.loads(e) for e in first[:-1]]
    content, tail = chunks[:-1], chunks[-1]
    assert [c["choices"][0]["text"] for c in content] == [" @0 w w w", " w w w w", " w w"]  # max_tokens 10 from the body
    assert [c["usage"]["completion_tokens"] for c in content] == [4, 8, 10]
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    assert tail["choices"] == [] and tail["usage"]["completion_tokens"] == 10
    assert len(second) == 2 + 2  # 7 tokens (the default) in chunks of 4 and 3, then usage and [DONE]
    assert json.loads(second[0])["choices"][0]["text"] == " @1 w w w"

    emitter.stop(proc)
    served = emitter.read_log(out)
    assert sorted(served) == [0, 1]
    for e, tokens in ((served[0], 10), (served[1], 7)):
        assert e.max_tokens == tokens and not e.aborted
        assert len(e.chunk_ns) == -(-tokens // 4)
        assert e.rx_ns <= e.parse_ns
        due = [e.parse_ns + 20_000_000 + i * 5_000_000 for i in range(len(e.chunk_ns))]
        assert all(a >= d for a, d in zip(e.chunk_ns, due)), "a chunk left before its scheduled time"


def test_chat_deltas_without_per_chunk_usage_and_an_abandoned_stream_is_logged_aborted(serve):
    port, out, proc = serve(emitter.Schedule(ttft_ms=1, gap_ms=200, tokens_per_chunk=1, max_tokens=50))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    chat = _events(conn, "/v1/chat/completions", {"messages": [], "max_tokens": 2, "stream": True})
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in chat[:2]] == [" @0", " w"]
    assert "usage" not in json.loads(chat[0]) and json.loads(chat[2])["usage"]["completion_tokens"] == 2
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "stream": True}))
    response = conn.getresponse()
    assert response.fp.readline()  # the first chunk came (after 1 ms); the rest would take 10 s
    response.close()
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # the emitter still serves others
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()

    emitter.stop(proc)
    served = emitter.read_log(out)
    assert not served[0].aborted and len(served[0].chunk_ns) == 2
    assert served[1].aborted and 1 <= len(served[1].chunk_ns) < 50


def test_harness_matches_every_request_of_spectunes_client_to_the_emitters_log(serve, tmp_path):
    schedule = emitter.Schedule(ttft_ms=5, gap_ms=2, tokens_per_chunk=1, max_tokens=6, usage_per_chunk=True)
    port, out, proc = serve(schedule)
    run = clients.run("spectune", f"http://127.0.0.1:{port}", 4, 12, schedule.max_tokens, tmp_path / "client", cpu=None)
    emitter.stop(proc)
    assert run.returncode == 0, run.log
    figures = measure(run, emitter.read_log(out), schedule)
    assert (figures["completed"], figures["failed"], figures["unmatched"]) == (12, 0, 0)
    assert figures["gap_len_mismatch"] == 0 and figures["chunks"] == 12 * 6
    assert figures["tokens_counted_mean"] == 6 and figures["token_source"] == "usage"
    assert figures["emitter_early"] == 0
    assert figures["cpu_s"] >= 0
    assert figures["self_flagged"] is False  # spectune's own saturation verdict reaches the table; 4 slow streams: no


def test_the_table_replaces_only_its_own_section_of_the_readme(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\n## Other\nkept\n\n" + loadgen.HEADING + "\nold table\n\n## Later\nalso kept\n")
    loadgen.write_readme(loadgen.HEADING + "\n\nnew table\n", readme)
    text = readme.read_text()
    assert "old table" not in text and "new table" in text
    assert text.index("## Other") < text.index("new table") < text.index("## Later")
    assert "kept" in text and "also kept" in text
    fresh = tmp_path / "new" / "README.md"
    fresh.parent.mkdir()
    loadgen.write_readme(loadgen.HEADING + "\n\nfirst\n", fresh)
    assert fresh.read_text().startswith("# Benchmarks\n\n" + loadgen.HEADING)
