"""HTTP/1.1 streaming for plain http:// URLs on asyncio.Protocol: while a response streams, each read is only
stamped and kept; framing and SSE are decoded later, in bulk.

Why: profiled at 256 streams (benchmarks/loadgen.py --cases saturation; benchmarks/README.md), aiohttp spent
~2.7 us per chunk parsing each read and waking the reading task (a future, a task step and a StreamReader call
per read) before spectune saw a byte. Here `data_received` appends (perf_counter_ns, bytes) and runs three
substring tests on the read: no per-read future, task step or Python object beyond the bytes.

A request ends (its future resolves) at the first of: a `data: [DONE]` line inside one read, an event naming
"error", the body's framing end (chunked terminator, Content-Length, or the server closing a body that has
neither), or the connection closing early. After [DONE] the connection keeps reading to the end of its
framing and only then goes back to the pool (a connection is reused only after a complete response and
without "Connection: close"). Chunked trailers and content encodings are not supported (spectune asks for
none): a gzip body is an error that says so.

A chunked body's end is read off its tail ("\r\n0\r\n\r\n"), not by walking every chunk while streaming.
Decoding (`sse_events`, run when the request's record is filled in): de-chunk the body, split `data:` lines,
each payload stamped with the read that brought its line's end, as spectune's aiohttp reader does.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

HEAD_LIMIT = 64 << 10  # bytes: a response head longer than this is not HTTP
DONE_LINE = re.compile(rb"(?:^|\n)data: ?\[DONE\][ \t]*\r?\n")  # JSON strings hold no raw newline: no false hit
CHUNKED_END = b"0\r\n\r\n"


@dataclass(slots=True)
class RawResponse:
    """One response as read: status and framing from its head, then each read of the body and when it
    returned. `end` says why reading stopped."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False
    length: int | None = None  # Content-Length, when the body has one
    stamps: list[int] = field(default_factory=list)  # perf_counter_ns when each read returned
    pieces: list[bytes] = field(default_factory=list)  # the body bytes of that read (still chunk-framed)
    received: int = 0  # body bytes, counted only for Content-Length bodies
    end: str | None = None  # "done" ([DONE]), "error" (an error event), "eof" (framing ended), "closed" (early)
    last_ns: int = 0  # the latest read (or the send): the stall timer's reference

    @property
    def size(self) -> int:
        return sum(map(len, self.pieces))

    def body(self) -> bytes:
        """The whole body, de-chunked (for error responses)."""
        if not self.chunked:
            return b"".join(self.pieces)
        return b"".join(dechunk(self.stamps, self.pieces)[1])


@dataclass(slots=True)
class Events:
    """A stream's SSE `data:` payloads, each stamped with the read that completed it."""

    stamps: list[int]
    payloads: list[bytes]
    done: bool  # a [DONE] line came (payloads stop before it)


