"""A stub OpenAI-compatible server for the fleet's tests and the router benchmark.

``python tests/serve_stub.py --host H --port P [--token-delay S] [--tokens N]``
answers ``/health``, ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions``, streamed (SSE) or not, with ``N`` tokens, waiting ``S``
seconds before each (0: at once); ``--fail 500`` answers every completion
with that status, and a model other than ``--model`` gets a 404. A real
process (aiohttp), so kill -9, restarts and streaming are real. A body that
is not a JSON object, or lacks ``messages`` / ``prompt``, gets an
OpenAI-shaped 400.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from aiohttp import web


def error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None}}
    return web.json_response(body, status=status)


class Stub:
    def __init__(self, port: int, model: str, tokens: int, delay: float, fail: int = 0) -> None:
        self.port, self.model, self.tokens, self.delay = port, model, tokens, delay
        self.fail = fail

    def words(self, n: int) -> list[str]:
        return [f"stub{self.port}" if i == 0 else f" t{i}" for i in range(n)]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "stub"}]}
        )

    async def completion(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body: Any = json.loads(await request.read())
        except ValueError:
            return error(400, "the body is not valid JSON")
        if not isinstance(body, dict) or ("messages" if chat else "prompt") not in body:
            return error(400, "missing " + ("messages" if chat else "prompt"))
        if body.get("model") not in (None, "", self.model):
            return error(404, f"the model {body['model']!r} does not exist")
        if self.fail:
            return error(self.fail, "this stub was told to fail")
        n = min(int(body.get("max_tokens") or self.tokens), self.tokens)
        words = self.words(n)
        if body.get("stream"):
            return await self.stream(request, chat, words)
        if self.delay:
            await asyncio.sleep(self.delay * n)
        text = "".join(words)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response(
            {
                "id": f"stub-{time.monotonic_ns()}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
            }
        )

    async def stream(
        self, request: web.Request, chat: bool, words: list[str]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = int(time.time())
        for word in words:
            if self.delay:
                await asyncio.sleep(self.delay)
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": word}}
            else:
                choice = {"index": 0, "text": word}
            chunk = {
                "id": "stub",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.model,
                "choices": [{**choice, "finish_reason": None}],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--fail", type=int, default=0, help="answer completions with this status")
    args = parser.parse_args()
    print(f"stub pid {os.getpid()} on port {args.port}", flush=True)
    stub = Stub(args.port, args.model, args.tokens, args.token_delay, args.fail)
    app = web.Application()
    app.router.add_get("/health", stub.health)
    app.router.add_get("/v1/models", stub.models)
    app.router.add_post("/v1/chat/completions", stub.completion)
    app.router.add_post("/v1/completions", stub.completion)
    try:  # uvloop where installed: the router benchmark's backends must not be its bottleneck
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
