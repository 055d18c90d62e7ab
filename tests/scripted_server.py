"""A real aiohttp server on 127.0.0.1 that streams OpenAI-style SSE on a known script (for loadgen tests).

Every request gets: an empty first chunk (role only, no tokens), then one chunk per Step after its delay
carrying Step.tokens tokens, then a final usage chunk (no choices) and [DONE]. The server records what it
received and the perf_counter_ns time at which it wrote each token chunk: the ground truth for metrics.
`mode` injects one fault; `fail_indices` limits it to some requests (index = body seed - base_seed).

With a `tokenizer`, each chunk's text is real text that this tokenizer splits into exactly Step.tokens tokens
(the decoded pieces of one tokenized passage), as a server streaming k accepted tokens per chunk sends it.
GET /v1/models (and /health) make it attachable by `spectune bench` and an `openai` sweep. To catch a sweep at a
known point: from the `hold_from`-th request on (0-based, in arrival order) every stream waits after its role
chunk, and with `hold_models` GET /v1/models waits, until `release` is set (release_from_thread()).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web

MODES = ("ok", "http503", "http429", "drop", "malformed", "stall", "slow", "no_done", "error_chunk")
# How tokens are announced: continuous usage (vLLM/SGLang), token_ids only, llama-server timings only,
# or nothing per chunk (a final usage total only: the client must guess one token per chunk).
COUNTING = ("continuous", "token_ids", "timings", "final_only")


@dataclass(frozen=True, slots=True)
class Step:
    delay_s: float
    tokens: int


@dataclass(slots=True)
class Seen:
    path: str
    body: bytes
    recv_ns: int
    write_ns: list[int] = field(default_factory=list)  # token chunks only
    tokens: list[int] = field(default_factory=list)
    done_ns: int | None = None

    @property
    def index(self) -> int:
        return json.loads(self.body)["seed"]


DEFAULT_STEPS = (Step(0.05, 2), Step(0.03, 3), Step(0.02, 1), Step(0.04, 4), Step(0.01, 1))
PASSAGE = (  # ASCII prose and code: its tokens decode and re-encode to themselves
    "The quick brown fox jumps over the lazy dog while the server streams its answer. "
    "def add(a, b):\n    return a + b\n\nclass Counter:\n    def __init__(self):\n        self.count = 0\n"
)


class ScriptedServer:
    def __init__(
        self,
        steps: tuple[Step, ...] = DEFAULT_STEPS,
        mode: str = "ok",
        counting: str = "continuous",
        fail_indices: set[int] | None = None,
        usage_total_offset: int = 0,  # added to the final usage total, to fake a server that miscounts
        tokenizer=None,  # a tokenizers.Tokenizer: chunk text it splits into exactly Step.tokens tokens
        hold_from: int | None = None,
        hold_models: bool = False,
        model: str = "scripted",
    ) -> None:
        assert mode in MODES and counting in COUNTING
        self.steps, self.mode, self.counting = steps, mode, counting
        self.fail_indices = fail_indices
        self.usage_total_offset = usage_total_offset
        self.hold_from, self.hold_models, self.model = hold_from, hold_models, model
        self.loop: asyncio.AbstractEventLoop | None = None
        self.models_asked = 0
        self.pieces: list[str] | None = None  # with a tokenizer: the text of each step's chunk
        if tokenizer is not None:
            ids = tokenizer.encode(PASSAGE, add_special_tokens=False).ids
            ids = list(itertools.islice(itertools.cycle(ids), sum(step.tokens for step in steps)))
            full = tokenizer.decode(ids)
            cuts = [0] + [len(tokenizer.decode(ids[:end])) for end in itertools.accumulate(step.tokens for step in steps)]
            self.pieces = [full[a:b] for a, b in zip(cuts, cuts[1:])]
        self.seen: list[Seen] = []
        self.num_open = 0
        self.max_open = 0
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        self.release = asyncio.Event()  # bound to the running loop
        self.loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.models)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    def release_from_thread(self) -> None:
        """Let every held stream and model list go on (from a thread other than the server's)."""
        self.loop.call_soon_threadsafe(self.release.set)

    async def models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        if self.hold_models:
            await self.release.wait()
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        recv_ns = time.perf_counter_ns()
        seen = Seen(request.path, await request.read(), recv_ns)
        self.seen.append(seen)
        self.num_open += 1
        self.max_open = max(self.max_open, self.num_open)
        try:
            return await self._respond(request, seen)
        finally:
            self.num_open -= 1

    async def _respond(self, request: web.Request, seen: Seen) -> web.StreamResponse:
        mode = self.mode if self.fail_indices is None or seen.index in self.fail_indices else "ok"
        if mode in ("http503", "http429"):
            return web.Response(status=int(mode[4:]), text="server overloaded, retry later")
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await self._send(response, self._chunk(chat, 0, 0, first=True))
        if self.hold_from is not None and self.seen.index(seen) >= self.hold_from:
            await self.release.wait()
        total = 0
        for i, step in enumerate(self.steps):
            await asyncio.sleep(step.delay_s)
            if i == 2 and mode == "drop":
                request.transport.close()
                return response
            if i == 2 and mode == "malformed":
                await response.write(b'data: {"choices": [{"text": "x"\n\n')
                await self.release.wait()
                return response
            if i == 2 and mode == "error_chunk":
                await self._send(response, {"error": {"message": "engine died", "code": 500}})
                await self.release.wait()
                return response
            if i == 1 and mode == "stall":
                await self.release.wait()
                return response
            total += step.tokens
            seen.write_ns.append(time.perf_counter_ns())
            seen.tokens.append(step.tokens)
            await self._send(response, self._chunk(chat, step.tokens, total, step=i))
        while mode == "slow":  # keep streaming token-free chunks: the stall timer never fires
            await asyncio.sleep(0.02)
            await self._send(response, self._chunk(chat, 0, total))
        usage = {"prompt_tokens": 7, "completion_tokens": total + self.usage_total_offset, "total_tokens": 7 + total}
        if self.counting in ("continuous", "final_only", "token_ids"):
            await self._send(response, {"id": "x", "choices": [], "usage": usage})
        if mode != "no_done":
            seen.done_ns = time.perf_counter_ns()
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _chunk(self, chat: bool, tokens: int, total: int, first: bool = False, step: int | None = None) -> dict:
        if self.pieces is not None and step is not None:
            text = self.pieces[step]
        else:
            text = "".join(f" t{total - tokens + k}" for k in range(tokens))
        if chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""} if first else {"content": text}}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None}
        chunk: dict = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}
        if self.counting == "continuous":
            chunk["usage"] = {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total}
        elif self.counting == "token_ids":
            choice["token_ids"] = list(range(total - tokens, total))
        elif self.counting == "timings":
            chunk["timings"] = {"prompt_n": 7, "predicted_n": total}
        return chunk

    async def _send(self, response: web.StreamResponse, obj: dict) -> None:
        await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


@contextmanager
def serve_in_thread(server: ScriptedServer) -> Iterator[str]:
    """Run the server on its own event loop in a thread (for the blocking run_cell)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=10)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