class Pool:
    """Keep-alive connections to one http:// origin; as many as there are requests in flight (no limit)."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"rawhttp serves plain http:// URLs only, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.authority = parts.netloc.rpartition("@")[2]
        self.prefix = parts.path.rstrip("/")
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc) -> None:
        for conn in list(self.open):
            conn.transport.close()

    def request_bytes(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.authority}", "Accept: */*",
                 "User-Agent: spectune"]
        lines += [f"{k}: {v}" for k, v in headers.items()] + [f"Content-Length: {len(body)}", "", ""]
        return "\r\n".join(lines).encode("latin-1") + body

    async def connection(self) -> tuple[_Connection, bool]:
        """An idle connection (reused: True) or a new one; OSError when the server cannot be reached."""
        while self.idle:
            conn = self.idle.pop()
            if not conn.transport.is_closing():
                return conn, True
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        return conn, False


class _Connection(asyncio.Protocol):
    """One TCP connection: at most one response at a time, read as RawResponse."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport
        self.response: RawResponse | None = None
        self.ended: asyncio.Future | None = None  # resolves when the response ends (see module docstring)
        self.head: bytes | None = b""  # the response head while it is incomplete; None once read
        self.draining = False  # [DONE] seen: reading on to the framing's end before going idle
        self.reusable = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.pool.open.add(self)

    def send(self, request: bytes, response: RawResponse) -> asyncio.Future:
        """Write the request; the future resolves when its response ends."""
        self.response, self.head, self.draining = response, b"", False
        self.ended = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.ended

    def abandon(self) -> None:
        """The caller stopped waiting (cancelled, timed out): the rest of this response is not read."""
        self.reusable = False
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        r = self.response
        if r is None:  # bytes nobody asked for: this connection's framing cannot be trusted
            self.abandon()
            return
        r.last_ns = now
        if self.head is not None:
            data = self._read_head(data)
            if not data:
                return
        r.stamps.append(now)
        r.pieces.append(data)
        if r.chunked:
            if not self.draining and b"[DONE]" in data and DONE_LINE.search(data):
                self._end("done")
            if data.endswith(CHUNKED_END) or len(data) < len(CHUNKED_END) + 2:
                if self._chunked_ended():
                    self._end("eof")
                    return
            if not self.draining and b'"error"' in data and _has_error_event(r):
                self._end("error")
        elif r.length is not None:
            r.received += len(data)
            if r.received >= r.length:
                self._end("eof")

    def _read_head(self, data: bytes) -> bytes | None:
        """Take the response head off the front of the stream; the body bytes after it, None until complete."""
        buf = self.head + data
        cut = buf.find(b"\r\n\r\n")
        if cut < 0:
            if len(buf) > HEAD_LIMIT:
                self._fail(f"a response head longer than {HEAD_LIMIT} bytes")
                return None
            self.head = buf
            return None
        r = self.response
        assert r is not None
        lines = buf[:cut].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        try:
            r.status = int(rest[:3])
        except ValueError:
            self._fail(f"not an HTTP response: {lines[0][:80]!r}")
            return None
        if 100 <= r.status < 200:  # an interim response (100 Continue): the real one follows
            self.head = b""
            return self._read_head(buf[cut + 4:])
        self.head = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            r.headers[name.strip().lower()] = value.strip()
        r.chunked = "chunked" in r.headers.get("transfer-encoding", "").lower()
        if not r.chunked and "content-length" in r.headers:
            r.length = int(r.headers["content-length"])
        connection = r.headers.get("connection", "").lower()
        self.reusable = version == "HTTP/1.1" and "close" not in connection and (r.chunked or r.length is not None)
        encoding = r.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            self._fail(f"the server sent a {encoding} body, which spectune does not decode (it asks for none)")
            return None
        body = buf[cut + 4:]
        if r.length == 0:
            self._end("eof")
            return None
        return body

    def _chunked_ended(self) -> bool:
        """The body ends with the last chunk ("\r\n0\r\n\r\n"; no trailers). Only the tail is looked at, not the
        whole framing (that would cost a walk over every chunk per request): a chunk whose data itself ended in
        "\r\n0\r\n" would end a response early, which no SSE server writes (a line "0" is no SSE field)."""
        r = self.response
        assert r is not None
        tail = r.pieces[-1] if len(r.pieces[-1]) >= 7 else b"".join(r.pieces[-7:])
        return tail.endswith(b"\r\n" + CHUNKED_END) or tail == CHUNKED_END  # (or the whole body is the last chunk)

    def _end(self, why: str) -> None:
        r = self.response
        assert r is not None
        if why == "done" and self.reusable:
            self.draining = True  # read on to the framing's end, then go idle
        elif why == "eof" and self.draining:
            self.draining = False
            self.response = None
            self.pool.idle.append(self)
            return
        else:
            self.response = None
            if why == "eof" and self.reusable:
                self.pool.idle.append(self)
            elif not self.transport.is_closing():
                self.reusable = False
                self.transport.close()
        if r.end is None:
            r.end = why
            if self.ended is not None and not self.ended.done():
                self.ended.set_result(why)

    def _fail(self, why: str) -> None:
        self.reusable = False
        self.transport.close()
        if self.ended is not None and not self.ended.done():
            self.ended.set_exception(ProtocolError(why))

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.open.discard(self)
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        r = self.response
        if r is None:
            return
        self.response = None
        if self.draining:
            return
        if r.end is None:
            r.end = "eof" if (self.head is None and not r.chunked and r.length is None) else "closed"
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(r.end)


class ProtocolError(Exception):
    """The server's reply is not HTTP/1.1 spectune can read; the message says what."""


