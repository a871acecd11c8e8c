"""The OpenAI-compatible HTTP face of one engine (FastAPI).

``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (both with SSE streaming) and ``GET /metrics``
(Prometheus text). Bodies are validated here, strictly (``"10"`` is not a
number of tokens); every refusal has OpenAI's error shape::

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

400 for a malformed body, a prompt that does not fit or a field it cannot
honour (``logprobs``: refused, never ignored), 404 for a model this server
does not serve or a path it does not have, 405 for a method a path does not
take, 503 once the server is shutting down. A stream that
cannot finish (the server stops under it) ends with an ``error`` event and no
``[DONE]``, which the ``openai`` client raises as an ``APIError``.

The engine is either in this process, in its own thread (its events hop
onto the event loop with ``call_soon_threadsafe``, one queue per request),
or in the engine process behind a link (``enginelink.RemoteEngine``, its
events read on the loop). Either way the engine answers token ids, and their
text is made on the loop (``text.py``: incremental decoding, stop strings).
While a linked engine is down, ``/health`` and every request answer 503 with
the reason.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpupod.base.jsontext import lone_surrogate
from tpupod.errors import ModelError
from tpupod.serve.builtin.events import (
    Delta,
    EngineStopped,
    Event,
    Failed,
    Finished,
    RequestRejected,
    SamplingParams,
    Sink,
    deliver,
)
from tpupod.serve.builtin.text import Cancellable
from tpupod.serve.builtin.text import submit as submit_text
from tpupod.serve.openai_errors import error_body, path_error


class ServedEngine(Protocol):
    """What the app uses of an engine: an :class:`Engine`, or one behind a link."""

    tokenizer: Any
    max_length: int
    max_batch: int

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def check(self, prompt: Sequence[int], max_tokens: int | None) -> int: ...

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Sink) -> Cancellable: ...


# ---- request bodies ----------------------------------------------------------


class _Body(BaseModel):
    # strict: a string is not a number; unknown fields (user, logit_bias...) are ignored
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    # any 64-bit integer, as OpenAI and vLLM take; the engine draws with its low 32 bits
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1

    def params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=None if self.seed is None else self.seed % 2**32,
            stop=tuple(stop),
        )

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def unsupported(self) -> str | None:
        """A field asked for that this server cannot give (refused, never ignored)."""
        return None


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    # vLLM's extension: e.g. {"enable_thinking": false} for Qwen3's template
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> str | None:
        return "logprobs" if self.logprobs else "top_logprobs" if self.top_logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | list[int]
    # OpenAI's default for the legacy endpoint
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    def unsupported(self) -> str | None:
        return "logprobs" if self.logprobs is not None else None


# ---- errors --------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def _validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if not isinstance(p, int)]
    # a union's alternatives name their type in loc ("str", "list[int]"); keep field names
    fields = [p for p in loc if p.isidentifier()]
    param = ".".join(fields) or None
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{first['msg']}", param, "invalid_value")


def _unavailable(message: str = "the server is shutting down") -> APIError:
    return APIError(503, message, None, "service_unavailable", "server_error")


# ---- metrics -------------------------------------------------------------------


class Metrics:
    """One engine's Prometheus metrics, in its own registry (one per port)."""

    def __init__(self, engine: ServedEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tpupod_serve_requests",
            "Requests answered, by endpoint and outcome (stop, length, error, rejected, "
            "cancelled: the client hung up first)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tpupod_serve_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generated_tokens = Counter(
            "tpupod_serve_generated_tokens", "Tokens generated", registry=r
        )
        running = Gauge(
            "tpupod_serve_running_requests", "Requests holding a KV-cache slot", registry=r
        )
        running.set_function(lambda: engine.running)
        waiting = Gauge(
            "tpupod_serve_waiting_requests", "Requests waiting for a free slot", registry=r
        )
        waiting.set_function(lambda: engine.waiting)
        slots = Gauge("tpupod_serve_slots", "KV-cache slots (the largest batch)", registry=r)
        slots.set(engine.max_batch)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram(
            "tpupod_serve_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=buckets,
            registry=r,
        )
        self.latency = Histogram(
            "tpupod_serve_request_latency_seconds",
            "From a request's arrival to its last token",
            buckets=buckets,
            registry=r,
        )


