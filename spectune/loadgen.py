"""Streaming load generator: sends a request list on a schedule and timestamps every chunk. No analysis.

Per chunk the reader does the least it can. It reads the stream in whatever pieces the socket holds (under
load, several SSE events per read) and stamps each read once when it returns (perf_counter_ns; the events of one
read share that stamp: that is when the client saw them). On plain http:// (spectune.rawhttp) a read is only
stamped and kept: chunk framing and SSE lines are decoded in _fill, and a malformed payload is named when its
stream ends or stalls. Over aiohttp (https) the reader splits the events itself as it reads (a payload that is
not a JSON object ends the request at once). Either way an event naming "error" ends the request at once. The stall and
request limits are one lazy timer per request that a read never reschedules (_Watchdog), and the loop is
uvloop's where installed (event_loop_factory). Profiled (benchmarks/loadgen.py --profile py-spy), the time per
chunk had gone to aiohttp's readline (2 calls per event), timer reschedules and json.loads; and with parsed
chunks alive until their request ended, the cyclic GC stopped the loop for ~10 ms at a time.
Everything else waits until the phase's streams have all ended (_Collect): parsing (orjson where installed), text, and the tokens each
chunk carried (spectune.tokens: per-chunk usage, llama-server timings, token_ids, or the served model's tokenizer
over the text, reconciled with the final usage total; never one token per chunk unless the total confirms it).

Send times: each record keeps when the request was actually sent (`send_ns`: when its body was handed to the
socket, so the client's own queueing before that is not in TTFT) and, for schedules with arrival
offsets (trace, Poisson), when it was meant to be (`intended_ns`): a request that waits for a free slot under
the concurrency cap is late by that wait, and latency measured from the intended time shows it (no coordinated
omission). Closed loop has no intended time of its own: a request is meant to go when a slot frees.

Warm-up: `warmup_requests` requests (taken cyclically from the same list) go first, through the same
schedule, and are returned flagged `warmup=True` (analysis leaves them out). `after_warmup` runs once
they have all finished, e.g. to reset the server's prefix cache, which they have just filled.

Progress: `on_requests(in_flight, finished)` is called when a request is sent and when it ends (warm-up
included), never per chunk.

Cancellation (Ctrl-C): in-flight requests are cancelled and their connections closed; the records
finished so far stay in the `records` list the caller passed in (in-flight ones are not recorded).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import aiohttp

from spectune import rawhttp
from spectune.clientload import ClientLoad, LoopProbe
from spectune.records import Request, RequestRecord
from spectune.tokens import count_tokens
from spectune.workload import Schedule

if TYPE_CHECKING:
    from tokenizers import Tokenizer

try:  # optional (pyproject extra "fast"): 3-5x faster than json on these small objects
    import orjson

    _loads, _dumps = orjson.loads, orjson.dumps
except ImportError:
    _loads = json.loads

    def _dumps(body: dict) -> bytes:
        return json.dumps(body).encode("utf-8")

MAX_LINE = 1 << 20  # bytes: an unfinished SSE line longer than this is a malformed stream, not a slow one
FILL_AT_BYTES = 256 << 20  # raw payloads kept unparsed before the oldest are parsed mid-phase (_Collect)


def request_body(
    request: Request, model: str, *, temperature: float, seed: int, ignore_eos: bool, extra_body: dict | None = None
) -> dict:
    """The JSON body sent for one request; its per-request seed is `seed + request.index`."""
    body: dict = {"model": model}
    if request.messages is not None:
        body["messages"] = [{"role": role, "content": content} for role, content in request.messages]
    else:
        body["prompt"] = request.prompt
    body |= {
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": ignore_eos,
        "temperature": temperature,
        "seed": seed + request.index,
    }
    return body | (extra_body or {})


async def run_requests(
    base_url: str,
    model: str,
    requests: list[Request],
    schedule: Schedule,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    ignore_eos: bool = True,
    api_key: str | None = None,
    request_timeout_s: float = 120.0,
    stall_timeout_s: float = 30.0,
    extra_body: dict | None = None,
    warmup_requests: int = 0,
    after_warmup: Callable[[], None] | None = None,
    records: list[RequestRecord] | None = None,
    tokenizer: Tokenizer | None = None,
    on_requests: Callable[[int, int], None] | None = None,
    workers: int = 1,
    client_load: ClientLoad | None = None,
    http_client: str = "auto",
) -> list[RequestRecord]:
    """Send `requests` on `schedule`; return one record per request (warm-up ones first, flagged).

    Request i carries seed `seed + i`. A request fails (recorded with its error, never dropped) on an
    HTTP status other than 200, a malformed chunk, a stream that ends without [DONE], nothing read for
    `stall_timeout_s` (the wait for the first byte included), or no end within `request_timeout_s`.
    Records are appended to `records` (pass an empty list, or None for a new one) as requests finish,
    and sorted by (warm-up first, index) at the end; that same list is returned. `tokenizer` (the served
    model's) counts the tokens of chunks that say nothing of their own (spectune.tokens).
    `workers` > 1 spreads the requests over that many processes (spectune.loadworkers), same schedule, same
    records. `client_load`, when given, is filled with the client's own load during the measured phase
    (spectune.clientload): whether its timestamps measure the server or itself. `http_client`: "auto" streams
    plain http:// through spectune.rawhttp and the rest through aiohttp; "aiohttp" uses aiohttp for every URL.
    """
    out = [] if records is None else records
    sender = _Sender.make(base_url, model, api_key=api_key, request_timeout_s=request_timeout_s,
                          stall_timeout_s=stall_timeout_s, tokenizer=tokenizer, use_rawhttp=http_client == "auto",
                          sampling=dict(temperature=temperature, seed=seed, ignore_eos=ignore_eos, extra_body=extra_body))
    collect = _Collect(out, _Counts(on_requests), tokenizer)
    warmup = [replace(requests[i % len(requests)], index=i) for i in range(warmup_requests)] if requests else []
    load = ClientLoad() if client_load is None else client_load
    phases = [Phase(warmup, schedule, is_warmup=True), Phase(requests, schedule, is_warmup=False)]
    if workers > 1:
        from spectune.loadworkers import run_in_workers

        await run_in_workers(sender, phases, workers, collect, after_warmup, load)
    else:
        async with sender.session() as session:
            for phase in phases:
                if not phase.requests:
                    continue
                if not phase.is_warmup and warmup and after_warmup is not None:
                    await asyncio.to_thread(after_warmup)
                probe = None if phase.is_warmup else LoopProbe.start()
                offsets = phase.schedule.send_offsets(phase.requests)
                try:
                    await _run_phase(session, sender, phase.requests, offsets, phase.schedule.max_concurrency,
                                     time.perf_counter_ns(), collect.counts.sent, collect.ended, is_warmup=phase.is_warmup)
                finally:
                    if probe is not None:
                        load.add(probe.stop())
                    collect.finish()  # parse and count now that no stream of the phase is open
    load.deferred_cpu_s = collect.cpu_s
    out.sort(key=lambda r: (not r.warmup, r.index))
    return out


def run_cell(
    base_url: str,
    model: str,
    requests: list[Request],
    schedule: Schedule,
    **kwargs,
) -> list[RequestRecord]:
    """Blocking form of run_requests (same keyword arguments), on uvloop where it is installed."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(run_requests(base_url, model, requests, schedule, **kwargs))


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (less CPU per chunk), else None: asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@dataclass(frozen=True, slots=True)
class Phase:
    """The warm-up or the measured requests of a run, sent on one schedule."""

    requests: list[Request]
    schedule: Schedule
    is_warmup: bool


async def _run_phase(
    session: aiohttp.ClientSession,
    sender: _Sender,
    requests: list[Request],
    offsets: list[float | None],
    max_concurrency: int | None,
    start_ns: int,
    on_sent: Callable[[], None],
    on_ended: Callable[[RequestRecord | None, _Chunks | None], None],
    *,
    is_warmup: bool,
) -> None:
    """Dispatch in list order from `start_ns` (perf_counter_ns, one clock for every process on Linux): wait for
    the request's offset, then for a free slot, then send. `on_ended` gets the record and its raw chunks (None, None
    if cancelled)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks: list[asyncio.Task] = []

    async def send(request: Request, intended_ns: int | None) -> None:
        on_sent()
        record = chunks = None
        try:
            record, chunks = await sender.send(session, request, is_warmup, intended_ns)
        finally:
            on_ended(record, chunks)
            if slots is not None:
                slots.release()

    try:
        await _sleep_until(start_ns)  # workers start together
        for request, offset in zip(requests, offsets):
            intended_ns = None
            if offset is not None:
                intended_ns = start_ns + int(offset * 1e9)
                await _sleep_until(intended_ns)
            if slots is not None:
                await slots.acquire()  # waiting here is client-side queueing: the request is late from now on
            tasks.append(asyncio.create_task(send(request, intended_ns)))
        await asyncio.gather(*tasks)
    finally:  # on cancellation (or a bug), close every open stream before leaving
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sleep_until(when_ns: int) -> None:
    """Sleep until perf_counter_ns() >= when_ns: loop timers may fire early (uvloop's count whole ms from a cached
    time), and a request must never go before its intended time."""
    while (delay_ns := when_ns - time.perf_counter_ns()) > 0:
        await asyncio.sleep(delay_ns / 1e9)


@dataclass(slots=True)
class _Counts:
    """Requests in flight and finished, passed to the caller's callback on every change."""

    notify: Callable[[int, int], None] | None
    in_flight: int = 0
    finished: int = 0

    def sent(self) -> None:
        self.in_flight += 1
        if self.notify is not None:
            self.notify(self.in_flight, self.finished)

    def ended(self) -> None:
        self.in_flight -= 1
        self.finished += 1
        if self.notify is not None:
            self.notify(self.in_flight, self.finished)


@dataclass(slots=True)
class _Collect:
    """Keeps each finished record (a cancelled request has none) and counts it. Its chunks are parsed and counted
    (_fill) once the phase's streams have all ended (finish), not while others still stream: that work, ~3 us per
    chunk, done as each request ended, delayed the last chunks of the requests ending beside it; past
    FILL_AT_BYTES of raw payloads the oldest are filled at once (memory over timing on very long cells)."""

    out: list[RequestRecord]
    counts: _Counts
    tokenizer: Tokenizer | None = None
    pending: list[tuple[RequestRecord, _Chunks]] = field(default_factory=list)
    pending_bytes: int = 0
    cpu_s: float = 0.0  # spent in finish()

    def ended(self, record: RequestRecord | None, chunks: _Chunks | None) -> None:
        if record is not None and chunks is not None:
            self.out.append(record)
            self.pending.append((record, chunks))
            self.pending_bytes += chunks.size
            if self.pending_bytes > FILL_AT_BYTES:
                self.finish()
        self.counts.ended()

    def finish(self) -> None:
        began = time.thread_time()
        for record, chunks in self.pending:
            _fill(record, chunks, self.tokenizer)
        self.pending.clear()
        self.pending_bytes = 0
        self.cpu_s += time.thread_time() - began


class _Expired(Exception):
    """The watchdog ended a stream: `why` is the record's error."""


@dataclass(slots=True)
class _Watchdog:
    """One lazy timer per request for both limits: each read only stores its time (`last_ns`); the timer, when it
    fires, re-arms itself for `last_ns + stall` if data came meanwhile, else cancels the stream. No per-read
    reschedule, so its cost is per stall period, not per chunk."""

    loop: asyncio.AbstractEventLoop
    task: asyncio.Task
    stall_ns: int
    end_ns: int  # perf_counter_ns by which the request must have ended
    last_ns: int
    why: str | None = None
    handle: asyncio.TimerHandle | None = None
    response: rawhttp.RawResponse | None = None  # raw path: its last_ns is the latest read

    def latest_ns(self) -> int:
        return self.last_ns if self.response is None else self.response.last_ns

    def arm(self) -> None:
        due_ns = min(self.end_ns, self.latest_ns() + self.stall_ns)
        self.handle = self.loop.call_later(max(0, due_ns - time.perf_counter_ns()) / 1e9, self.check)

    def check(self) -> None:
        now = time.perf_counter_ns()
        if now >= self.end_ns:
            self.why = "timeout"
        elif now >= self.latest_ns() + self.stall_ns:
            self.why = "stall"
        else:
            self.arm()
            return
        self.task.cancel()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()


@dataclass(slots=True)
class _Sender:
    """Sends one request and records its stream. Holds the settings shared by every request of a run (picklable:
    workers get a copy)."""

    base_url: str
    model: str
    headers: dict[str, str]
    request_timeout_s: float
    stall_timeout_s: float
    sampling: dict  # request_body's keyword arguments
    tokenizer: Tokenizer | None = None
    use_rawhttp: bool = True  # for plain http:// URLs

    @classmethod
    def make(cls, base_url: str, model: str, *, api_key: str | None, **settings) -> _Sender:
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        return cls(base_url=base_url.rstrip("/"), model=model, headers=headers, **settings)

    def session(self) -> rawhttp.Pool | aiohttp.ClientSession:
        """Plain http://: rawhttp (a read costs a stamp and an append); https and the rest: aiohttp."""
        if self.use_rawhttp and self.base_url.startswith("http://"):
            return rawhttp.Pool(self.base_url)
        timeout = aiohttp.ClientTimeout(total=None)  # our own watchdog (see _stream) covers every wait
        sent = aiohttp.TraceConfig()
        sent.on_request_chunk_sent.append(_stamp_sent)
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout, trace_configs=[sent])

    async def send(
        self, session: rawhttp.Pool | aiohttp.ClientSession, request: Request, is_warmup: bool,
        intended_ns: int | None = None,
    ) -> tuple[RequestRecord, _Chunks | rawhttp.RawResponse]:
        """The record (its token fields left for _fill) and the chunks as read."""
        path = "/v1/chat/completions" if request.messages is not None else "/v1/completions"
        data = _dumps(request_body(request, self.model, **self.sampling))
        for attempt in range(2):
            record = RequestRecord(index=request.index, send_ns=time.perf_counter_ns(), warmup=is_warmup, intended_ns=intended_ns)
            chunks: _Chunks | rawhttp.RawResponse
            try:
                if isinstance(session, rawhttp.Pool):
                    chunks = rawhttp.RawResponse(last_ns=record.send_ns)  # each read, stamped: decoded in _fill
                    unsent = await self._stream_raw(session, path, data, record, chunks)
                else:
                    chunks = _Chunks()  # arrival stamps and raw payloads: all the per-chunk work done while streaming
                    unsent = await self._stream(session, self.base_url + path, data, record, chunks)
            finally:
                record.end_ns = time.perf_counter_ns()
            if not unsent or attempt:
                return record, chunks
            # A pooled keep-alive connection the server had just closed: the request never left this
            # process, so it is sent once more on a new connection (and timed from then).
        return record, chunks

    async def _stream(self, session: aiohttp.ClientSession, url: str, data: bytes, record: RequestRecord,
                      chunks: _Chunks) -> bool:
        """Fill `record`'s times and error and `chunks`; True only when the request could not be written to a reused
        connection."""
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        dog = _Watchdog(asyncio.get_running_loop(), task, int(self.stall_timeout_s * 1e9),
                        record.send_ns + int(self.request_timeout_s * 1e9), record.send_ns)
        dog.arm()
        answered = False
        try:
            try:
                async with session.post(url, data=data, headers=self.headers, trace_request_ctx=record) as response:
                    answered = True
                    if response.status != 200:
                        body = await response.text(errors="replace")
                        record.error = f"http {response.status}: {body[:200]}"
                        return False
                    record.error = await _read_events(response.content, dog, chunks)
            except asyncio.CancelledError:
                if dog.why is None or task.uncancel() > cancelling:
                    raise  # cancelled from outside (Ctrl-C, the run ending): not ours to record
                raise _Expired(dog.why) from None
        except _Expired as e:
            if str(e) == "stall":
                record.error = f"stall: no chunk for {self.stall_timeout_s:g} s after {len(chunks.payloads)} chunks"
            else:
                record.error = f"timeout: no end after {self.request_timeout_s:g} s (request_timeout_s)"
        except aiohttp.ClientConnectorError as e:
            record.error = f"connection failed: {e}"
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ConnectionResetError) as e:
            record.error = f"stream ended early after {len(chunks.payloads)} chunks ({type(e).__name__}: {e})"
            return not answered and isinstance(e, (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError))
        finally:
            dog.close()
        return False

    async def _stream_raw(self, pool: rawhttp.Pool, path: str, data: bytes, record: RequestRecord,
                          response: rawhttp.RawResponse) -> bool:
        """_stream over rawhttp: the same times and errors; the payloads are split from the reads in _fill (here only
        when the stream ended otherwise than with [DONE], to name the cause)."""
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        try:
            conn, reused = await pool.connection()
        except OSError as e:
            record.error = f"connection failed: cannot connect to {pool.host}:{pool.port} ({e})"
            return False
        request = pool.request_bytes(path, data, self.headers)
        record.send_ns = response.last_ns = time.perf_counter_ns()  # the write below hands it to the socket at once
        ended = conn.send(request, response)
        dog = _Watchdog(asyncio.get_running_loop(), task, int(self.stall_timeout_s * 1e9),
                        record.send_ns + int(self.request_timeout_s * 1e9), record.send_ns, response=response)
        dog.arm()
        try:
            why = await ended
        except asyncio.CancelledError:
            conn.abandon()
            if dog.why is None or task.uncancel() > cancelling:
                raise  # cancelled from outside (Ctrl-C, the run ending): not ours to record
            why = dog.why
        except rawhttp.ProtocolError as e:
            record.error = f"bad response: {e}"
            return False
        finally:
            dog.close()
        if why == "closed" and reused and response.status == 0:
            return True  # a pooled connection the server had closed: nothing of ours was answered
        if response.status == 0:
            record.error = "stream ended early after 0 chunks (the connection closed before a response)"
        elif response.status != 200:
            body = response.body().decode("utf-8", "replace")
            record.error = f"http {response.status}: {body[:200]}"
        elif why != "done":
            record.error = self._raw_error(why, rawhttp.sse_events(response))
        return False

    def _raw_error(self, why: str, events: rawhttp.Events) -> str | None:
        """Why a stream that did not end with [DONE] failed: a malformed or error event before its end, else the end."""
        for payload in events.payloads:
            if (error := _payload_error(payload)) is not None:
                return error
        n = len(events.payloads)
        if why == "stall":
            return f"stall: no chunk for {self.stall_timeout_s:g} s after {n} chunks"
        if why == "timeout":
            return f"timeout: no end after {self.request_timeout_s:g} s (request_timeout_s)"
        if events.done:
            return None  # [DONE] came split over two reads: found only now
        if why == "closed":
            return f"stream ended early after {n} chunks (the connection closed mid-stream)"
        return f"stream ended early after {n} chunks (no [DONE])"


