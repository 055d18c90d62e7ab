"""OpenAI-compatible HTTP front of the engine (aiohttp), with vLLM-style /metrics and SGLang-style /server_info.

The engine runs in its own thread; each request registers a callback that hops its outputs onto the event loop.
One SSE chunk per engine step per request, carrying every token accepted in that step.
There is no prefix cache, so /reset_prefix_cache and /flush_cache succeed without doing anything.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from spectune.engine.config import ServeOptions
from spectune.engine.engine import EngineThread, LLMEngine
from spectune.engine.scheduler import RequestOutput, SamplingParams


class BadRequest(ValueError):
    """A client error: HTTP 400 with an OpenAI-style error body."""


class TextCodec:
    """tokenizer.json via `tokenizers` (no transformers at run time); decodes output incrementally."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        file = model_dir / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(file)) if file.is_file() else None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest("prompt: this model has no tokenizer.json; send token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


class IncrementalText:
    """Text deltas of a growing token list, decoding only a short window (vLLM's prefix/read offsets).

    Decoding the window with and without the new tokens and diffing keeps the decoder's context (leading-space
    rules, multi-token characters) without re-decoding the whole output every step.
    """

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into text

    def push(self, new_ids: list[int], final: bool) -> str:
        self.ids.extend(new_ids)
        done = self.codec.decode(self.ids[self.prefix : self.read])
        full = self.codec.decode(self.ids[self.prefix :])
        if len(full) <= len(done) or (full.endswith("\ufffd") and not final):  # an incomplete character: wait
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(done) :]


