"""A real HTTP proxy on 127.0.0.1 in front of a real engine that injects faults a healthy engine never produces.

Used only by the fault-injection tests. Each completion request gets the fault `plan(n)` names (n counts
requests from 0), or passes through untouched when it names none.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Callable

import aiohttp
from aiohttp import web

FAULTS = ("http503", "http429", "reset", "truncate", "malformed", "stall")


class FaultProxy:
    def __init__(self, upstream: str, plan: Callable[[int], str | None], stall_s: float = 3600.0):
        self.upstream = upstream.rstrip("/")
        self.plan = plan
        self.stall_s = stall_s
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    def __enter__(self) -> "FaultProxy":
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._main(ready))

    async def _main(self, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as self._session:
            ready.set()
            await self._stop.wait()
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = None
        if request.path.endswith("/completions"):
            fault = self.plan(self.requests)
            self.requests += 1
            if fault:
                self.injected[fault] += 1
        if fault == "http503":
            return web.json_response({"error": {"message": "injected overload"}}, status=503)
        if fault == "http429":
            return web.json_response({"error": {"message": "injected rate limit"}}, status=429)
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers={k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}) as up:
            if "text/event-stream" not in up.headers.get("Content-Type", ""):
                return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            events = 0
            async for line in up.content:
                if line.startswith(b"data:"):
                    events += 1
                if events == 3 and fault in ("reset", "truncate", "malformed", "stall"):
                    if fault == "malformed":
                        await resp.write(b"data: {not json\n\n")
                        continue
                    if fault == "stall":
                        await asyncio.sleep(self.stall_s)  # the client's stall timeout must fire first
                    if fault == "reset":
                        request.transport.abort()  # type: ignore[union-attr]  (a TCP reset mid-stream)
                        return resp
                    return resp  # truncate: end the stream early, without [DONE]
                await resp.write(line)
            await resp.write_eof()
            return resp