async def _stamp_sent(session: aiohttp.ClientSession, context, params: aiohttp.TraceRequestChunkSentParams) -> None:
    """The body's bytes were just handed to the socket: that, not when aiohttp began building the request, is
    when it was sent (on Python < 3.12 aiohttp writes the body from a task of its own, queued behind every ready
    read; at 64 streams that put ~4 ms of the client's own queueing into TTFT)."""
    context.trace_request_ctx.send_ns = time.perf_counter_ns()


@dataclass(slots=True)
class _Chunks:
    """One stream's chunks as read: two flat lists, no object per chunk (the payloads are parsed when the request
    ends: thousands of live parsed dicts made Python's cyclic GC stop the loop for ~10 ms at a time)."""

    stamps: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(map(len, self.payloads))


async def _read_events(content: aiohttp.StreamReader, dog: _Watchdog, chunks: _Chunks) -> str | None:
    """Read the SSE stream in whatever pieces the socket gives (often several events per read) until [DONE];
    each event is stamped with the time its read returned. Returns the record's error, None on [DONE].

    A payload that is not a JSON object ({...}) or that holds an "error" key ends the request at once; one that
    only looks like an object is found malformed when the request ends (_fill)."""
    pending = b""
    stamps, payloads = chunks.stamps, chunks.payloads
    while True:
        data = await content.readany()
        now_ns = time.perf_counter_ns()
        dog.last_ns = now_ns
        if not data:
            return f"stream ended early after {len(payloads)} chunks (no [DONE])"
        lines = (pending + data if pending else data).split(b"\n")
        pending = lines.pop()  # the unfinished last line (b"" when the read ended on a newline)
        if len(pending) > MAX_LINE:
            return f"malformed chunk: an SSE line longer than {MAX_LINE} bytes"
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank, comment and other SSE field lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return None
            if (error := _payload_error(payload)) is not None:
                return error
            stamps.append(now_ns)
            payloads.append(payload)


