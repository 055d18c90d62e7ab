"""spectune.rawhttp: HTTP/1.1 framing and SSE decoded from reads cut anywhere, and the load generator over real
sockets on 127.0.0.1 served by a plain asyncio server that writes its bytes in pieces the test chooses."""

from __future__ import annotations

import asyncio
import bisect
import json

import pytest

from spectune.loadgen import run_requests
from spectune.rawhttp import RawResponse, dechunk, sse_events
from spectune.records import Request
from spectune.workload import ClosedLoop

pytestmark = pytest.mark.timeout(60)


def event(completion_tokens: int, text: str) -> bytes:
    usage = {"prompt_tokens": 3, "completion_tokens": completion_tokens}
    chunk = {"choices": [{"index": 0, "text": text}], "usage": usage}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def chunked(*datas: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(d), d) for d in datas) + b"0\r\n\r\n"


# A body with what servers do: one event per chunk, two events in one chunk, one event over two chunks (cut inside
# its JSON), a chunk extension, a comment line, CRLF line ends, then [DONE].
EVENTS = [event(1, " a"), event(3, " b c"), event(4, " d"), event(6, " e f"), event(7, " g")]
BODY = chunked(EVENTS[0], EVENTS[1] + EVENTS[2], EVENTS[3][:20], EVENTS[3][20:] + b": keep-alive\n\n",
               EVENTS[4].replace(b"\n", b"\r\n"), b"data: [DONE]\n\n").replace(b"\r\n", b";ext=1\r\n", 1)
PAYLOADS = [e[6:].strip() for e in EVENTS]


def decode(pieces: list[bytes]):
    response = RawResponse(chunked=True, stamps=list(range(len(pieces))), pieces=pieces)
    return sse_events(response), dechunk(response.stamps, response.pieces)[2]


def test_byte_by_byte_reads_give_every_payload_stamped_with_the_read_that_ended_its_line():
    events, complete = decode([BODY[i:i + 1] for i in range(len(BODY))])
    assert complete and events.done and events.payloads == PAYLOADS
    for ns, payload in zip(events.stamps, events.payloads):
        assert BODY[ns:ns + 1] == b"\n"  # the byte that ended the line came in read `ns`
        assert payload[-20:] in BODY[:ns]


def test_reads_cut_at_any_one_or_two_places_decode_to_the_same_payloads_and_stamps():
    truth, _ = decode([BODY[i:i + 1] for i in range(len(BODY))])  # stamp = index of the line's last byte
    for cut in range(1, len(BODY)):
        for cut2 in sorted({(cut + len(BODY)) // 2, min(cut + 7, len(BODY))}):
            starts = sorted({0, cut, cut2} - {len(BODY)})
            pieces = [BODY[a:b] for a, b in zip(starts, starts[1:] + [len(BODY)])]
            events, complete = decode(pieces)
            assert complete and events.done and events.payloads == PAYLOADS, (cut, cut2)
            # each payload carries the stamp (here: the index) of the read holding its line's last byte
            assert events.stamps == [bisect.bisect_right(starts, at) - 1 for at in truth.stamps], (cut, cut2)


def test_a_body_cut_off_mid_chunk_is_incomplete_and_keeps_what_came():
    events, complete = decode([BODY[: len(BODY) // 2]])
    assert not complete and not events.done
    assert events.payloads == PAYLOADS[: len(events.payloads)] and len(events.payloads) >= 2


class PieceServer:
    """A plain HTTP/1.1 server: reads each request and answers with `script(n)` (n: requests so far), a list of
    byte strings written one by one with a flush and a short pause between (so reads end where they end), then
    keeps the connection open for the next request unless the script ends with None (close)."""

    def __init__(self, script) -> None:
        self.script = script
        self.requests = 0
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.requests += 1
                for piece in self.script(self.requests, self.connections):
                    if piece is None:
                        writer.close()
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.002)  # not synchronisation: only makes separate reads likely
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def awkward(body: bytes) -> list[bytes]:
    """The head cut in two, then the body cut inside a size line, between CR and LF, inside a JSON payload,
    inside [DONE] and inside the terminator."""
    head = OK_HEAD
    done = body.index(b"[DONE]")
    cuts = sorted({3, body.index(b"\r\n") + 1, 40, len(body) // 2, done + 3, len(body) - 3})
    pieces = [head[:20], head[20:]] + [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])]
    return [p for p in pieces if p]


def run(server: PieceServer, n: int, concurrency: int = 1, **kwargs):
    async def scenario():
        url = await server.start()
        try:
            requests = [Request(index=i, prompt=f"p{i}", messages=None, max_tokens=8) for i in range(n)]
            return await run_requests(url, "m", requests, ClosedLoop(concurrency), stall_timeout_s=2.0, **kwargs)
        finally:
            await server.stop()

    return asyncio.run(scenario())


def test_streams_cut_at_awkward_places_count_usage_deltas_and_reuse_one_connection():
    server = PieceServer(lambda n, c: awkward(BODY))
    records = run(server, 3)
    for r in records:
        assert r.error is None, r.error
        assert r.chunk_tokens == [1, 2, 1, 2, 1] and r.token_source == "usage"
        assert r.text == " a b c d e f g" and r.output_tokens == 7 and r.prompt_tokens == 3
        assert r.send_ns <= r.chunk_ns[0] <= r.chunk_ns[-1] <= r.end_ns
    assert server.requests == 3 and server.connections == 1


def test_a_chunked_error_response_gives_its_status_and_body():
    body = b'{"error": {"message": "model not found"}}'
    head = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = PieceServer(lambda n, c: [head, chunked(body[:9], body[9:])])
    [record] = run(server, 1)
    assert record.error == 'http 404: {"error": {"message": "model not found"}}'


def test_a_server_closing_mid_stream_is_a_recorded_early_end_with_its_chunk_count():
    body = chunked(EVENTS[0], EVENTS[1], EVENTS[2])[:-30]  # cut inside the third event, then the socket closes
    server = PieceServer(lambda n, c: [OK_HEAD, body[:50], body[50:], None])
    [record] = run(server, 1)
    assert record.error.startswith("stream ended early after 2 chunks"), record.error
    assert record.chunk_tokens == [1, 2]  # what came before the close is kept


def test_a_stream_without_done_that_ends_its_framing_says_so():
    server = PieceServer(lambda n, c: [OK_HEAD, chunked(EVENTS[0], EVENTS[1])])
    [record] = run(server, 1)
    assert record.error == "stream ended early after 2 chunks (no [DONE])"


def test_a_body_without_length_or_chunking_ends_when_the_server_closes():
    server = PieceServer(lambda n, c: [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", EVENTS[0], EVENTS[1],
                                       b"data: [DONE]\n\n", None])
    records = run(server, 2)
    assert [r.error for r in records] == [None, None]
    assert [r.chunk_tokens for r in records] == [[1, 2], [1, 2]]
    assert server.connections == 2  # "Connection: close": a new connection per request


def test_a_reused_connection_the_server_closed_is_retried_once_on_a_new_one():
    # Connection 1 answers its first request, then closes on the second without a byte of answer.
    server = PieceServer(lambda n, c: [None] if (c == 1 and n == 2) else [OK_HEAD, BODY])
    records = run(server, 3)
    assert [r.error for r in records] == [None, None, None]
    assert server.connections == 2 and server.requests == 4


def test_a_gzip_body_is_an_error_that_says_so():
    server = PieceServer(lambda n, c: [b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nabcd"])
    [record] = run(server, 1)
    assert record.error.startswith("bad response: the server sent a gzip body"), record.error