def chat_prompt(messages: object) -> str:
    """A plain 'role: content' line per message, then 'assistant:' (no Jinja chat template at run time)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty list of {role, content}")
    lines = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("messages: each message needs a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest("messages: 'content' must be a string or a list of text parts")
        lines.append(f"{m['role']}: {content}\n")
    return "".join(lines) + "assistant:"


@dataclass(slots=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool


def parse_request(body: object, codec: TextCodec, is_chat: bool, max_model_len: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    if is_chat:
        prompt_ids = codec.encode(chat_prompt(body.get("messages")))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = codec.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = prompt
        else:
            raise BadRequest("prompt: must be a string or a non-empty list of token ids (one prompt per request)")
    if body.get("n", 1) != 1:
        raise BadRequest("n: only n=1 is supported")
    for key, neutral in (("top_p", 1), ("top_k", -1), ("best_of", 1)):
        if body.get(key) not in (None, neutral) and not (key == "top_k" and body.get(key) == 0):
            raise BadRequest(f"{key}: not supported by the embedded engine; leave it unset")
    if body.get("stop") or body.get("logprobs"):
        raise BadRequest("stop/logprobs: not supported by the embedded engine")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = max(max_model_len - len(prompt_ids), 1) if is_chat else 16
    temperature = body.get("temperature", 1.0)
    seed = body.get("seed")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest("max_tokens: must be an integer >= 1")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
        raise BadRequest("temperature: must be a number >= 0")
    if seed is not None and not _is_int(seed):
        raise BadRequest("seed: must be an integer")
    ignore_eos = body.get("ignore_eos", False)
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(ignore_eos, bool) or not isinstance(stream, bool) or not isinstance(options, dict):
        raise BadRequest("ignore_eos/stream: must be booleans; stream_options: an object")
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature), ignore_eos=ignore_eos, seed=seed)
    return ParsedRequest(prompt_ids, params, stream, bool(options.get("include_usage")), bool(options.get("continuous_usage_stats")))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _error(status: int, message: str) -> web.Response:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return web.json_response({"object": "error", "error": {"message": message, "type": kind, "param": None, "code": status}}, status=status)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Server:
    def __init__(self, engine: LLMEngine, options: ServeOptions):
        self.engine = engine
        self.loop_thread = EngineThread(engine)
        self.model_name = options.served_model_name or engine.model_path.name
        self.codec = TextCodec(engine.model_path)
        self.speculative = engine.config.speculative

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_post("/reset_prefix_cache", self.reset_cache)
        app.router.add_post("/flush_cache", self.reset_cache)
        app.router.add_get("/flush_cache", self.reset_cache)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=True)

    async def _generate(self, request: web.Request, is_chat: bool) -> web.StreamResponse:
        received_s = time.perf_counter()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "body: not valid JSON")
        try:
            req = parse_request(body, self.codec, is_chat, self.engine.max_model_len)
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            request_id = self.loop_thread.submit(req.prompt_ids, req.params, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out),
                                                 received_s)
        except ValueError as exc:  # BadRequest, or the engine's own request check
            return _error(400, str(exc))
        try:
            if not req.stream:
                return await self._collect(req, queue, is_chat)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                await self._stream(response, req, queue, is_chat)
            except ConnectionResetError:
                self.loop_thread.abort(request_id)  # the client went away mid-stream: stop generating for it
            return response
        except asyncio.CancelledError:
            self.loop_thread.abort(request_id)
            raise

    async def _collect(self, req: ParsedRequest, queue: asyncio.Queue, is_chat: bool) -> web.Response:
        ids: list[int] = []
        while True:
            out = await queue.get()
            ids.extend(out.new_token_ids)
            if out.finished:
                break
        if out.error:
            return _error(500, out.error)
        text = self.codec.decode(ids)
        usage = _usage(out.num_prompt_tokens, len(ids))
        base = {"id": f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": out.finish_reason}
            return web.json_response({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
        return web.json_response({**base, "object": "text_completion", "choices": [choice], "usage": usage})

    async def _stream(self, response: web.StreamResponse, req: ParsedRequest, queue: asyncio.Queue, is_chat: bool) -> None:
        base = {"id": f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name,
                "object": "chat.completion.chunk" if is_chat else "text_completion"}

        async def send(choices: list, usage: dict | None = None) -> None:
            chunk = {**base, "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        prompt_tokens = len(req.prompt_ids)
        if is_chat:
            await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                       _usage(prompt_tokens, 0) if req.continuous_usage else None)
        text = IncrementalText(self.codec)
        while True:
            out = await queue.get()
            if out.error:
                error = {"error": {"message": out.error, "type": "InternalServerError", "code": 500}}
                await response.write(f"data: {json.dumps(error)}\n\n".encode())
                break
            delta = text.push(out.new_token_ids, final=out.finished)
            if out.new_token_ids or out.finished:
                content = {"delta": {"content": delta}} if is_chat else {"text": delta}
                choice = {"index": 0, **content, "logprobs": None, "finish_reason": out.finish_reason}
                await send([choice], _usage(prompt_tokens, len(text.ids)) if req.continuous_usage else None)
            if out.finished:
                if req.include_usage:
                    await send([], _usage(prompt_tokens, len(text.ids)))
                break
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "spectune",
                "root": str(self.engine.model_path), "max_model_len": self.engine.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def reset_cache(self, request: web.Request) -> web.Response:
        return web.Response(status=200, text="no prefix cache; nothing to reset")

    async def server_info(self, request: web.Request) -> web.Response:
        m = self.engine.metrics
        spec = self.speculative
        state = {"speculative_num_steps": self.engine.num_steps, "avg_spec_accept_length": m.avg_spec_accept_length}
        return web.json_response({
            "internal_states": [state],
            "model_path": str(self.engine.model_path),
            "served_model_name": self.model_name,
            "speculative_algorithm": spec.method if spec else None,
            "speculative_adaptive": self.engine.config.adaptive_config is not None,
            "max_num_seqs": self.engine.config.max_num_seqs,
            "max_model_len": self.engine.max_model_len,
        })

    async def metrics(self, request: web.Request) -> web.Response:
        with self.engine.metrics_lock:
            m = self.engine.metrics
            counters = [
                ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", {}, m.prompt_tokens),
                ("vllm:generation_tokens_total", "Number of generation tokens processed.", {}, m.generation_tokens),
            ]
            if self.speculative is not None:
                counters += [
                    ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", {}, m.num_drafts),
                    ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", {}, m.num_draft_tokens),
                    ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", {}, m.num_accepted_tokens),
                ]
                per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                doc = "Accepted tokens per draft position."
                counters += [(per_pos, doc, {"position": str(i)}, n) for i, n in enumerate(m.accepted_per_pos)]
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", self.loop_thread.num_running()),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", self.loop_thread.num_waiting()),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", self.engine.kv_cache_usage()),
        ]
        labels = f'engine="0",model_name="{self.model_name}"'
        lines, seen = [], set()
        for name, doc, extra, value in counters:
            if name not in seen:
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
                seen.add(name)
            extra_labels = "".join(f',{k}="{v}"' for k, v in extra.items())
            lines.append(f"{name}{{{labels}{extra_labels}}} {float(value)}")
        for name, doc, value in gauges:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")


async def serve_async(options: ServeOptions, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Load the engine, serve until `stop` is set (or forever), print one ready line with the bound address."""
    engine = await asyncio.to_thread(LLMEngine, options.engine)
    server = Server(engine, options)
    server.loop_thread.start()
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"spectune engine serving {server.model_name} on http://{host}:{port}", flush=True)
    if ready is not None:
        ready.set()
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()
        server.loop_thread.stop()


def serve(options: ServeOptions) -> None:
    try:
        asyncio.run(serve_async(options))
    except KeyboardInterrupt:
        pass