def _payload_error(payload: bytes) -> str | None:
    """Why one SSE data payload ends its request: not a JSON object ({...}), or an object with an "error" key."""
    if payload[-1:] != b"}" or payload[:1] != b"{":
        return f"malformed chunk: {payload[:100].decode('utf-8', 'replace')!r}"
    if b'"error"' in payload:  # a cheap test first: JSON escapes every quote inside a string
        try:
            chunk = _loads(payload)
        except ValueError:
            return f"malformed chunk: {payload[:100].decode('utf-8', 'replace')!r}"
        if isinstance(chunk, dict) and "error" in chunk:
            return f"server error in stream: {json.dumps(chunk['error'])[:200]}"
    return None


def _fill(record: RequestRecord, chunks: _Chunks | rawhttp.RawResponse, tokenizer: Tokenizer | None) -> None:
    """The deferred per-chunk work, once the stream has ended: split the reads into events (rawhttp), parse, then
    text and tokens per chunk."""
    if isinstance(chunks, rawhttp.RawResponse):
        if chunks.status != 200:
            return
        events = rawhttp.sse_events(chunks)
        chunks = _Chunks(events.stamps, events.payloads)
    parsed: list[tuple[int, dict]] = []
    for ns, payload in zip(chunks.stamps, chunks.payloads):
        try:
            chunk = _loads(payload)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            record.error = record.error or f"malformed chunk: {payload[:100].decode('utf-8', 'replace')!r}"
            break
        if "error" in chunk:  # raw path: an error event split over reads
            record.error = record.error or f"server error in stream: {json.dumps(chunk['error'])[:200]}"
            break
        parsed.append((ns, chunk))
    counted = count_tokens(parsed, tokenizer)
    record.chunk_ns, record.chunk_tokens, record.text = counted.chunk_ns, counted.chunk_tokens, counted.text
    record.output_tokens, record.prompt_tokens = counted.output_tokens, counted.prompt_tokens
    record.token_source = counted.source
