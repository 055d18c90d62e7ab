"""Streaming load generator: sends a request list on a schedule and timestamps every chunk. No analysis.

Per chunk the reader does the least it can: stamp the arrival (perf_counter_ns), parse the JSON (a malformed
chunk or an error object ends the request at once) and keep it. Everything else waits for the end of the
request: text, and the tokens each chunk carried (spectune.tokens: per-chunk usage, llama-server timings,
token_ids, or the served model's tokenizer over the text, reconciled with the final usage total; never one
token per chunk unless the total confirms it).

Send times: each record keeps when the request was actually sent (`send_ns`) and, for schedules with arrival
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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import aiohttp

from spectune.records import Request, RequestRecord
from spectune.tokens import count_tokens
from spectune.workload import Schedule

if TYPE_CHECKING:
    from tokenizers import Tokenizer


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
) -> list[RequestRecord]:
    """Send `requests` on `schedule`; return one record per request (warm-up ones first, flagged).

    Request i carries seed `seed + i`. A request fails (recorded with its error, never dropped) on an
    HTTP status other than 200, a malformed chunk, a stream that ends without [DONE], no SSE line for
    `stall_timeout_s` (the wait for the first one included), or no end within `request_timeout_s`.
    Records are appended to `records` (pass an empty list, or None for a new one) as requests finish,
    and sorted by (warm-up first, index) at the end; that same list is returned. `tokenizer` (the served
    model's) counts the tokens of chunks that say nothing of their own (spectune.tokens).
    """
    out = [] if records is None else records
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    sender = _Sender(
        base_url=base_url.rstrip("/"),
        model=model,
        headers=headers,
        request_timeout_s=request_timeout_s,
        stall_timeout_s=stall_timeout_s,
        sampling=dict(temperature=temperature, seed=seed, ignore_eos=ignore_eos, extra_body=extra_body),
        tokenizer=tokenizer,
    )
    timeout = aiohttp.ClientTimeout(total=None)  # our own timer (see _Sender._stream) covers every wait
    counts = _Counts(on_requests)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        if warmup_requests > 0 and requests:
            warmup = [replace(requests[i % len(requests)], index=i) for i in range(warmup_requests)]
            await _run_phase(session, sender, warmup, schedule, out, counts, is_warmup=True)
            if after_warmup is not None:
                await asyncio.to_thread(after_warmup)
        await _run_phase(session, sender, requests, schedule, out, counts, is_warmup=False)
    out.sort(key=lambda r: (not r.warmup, r.index))
    return out


def run_cell(
    base_url: str,
    model: str,
    requests: list[Request],
    schedule: Schedule,
    **kwargs,
) -> list[RequestRecord]:
    """Blocking form of run_requests (same keyword arguments)."""
    return asyncio.run(run_requests(base_url, model, requests, schedule, **kwargs))


async def _run_phase(
    session: aiohttp.ClientSession,
    sender: _Sender,
    requests: list[Request],
    schedule: Schedule,
    out: list[RequestRecord],
    counts: _Counts,
    *,
    is_warmup: bool,
) -> None:
    """Dispatch in list order: wait for the request's offset, then for a free slot, then send."""
    offsets = schedule.send_offsets(requests)
    slots = asyncio.Semaphore(schedule.max_concurrency) if schedule.max_concurrency else None
    tasks: list[asyncio.Task] = []

    async def send(request: Request, intended_ns: int | None) -> None:
        counts.sent()
        try:
            out.append(await sender.send(session, request, is_warmup, intended_ns))
        finally:
            counts.ended()
            if slots is not None:
                slots.release()

    start_ns = time.perf_counter_ns()
    try:
        for request, offset in zip(requests, offsets):
            intended_ns = None
            if offset is not None:
                intended_ns = start_ns + int(offset * 1e9)
                delay_ns = intended_ns - time.perf_counter_ns()
                if delay_ns > 0:
                    await asyncio.sleep(delay_ns / 1e9)
            if slots is not None:
                await slots.acquire()  # waiting here is client-side queueing: the request is late from now on
            tasks.append(asyncio.create_task(send(request, intended_ns)))
        await asyncio.gather(*tasks)
    finally:  # on cancellation (or a bug), close every open stream before leaving
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
class _Sender:
    """Sends one request and records its stream. Holds the settings shared by every request of a run."""

    base_url: str
    model: str
    headers: dict[str, str]
    request_timeout_s: float
    stall_timeout_s: float
    sampling: dict  # request_body's keyword arguments
    tokenizer: Tokenizer | None = None

    async def send(
        self, session: aiohttp.ClientSession, request: Request, is_warmup: bool, intended_ns: int | None = None
    ) -> RequestRecord:
        path = "/v1/chat/completions" if request.messages is not None else "/v1/completions"
        data = json.dumps(request_body(request, self.model, **self.sampling)).encode("utf-8")
        for attempt in range(2):
            record = RequestRecord(index=request.index, send_ns=time.perf_counter_ns(), warmup=is_warmup, intended_ns=intended_ns)
            try:
                unsent = await self._stream(session, self.base_url + path, data, record)
            finally:
                record.end_ns = time.perf_counter_ns()
            if not unsent or attempt:
                return record
            # A pooled keep-alive connection the server had just closed: the request never left this
            # process, so it is sent once more on a new connection (and timed from then).
        return record

    async def _stream(self, session: aiohttp.ClientSession, url: str, data: bytes, record: RequestRecord) -> bool:
        """Fill `record`; True only when the request could not be written to a reused connection."""
        # One timer serves both limits: it is moved to min(request end, now + stall) before every read.
        # (asyncio.wait_for nested in asyncio.timeout can swallow the outer cancel on Python 3.11.)
        loop = asyncio.get_running_loop()
        request_end = loop.time() + self.request_timeout_s
        chunks: list[tuple[int, dict]] = []  # (arrival, parsed chunk): all the per-chunk work done while streaming
        timer = asyncio.timeout(min(request_end, loop.time() + self.stall_timeout_s))
        answered = False
        try:
            async with timer, session.post(url, data=data, headers=self.headers) as response:
                answered = True
                if response.status != 200:
                    body = await response.text(errors="replace")
                    record.error = f"http {response.status}: {body[:200]}"
                    return
                while True:
                    timer.reschedule(min(request_end, loop.time() + self.stall_timeout_s))
                    line = await response.content.readline()
                    now_ns = time.perf_counter_ns()
                    if not line:
                        record.error = f"stream ended early after {len(chunks)} chunks (no [DONE])"
                        return
                    payload = _sse_data(line)
                    if payload is None:
                        continue
                    if payload == b"[DONE]":
                        return
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        chunk = None
                    if not isinstance(chunk, dict):
                        record.error = f"malformed chunk: {payload[:100].decode('utf-8', 'replace')!r}"
                        return
                    if "error" in chunk:
                        record.error = f"server error in stream: {json.dumps(chunk['error'])[:200]}"
                        return
                    chunks.append((now_ns, chunk))
        except TimeoutError:
            if timer.when() is not None and timer.when() < request_end:
                record.error = f"stall: no chunk for {self.stall_timeout_s:g} s after {len(chunks)} chunks"
            else:
                record.error = f"timeout: no end after {self.request_timeout_s:g} s (request_timeout_s)"
        except aiohttp.ClientConnectorError as e:
            record.error = f"connection failed: {e}"
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ConnectionResetError) as e:
            record.error = f"stream ended early after {len(chunks)} chunks ({type(e).__name__}: {e})"
            return not answered and isinstance(e, (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError))
        except ValueError as e:  # aiohttp: a line longer than its buffer
            record.error = f"malformed chunk: {e}"
        finally:
            _fill(record, chunks, self.tokenizer)
        return False


def _fill(record: RequestRecord, chunks: list[tuple[int, dict]], tokenizer: Tokenizer | None) -> None:
    """The deferred per-chunk work, once the stream has ended: text and tokens per chunk."""
    counted = count_tokens(chunks, tokenizer)
    record.chunk_ns, record.chunk_tokens, record.text = counted.chunk_ns, counted.chunk_tokens, counted.text
    record.output_tokens, record.prompt_tokens = counted.output_tokens, counted.prompt_tokens
    record.token_source = counted.source


def _sse_data(line: bytes) -> bytes | None:
    """The payload of a `data:` line; None for blank, comment and other SSE field lines."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()
