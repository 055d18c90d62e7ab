"""A streaming server that sends its chunks as fast as the socket takes them: it saturates any client.

    python tests/flood_server.py    (prints the port it listens on, then serves until killed)

Its own process (so the client under test has the other core): per POST it streams `max_tokens` OpenAI-style
completion chunks of one token each (continuous usage), 64 per write, then [DONE], and closes the connection.
GET /v1/models answers for `spectune bench`. Raw asyncio streams: the cheapest way to make chunks in Python.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys

BATCH = 64


@functools.cache  # made once: the server's cost per chunk is a join
def _chunk(total: int) -> bytes:
    chunk = {"id": "f", "object": "text_completion", "choices": [{"index": 0, "text": " x", "finish_reason": None}],
             "usage": {"prompt_tokens": 3, "completion_tokens": total, "total_tokens": 3 + total}}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length) if length else b""
        if head.startswith(b"GET"):
            data = json.dumps({"object": "list", "data": [{"id": "flood", "object": "model"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        else:
            tokens = json.loads(body).get("max_tokens", 1000)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            for start in range(0, tokens, BATCH):
                writer.write(b"".join(_chunk(t + 1) for t in range(start, min(tokens, start + BATCH))))
                await writer.drain()
            writer.write(b"data: [DONE]\n\n")
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