# ---- the app ---------------------------------------------------------------------


class _Call:
    """One request's events, carried from the engine's thread onto the event loop."""

    def __init__(self, engine: ServedEngine, metrics: Metrics, endpoint: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.endpoint = endpoint
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()
        self.pending: collections.deque[Event] = collections.deque()
        self.arrived = asyncio.Event()
        self.started = time.perf_counter()
        self.first: float | None = None
        self.request: Cancellable | None = None
        self.ended = False

    def abandon(self) -> None:
        """The client went away before the end: free the request's slot (counted
        ``cancelled``); after the end, nothing."""
        if self.request is not None and not self.ended:
            self.ended = True
            self.request.cancel()
            self.metrics.requests.labels(self.endpoint, "cancelled").inc()

    def watch_client(self, request: Request) -> asyncio.Future[None]:
        """For a whole answer (a stream has Starlette's own watch): when the client hangs
        up, abandon the request and wake the one collecting it. Cancel it at the end."""

        async def watch() -> None:
            # uvicorn's receive() after the body returns only when the connection ends
            while (await request.receive())["type"] != "http.disconnect":
                pass
            if not self.ended:
                self.abandon()
                self._put(Failed("the client went away"))

        return asyncio.ensure_future(watch())

    def sink(self, event: Event) -> None:
        if threading.get_ident() == self.thread:  # delivered on the loop (loop_dispatch)
            self._put(event)
        else:
            self.loop.call_soon_threadsafe(self._put, event)

    def _put(self, event: Event) -> None:
        self.pending.append(event)
        self.arrived.set()

    async def _next(self) -> Event:
        """The next event; the texts waiting (the client's side fell behind the engine's
        turns) as one ``Delta``, so a late stream sends one chunk, not one per turn."""
        while not self.pending:
            self.arrived.clear()
            await self.arrived.wait()
        event = self.pending.popleft()
        if isinstance(event, Delta) and self.pending and isinstance(self.pending[0], Delta):
            texts = [event.text]
            while self.pending and isinstance(self.pending[0], Delta):
                texts.append(self.pending.popleft().text)  # type: ignore[union-attr]
            event = Delta("".join(texts))
        return event

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._next()
            now = time.perf_counter()
            if self.first is None and not isinstance(event, Failed):
                self.first = now
                self.metrics.ttft.observe(now - self.started)
            if isinstance(event, Finished):
                self.metrics.latency.observe(now - self.started)
                self.metrics.generated_tokens.inc(event.completion_tokens)
                self.metrics.requests.labels(self.endpoint, event.reason).inc()
            elif isinstance(event, Failed) and not self.ended:  # ended: abandoned
                self.metrics.requests.labels(self.endpoint, "error").inc()
            if not isinstance(event, Delta):
                self.ended = True
            yield event
            if self.ended:
                return


def loop_dispatch(loop: asyncio.AbstractEventLoop) -> Callable[[list[tuple[Sink, Event]]], None]:
    """An engine's ``dispatch`` that hands a turn's events to ``loop`` in one hop
    (one ``call_soon_threadsafe`` per turn, not one per token of every request)."""

    def dispatch(events: list[tuple[Sink, Event]]) -> None:
        if events:  # none: the engine's word that a turn goes on, for a linked front end
            loop.call_soon_threadsafe(deliver, events)

    return dispatch


@dataclass(frozen=True)
class Served:
    """What every handler of one server reads (``app.state.served``): the engine, the name
    it serves the model under, its metrics, when it started (the model's ``created``) and
    the model's vocabulary size (token ids a prompt may hold)."""

    engine: ServedEngine
    model_name: str
    metrics: Metrics
    created: int
    vocab_size: int


def create_app(
    engine: ServedEngine,
    model_name: str,
    metrics: Metrics | None = None,
    vocab_size: int | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` under the name ``model_name`` (``vocab_size``:
    the model's, by default read from a local :class:`Engine`)."""
    if vocab_size is None:
        from tpupod.serve.builtin.engine import Engine  # a local engine: JAX is loaded already

        assert isinstance(engine, Engine)
        vocab_size = engine.model.config.vocab_size
    app = FastAPI(title="tpupod builtin server", docs_url=None, redoc_url=None)
    metrics = metrics or Metrics(engine)
    app.state.served = Served(engine, model_name, metrics, int(time.time()), vocab_size)
    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


def _served(request: Request) -> Served:
    served: Served = request.app.state.served
    return served


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """A path or method this server does not have: OpenAI's shape, not ``{"detail"}``."""
    body = path_error(exc.status_code, request.method, request.url.path, str(exc.detail))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def health(request: Request) -> Any:
    served = _served(request)
    down: str | None = getattr(served.engine, "down", None)  # an engine behind a link
    if down is not None:
        return JSONResponse(_unavailable(down).body(), status_code=503)
    return {"ok": True, "model": served.model_name, "running": served.engine.running}


async def models(request: Request) -> dict[str, Any]:
    served = _served(request)
    model = {
        "id": served.model_name,
        "object": "model",
        "created": served.created,
        "owned_by": "tpupod",
        "max_model_len": served.engine.max_length,
    }
    return {"object": "list", "data": [model]}


async def prometheus(request: Request) -> Response:
    registry = _served(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def chat(request: Request) -> Response:
    served = _served(request)
    body: ChatRequest = await _parse(served, request, ChatRequest, "chat")
    tokenizer = served.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, **(body.chat_template_kwargs or {}))
    except ModelError as exc:
        served.metrics.requests.labels("chat", "rejected").inc()
        raise APIError(400, exc.message, "messages", "invalid_value") from exc
    call = _Call(served.engine, served.metrics, "chat")
    _submit(served, call, tokenizer.encode(text), body, "messages")
    return await _respond(served, request, call, body, chat=True)


async def completions(request: Request) -> Response:
    served = _served(request)
    body: CompletionRequest = await _parse(served, request, CompletionRequest, "completions")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if served.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
        ids = served.engine.tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        vocab = served.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", "prompt")
    call = _Call(served.engine, served.metrics, "completions")
    _submit(served, call, ids, body, "prompt")
    return await _respond(served, request, call, body, chat=False)


async def _parse(served: Served, request: Request, kind: type[_Sampling], endpoint: str) -> Any:
    """The body, validated; every refusal counted as ``rejected``."""
    requests = served.metrics.requests
    body = await request.body()
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        requests.labels(endpoint, "rejected").inc()
        raise APIError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from exc
    if (problem := lone_surrogate(raw, body)) is not None:  # the tokenizer would fail on it
        requests.labels(endpoint, "rejected").inc()
        raise APIError(
            400,
            f"the body is not valid JSON text: {problem}; send whole characters",
            None,
            "invalid_json",
        )
    try:
        return _checked(served, raw, kind)
    except ValidationError as exc:
        requests.labels(endpoint, "rejected").inc()
        raise _validation_error(exc) from exc
    except APIError:
        requests.labels(endpoint, "rejected").inc()
        raise


def _checked(served: Served, raw: Any, kind: type[_Sampling]) -> _Sampling:
    if not isinstance(raw, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_value")
    body = kind.model_validate(raw)
    if body.model != served.model_name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist; this server serves `{served.model_name}`",
            "model",
            "model_not_found",
        )
    if (field := body.unsupported()) is not None:
        raise APIError(
            400,
            f"{field}: this server does not compute log probabilities; leave {field} out",
            field,
            "unsupported_parameter",
        )
    return body


def _submit(
    served: Served, call: _Call, prompt: list[int], body: _Sampling, prompt_param: str
) -> None:
    engine = served.engine
    try:
        max_tokens = engine.check(prompt, body.wanted_tokens())
        # the engine answers token ids; their text is made here, on the loop (text.py)
        call.request = submit_text(engine, prompt, body.params(max_tokens), call.sink)
    except RequestRejected as exc:
        call.metrics.requests.labels(call.endpoint, "rejected").inc()
        param = prompt_param if exc.param in ("messages", "prompt") else exc.param
        raise APIError(400, exc.message, param, exc.code) from exc
    except EngineStopped as exc:
        raise _unavailable(exc.message) from exc
    served.metrics.prompt_tokens.inc(len(prompt))


async def _respond(
    served: Served, request: Request, call: _Call, body: _Sampling, *, chat: bool
) -> Response:
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    shape = _Shape(ident, served.model_name, chat)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(call, shape, usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    text: list[str] = []
    client = call.watch_client(request)
    try:
        async for event in call.events():
            if isinstance(event, Delta):
                text.append(event.text)
            elif isinstance(event, Failed):
                raise APIError(503, event.message, None, "service_unavailable", "server_error")
            elif isinstance(event, Finished):
                return JSONResponse(shape.whole("".join(text), event))
    finally:
        client.cancel()
        call.abandon()
    raise _unavailable()  # not reached: events end with Finished or Failed


class _Shape:
    """OpenAI's response and chunk objects for one request."""

    def __init__(self, ident: str, model: str, chat: bool) -> None:
        self.ident, self.model, self.chat = ident, model, chat
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }

    @staticmethod
    def usage(end: Finished) -> dict[str, int]:
        return {
            "prompt_tokens": end.prompt_tokens,
            "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
        }

    def whole(self, text: str, end: Finished) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": end.reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [choice], usage=self.usage(end))

    def chunk(
        self, text: str | None, reason: str | None, usage: bool, role: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if usage else {}
        return self._object(kind, [choice], **extra)

    def usage_chunk(self, end: Finished) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=self.usage(end))

    def text_frames(self, usage: bool) -> Callable[[str], bytes]:
        """What makes the SSE frame of one text chunk, ``_sse(chunk(text, None, usage))``,
        from the chunk rendered once with a mark where the text goes: a streamed token
        costs one string's JSON, not a dict and a whole dump."""
        mark = _JSON_TEXT(_TEXT_MARK)
        head, found, tail = _sse(self.chunk(_TEXT_MARK, None, usage)).decode().rpartition(mark)
        assert found, "the text chunk has no place for its text"
        head_bytes, tail_bytes = head.encode(), tail.encode()
        return lambda text: head_bytes + _JSON_TEXT(text).encode() + tail_bytes


_TEXT_MARK = "\x00text\x00"  # escaped as \u0000 in JSON: never in a rendered chunk otherwise
_JSON_TEXT = json.JSONEncoder(ensure_ascii=False).encode  # a str: C's fast path


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


async def _stream(call: _Call, shape: _Shape, usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: a role chunk (chat), text chunks, the finish chunk, usage, [DONE]."""
    try:
        async for chunk in _chunks(call, shape, usage):
            yield chunk
    finally:
        call.abandon()


async def _chunks(call: _Call, shape: _Shape, usage: bool) -> AsyncIterator[bytes]:
    if shape.chat:
        yield _sse(shape.chunk("", None, usage, role=True))
    text_frame = shape.text_frames(usage)
    async for event in call.events():
        if isinstance(event, Delta):
            if event.text:
                yield text_frame(event.text)
        elif isinstance(event, Failed):
            error = APIError(503, event.message, None, "service_unavailable", "server_error")
            yield _sse(error.body())
            return
        elif isinstance(event, Finished):
            yield _sse(shape.chunk(None if shape.chat else "", event.reason, usage))
            if usage:
                yield _sse(shape.usage_chunk(event))
            yield _sse("[DONE]")