def dechunk(stamps: list[int], pieces: list[bytes]) -> tuple[list[int], list[bytes], bool]:
    """Chunked transfer coding off: (stamps, data pieces, complete). A chunk's data split over reads is cut at
    the reads' edges, each part keeping its read's stamp."""
    raw = b"".join(pieces)
    ends, total = [], 0  # where each read ends in `raw`
    for piece in pieces:
        total += len(piece)
        ends.append(total)
    out_stamps: list[int] = []
    out: list[bytes] = []
    find, k, pos = raw.find, 0, 0
    while True:
        eol = find(b"\r\n", pos)
        if eol < 0:
            return out_stamps, out, False
        try:
            size = int(raw[pos:eol].partition(b";")[0], 16)
        except ValueError:
            return out_stamps, out, False  # not chunk framing: the caller sees an incomplete body
        start = eol + 2
        if size == 0:
            return out_stamps, out, raw.startswith(b"\r\n", start)
        if start >= total:
            return out_stamps, out, False
        chunk_end = start + size
        end = min(chunk_end, total)  # a chunk cut off by the end of what came: its part that came
        while ends[k] <= start:
            k += 1
        while end > ends[k]:  # the chunk's data spans reads: each part keeps its own read's stamp
            out_stamps.append(stamps[k])
            out.append(raw[start:ends[k]])
            start = ends[k]
            k += 1
        if end > start:
            out_stamps.append(stamps[k])
            out.append(raw[start:end])
        pos = chunk_end + 2
        if pos > total:
            return out_stamps, out, False


def sse_events(response: RawResponse) -> Events:
    """The `data:` payloads of the body in arrival order, stripped, up to [DONE]; each stamped with the read that
    brought its line's end."""
    if response.chunked:
        fast = _one_event_per_chunk(response.stamps, response.pieces)
        if fast is not None:
            return fast
        return _split_lines(*dechunk(response.stamps, response.pieces)[:2])
    return _split_lines(response.stamps, response.pieces)


def _one_event_per_chunk(stamps: list[int], pieces: list[bytes]) -> Events | None:
    """The usual chunked SSE body (every chunk one "data: ...\n\n" event), read straight off the chunk framing
    at a third of _split_lines' cost; None as soon as a chunk is anything else."""
    raw = b"".join(pieces)
    ends, total = [], 0
    for piece in pieces:
        total += len(piece)
        ends.append(total)
    ev_stamps: list[int] = []
    payloads: list[bytes] = []
    find, starts, k, pos = raw.find, raw.startswith, 0, 0
    while True:
        eol = find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(raw[pos:eol], 16)
        except ValueError:
            return None  # a chunk extension, or not framing: the general path says which
        start = eol + 2
        end = start + size
        if size == 0 or end + 2 > total or not starts(b"data: ", start) or not starts(b"\n\n\r\n", end - 2) \
                or find(b"\n", start, end - 2) >= 0:
            return None
        while ends[k] <= end - 2:  # the read that brought the line's "\n"
            k += 1
        payload = raw[start + 6:end - 2]
        if payload[:1] != b"{" and payload.strip() == b"[DONE]":
            return Events(ev_stamps, payloads, True)
        ev_stamps.append(stamps[k])
        payloads.append(payload)
        pos = end + 2


def _split_lines(stamps: list[int], pieces: list[bytes]) -> Events:
    """Any SSE body (de-chunked): every `data:` line is a payload, stamped with the read that ended the line."""
    ev_stamps: list[int] = []
    payloads: list[bytes] = []
    carry = b""
    for ns, piece in zip(stamps, pieces):
        lines = (carry + piece).split(b"\n")
        carry = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return Events(ev_stamps, payloads, True)
                ev_stamps.append(ns)
                payloads.append(payload)
    return Events(ev_stamps, payloads, False)


def _has_error_event(response: RawResponse) -> bool:
    """An event naming "error" has come (a rare, slower check: only on reads that hold those bytes)."""
    import json

    for payload in sse_events(response).payloads:
        if b'"error"' in payload:
            try:
                chunk = json.loads(payload)
            except ValueError:
                continue
            if isinstance(chunk, dict) and "error" in chunk:
                return True
    return False
