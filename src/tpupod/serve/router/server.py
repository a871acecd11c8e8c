"""The router: one OpenAI endpoint over every server of the fleet.

An aiohttp server in front of a keep-alive pool of raw HTTP/1.1 connections to
the backends (``upstream.py``; both set TCP_NODELAY: a streamed token never
waits on Nagle). Per request:

1. bearer auth (every path but ``/health``), then a body check: a malformed
   request gets an OpenAI-shaped 400 here and never reaches (or marks) a backend;
2. a backend by policy among the registry's available ones:
   ``least_outstanding`` (default), ``round_robin`` or ``power_of_two``;
3. connect errors, a dropped connection and 5xx answers are retried on another
   backend while nothing has been sent to the client (at most ``retries``
   times); a 4xx is passed through as it is and never retried. A request no
   backend could take is *held* (``--hold``, 30 s) and tried again as backends
   come back: a restarting fleet answers late instead of failing;
4. a stream is passed through chunk by chunk as it arrives; if its backend
   dies mid-stream the client gets an error event and the stream ends (it
   never hangs, and it is never retried: bytes went out);
5. when the health checks take a backend out, the connections to it that
   heard nothing while the checks failed are broken (``Pool.abort``): what
   waits on a backend that went silent (a hung host, no reset) ends then, as a
   dropped connection does in 3 and 4; a stream still flowing goes on.

Also ``/v1/models``, seed 000's ``/backends`` and ``/health``, and Prometheus
``/metrics``. Under its respawn parent (``serve up``) it serves on the listening socket
that parent holds (``--fd``), so a connection that comes while it is being started again
waits in the backlog instead of being refused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import itertools
import json
import random
import re
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tpupod.serve import defaults, eventloop, services
from tpupod.serve.openai_errors import error_body, path_error
from tpupod.serve.router import upstream
from tpupod.serve.router.registry import Backend, Counts, HealthPolicy, Registry

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HOLD_RETRY_S = 0.5  # a held request is tried again at least this often
# Not passed on to a backend: hop-by-hop, framing (the router frames its own request),
# the router's own token, and Expect (aiohttp answered it already).
HOP_HEADERS = frozenset(
    (b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive",
     b"authorization", b"expect", b"te", b"upgrade", b"proxy-connection")
)  # fmt: skip
USAGE_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# A streamed chunk that carries generated text: chat's delta content or a completion's text.
PIECE_RE = re.compile(rb'"(?:content|text)"\s*:\s*"(?!")')


class Policy(enum.StrEnum):
    LEAST_OUTSTANDING = "least_outstanding"
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"


def openai_error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    return web.json_response(error_body(message, kind, None, code), status=status)


def sse_error(message: str) -> bytes:
    return f"data: {json.dumps(error_body(message, 'server_error'))}\n\n".encode()


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tpupod_router_requests",
            "Requests answered, by backend and status",
            ["backend", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "tpupod_router_retries", "Attempts retried on another backend", registry=self.registry
        )
        self.held = Counter(
            "tpupod_router_held",
            "Requests that waited for a backend (none could take them at first)",
            registry=self.registry,
        )
        self.outstanding = Gauge(
            "tpupod_router_outstanding", "Requests in flight", registry=self.registry
        )
        self.latency = Histogram(
            "tpupod_router_request_seconds",
            "Time to the end of the answer",
            registry=self.registry,
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60),
        )


class Router:
    def __init__(
        self,
        registry: Registry,
        token: str | None,
        policy: Policy,
        retries: int = 2,
        hold_s: float = defaults.ROUTER_HOLD_S,
    ) -> None:
        self.registry = registry
        self.token = token
        self.policy = policy
        self.retries = retries
        self.hold_s = hold_s  # how long a request may wait for a backend (Router.hold)
        self.stopping = False
        self.metrics = Metrics()
        self._rr = itertools.count()
        self.session: aiohttp.ClientSession | None = None  # the registry's health checks
        self.pools: dict[str, upstream.Pool] = {}
        self._counted: dict[tuple[str, str], Any] = {}
        registry.on_change = self.changed

    def changed(self, backend: Backend, down: str | None, lasted: float) -> None:
        """A backend's health changed: one line in the router's log (``serve logs
        --router``), and what waits on a backend that went down ends."""
        if down is None:
            say(f"backend {backend.address} up again (down {lasted:.1f}s)")
            return
        say(f"backend {backend.address} down: {down}")
        self.abandon(backend, down)

    def abandon(self, backend: Backend, error: str) -> None:
        """The health checks took ``backend`` out: what waits on it ends now (a request
        not yet answered is retried on another backend; a begun stream ends with this)."""
        pool = self.pools.get(backend.address)
        if pool is not None:
            # silent at least as long as the failed checks took: a stream still flowing
            # comes from a backend that is busy, not gone
            silent = self.registry.policy.fall * self.registry.policy.interval
            reason = f"backend {backend.address} stopped answering its health checks ({error})"
            pool.abort(reason, silent_for=silent)

    # -- choosing ----------------------------------------------------------------------
    def choose(self, exclude: set[str]) -> Backend | None:
        """The backend for the next try. With none available, those not silent: a health
        check's 'down' is seconds old, and a backend back meanwhile answers; one still
        gone refuses at once."""
        available = self.registry.available() or self.registry.untried()
        candidates = [b for b in available if b.address not in exclude]
        if not candidates:
            return None
        if self.policy is Policy.ROUND_ROBIN:
            return candidates[next(self._rr) % len(candidates)]
        if self.policy is Policy.POWER_OF_TWO and len(candidates) > 2:
            a, b = random.sample(candidates, 2)
            return a if a.outstanding <= b.outstanding else b
        # least outstanding; ties broken by rotation so equal backends share the load
        start = next(self._rr) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda b: b.outstanding)

    # -- middleware and small endpoints -------------------------------------------------
    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """aiohttp's own 404 and 405 (plain text) in OpenAI's shape."""
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
            body = path_error(exc.status, request.method, request.path, exc.reason)
            answer = web.json_response(body, status=exc.status)
            if "Allow" in exc.headers:
                answer.headers["Allow"] = exc.headers["Allow"]
            return answer

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.token is not None and request.path != "/health":
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given.encode(), self.token.encode()):
                return openai_error(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer TOKEN' "
                    "('tpupod serve endpoint' prints it)",
                    "invalid_request_error",
                    "invalid_api_key",
                )
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        available = len(self.registry.available())
        return web.json_response(
            {"ok": available > 0, "healthy": available, "total": len(self.registry.backends)},
            status=200 if available else 503,
        )

    async def backends(self, request: web.Request) -> web.Response:
        return web.json_response(self.registry.describe())

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    # -- proxying ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        chat = request.path.endswith("/chat/completions")
        problem = check_body(body, chat)
        if problem is not None:
            return openai_error(400, problem, "invalid_request_error")
        return await self.forward(request, body)

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self.forward(request, b"")

    async def forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        headers = b"".join(
            b"%s: %s\r\n" % (name, value)
            for name, value in request.raw_headers
            if name.lower() not in HOP_HEADERS
        )
        started = time.monotonic()
        self.metrics.outstanding.inc()
        try:
            answer = await self.round(request, body, headers)
            if unavailable(answer):
                answer = await self.hold(request, body, headers, answer, started + self.hold_s)
        finally:
            self.metrics.outstanding.dec()
            self.metrics.latency.observe(time.monotonic() - started)
        if answer is not None:
            return answer
        return openai_error(
            503, "no healthy backend can take the request", "server_error", "no_backend"
        )

    async def round(
        self, request: web.Request, body: bytes, headers: bytes
    ) -> web.StreamResponse | None:
        """The request tried on one backend, then on others (at most ``retries`` more) while
        the answer is a 5xx: the first other answer (a stream: already sent), else the last
        5xx; None when no backend could be tried."""
        tried: set[str] = set()
        last: web.Response | None = None
        for attempt in range(self.retries + 1):
            backend = self.choose(tried)
            if backend is None:
                break
            if attempt:
                self.metrics.retries.inc()
            tried.add(backend.address)
            answer = await self.attempt(request, backend, body, headers)
            if isinstance(answer, web.StreamResponse) and not isinstance(answer, web.Response):
                return answer  # a stream: already sent
            if answer.status < 500:
                return answer
            last = answer
        return last

    async def hold(
        self,
        request: web.Request,
        body: bytes,
        headers: bytes,
        answer: web.StreamResponse | None,
        deadline: float,
    ) -> web.StreamResponse | None:
        """No backend could take the request (each refused, dropped it or answered 502 or
        503, as while every replica's engine is restarting): it waits, up to ``deadline``,
        and is tried again each time a backend answers its health check again, or every
        ``HOLD_RETRY_S``. A client sees a slower answer instead of an outage no retry of
        its own would have hidden (Ray Serve and Knative's activator hold requests so). A
        500 or 504 is the request's own answer: it is not held."""
        held = False
        while unavailable(answer) and not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not held:
                held = True
                self.metrics.held.inc()
            await self.registry.answered(min(HOLD_RETRY_S, left))
            if self.stopping:
                break
            answer = await self.round(request, body, headers) or answer
        if self.stopping and unavailable(answer):
            return openai_error(
                503,
                "the router is stopping, and no backend could take the request",
                "server_error",
                "router_stopping",
            )
        return answer

    def stop_holding(self) -> None:
        """The router is stopping: held requests get a 503 that says so, now."""
        self.stopping = True
        self.registry.wake()

    def pool(self, backend: Backend) -> upstream.Pool:
        found = self.pools.get(backend.address)
        if found is None:
            found = self.pools[backend.address] = upstream.Pool(backend.address)
        return found

    async def attempt(
        self, request: web.Request, backend: Backend, body: bytes, headers: bytes
    ) -> web.StreamResponse:
        """One try on one backend: a 5xx Response means 'try another'; else the answer.

        Every way out ends the backend's visit once (``registry.end``): the paths below
        end it with no await after, and a cancel (the client hung up) ends it here, with the
        tokens a stream sent it meanwhile (the openai client hangs up at ``[DONE]``, often
        before the backend's end of body reaches the router)."""
        self.registry.begin(backend)
        tally = StreamTally()
        try:
            return await self._attempt(request, backend, body, headers, tally)
        except asyncio.CancelledError:
            self.client_left(backend, tally)
            raise

    async def _attempt(
        self,
        request: web.Request,
        backend: Backend,
        body: bytes,
        headers: bytes,
        tally: StreamTally,
    ) -> web.StreamResponse:
        try:
            answer = await self.pool(backend).request(
                request.method, request.path_qs, headers, body
            )
        except upstream.Refused as exc:
            self.registry.end(backend, ok=False, error=f"connect: {exc}")
            self.registry.refused(backend, f"cannot connect: {exc}")
            return self._failed(backend, 502, f"backend {backend.address} refused the connection")
        except upstream.Dropped as exc:
            self.registry.end(backend, ok=False, error=f"dropped: {exc}")
            return self._failed(backend, 502, f"backend {backend.address} failed: {exc}")
        try:
            streaming = answer.content_type.startswith("text/event-stream")
            if streaming and answer.status < 400:
                return await self.stream(request, backend, answer, tally)
            try:
                data = await answer.read()
            except upstream.Dropped as exc:
                self.registry.end(backend, ok=False, error=f"dropped: {exc}")
                return self._failed(backend, 502, f"backend {backend.address} dropped: {exc}")
            ok = answer.status < 500
            tokens = _tokens(data) if answer.status == 200 else 0
            self.registry.end(
                backend, ok=ok, error=None if ok else f"HTTP {answer.status}", tokens=tokens
            )
            self.count(backend, answer.status)
            return web.Response(
                status=answer.status,
                body=data,
                headers={"Content-Type": answer.content_type or "application/json"},
            )
        finally:
            answer.release()

    def count(self, backend: Backend, status: int | str) -> None:
        """One answer in ``tpupod_router_requests`` (the labelled child is looked up once)."""
        key = (backend.address, str(status))
        child = self._counted.get(key)
        if child is None:
            child = self._counted[key] = self.metrics.requests.labels(*key)
        child.inc()

    def client_left(self, backend: Backend, tally: StreamTally) -> None:
        """The visit ends with the tokens sent: not the backend's fault (a ``200`` where
        ``[DONE]`` had passed)."""
        self.registry.end(backend, ok=True, tokens=tally.tokens)
        self.count(backend, "200" if tally.done else "client_gone")

    def _failed(self, backend: Backend, status: int, message: str) -> web.Response:
        self.count(backend, status)
        return openai_error(status, message, "server_error", "backend_unavailable")

    async def stream(
        self, request: web.Request, backend: Backend, answer: upstream.Answer, tally: StreamTally
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=answer.status,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await out.prepare(request)
        ok, error = True, None
        try:
            async for chunk in answer.chunks():
                tally.feed(chunk)
                await out.write(chunk)
        except upstream.Dropped as exc:
            ok, error = False, str(exc)
        except ConnectionResetError:  # between two chunks
            self.client_left(backend, tally)
            return out
        if not tally.done:
            ok = False
            error = error or "the stream ended before [DONE]"
            await _write_quietly(out, sse_error(f"backend {backend.address} failed: {error}"))
        with contextlib.suppress(ConnectionResetError):  # the client left after the last
            await out.write_eof()
        self.registry.end(backend, ok=ok, error=error, tokens=tally.tokens)
        self.count(backend, "200" if ok else "stream_error")
        return out

    # -- app -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.errors, self.auth], client_max_size=64 * 1024**2)
        app.router.add_get("/health", self.health)
        app.router.add_get("/backends", self.backends)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )
        self.registry.start(self.session)

    async def _close(self, app: web.Application) -> None:
        await self.registry.stop()
        for pool in self.pools.values():
            pool.close()
        if self.session is not None:
            await self.session.close()


def unavailable(answer: web.StreamResponse | None) -> bool:
    """No backend could take the request: none to try, or each refused or dropped it (the
    router's 502) or said it cannot now (503)."""
    return answer is None or answer.status in (502, 503)


def say(text: str) -> None:
    """A line of the router's own in its log (its stderr: its keeper stamps each line)."""
    print(f"[tpupod router] {text}", file=sys.stderr, flush=True)


def check_body(body: bytes, chat: bool) -> str | None:
    """Why a completion request is malformed, or None when it may go to a backend."""
    try:
        data = json.loads(body)
    except ValueError:
        return "the request body is not valid JSON"
    if not isinstance(data, dict):
        return "the request body must be a JSON object"
    if chat:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            return "each message must be an object with a 'role'"
    elif not isinstance(data.get("prompt"), (str, list)):
        return "'prompt' must be a string or a list"
    for name in ("max_tokens", "n"):
        value = data.get(name)
        if value is not None and (not isinstance(value, int) or value < 1):
            return f"'{name}' must be a positive integer"
    if "stream" in data and not isinstance(data["stream"], bool):
        return "'stream' must be true or false"
    return None


class StreamTally:
    """The tokens a streamed answer carried, for ``serve status``' tokens/s: the usage of
    its last event when the server sends one (``stream_options.include_usage``), else one
    per event with text (servers stream a token an event, or close to it)."""

    def __init__(self) -> None:
        self.pieces = 0
        self.usage: int | None = None
        self.done = False  # its ``[DONE]`` has come
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        events = (self._partial + chunk).split(b"\n\n")
        self._partial = events.pop()  # what follows the last blank line is not whole yet
        # its last blank line may come in the next chunk, or never when the client leaves
        self.done = self.done or b"data: [DONE]" in self._partial
        for event in events:
            if b"data: [DONE]" in event:
                self.done = True
                continue
            match = USAGE_RE.search(event)
            if match:
                self.usage = int(match.group(1))
            elif PIECE_RE.search(event):
                self.pieces += 1

    @property
    def tokens(self) -> int:
        return self.usage if self.usage is not None else self.pieces


def _tokens(data: bytes) -> int:
    match = USAGE_RE.search(data[-512:])
    return int(match.group(1)) if match else 0


async def _write_quietly(out: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionResetError, RuntimeError):
        await out.write(data)


def bound(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def run_router(
    router: Router, sock: socket.socket, on_listening: Callable[[int], None]
) -> None:
    """Serve on ``sock`` (bound; listening already where it was handed down) until TERM."""
    # a client that hangs up cancels its handler: the request to the backend is closed
    # with it, and the backend frees the slot (aiohttp's default lets the handler run on)
    runner = web.AppRunner(
        router.app(), access_log=None, handle_signals=False, handler_cancellation=True
    )
    await runner.setup()
    site = web.SockSite(runner, sock, backlog=1024)
    await site.start()
    on_listening(sock.getsockname()[1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    router.stop_holding()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tpupod.serve.router")
    parser.add_argument("--state-dir", default=services.STATE_DIR)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=defaults.ROUTER_PORT, help="0: any free port")
    parser.add_argument("--backends", required=True, help="host:port,host:port,...")
    parser.add_argument("--model", default="")
    parser.add_argument("--policy", choices=[p.value for p in Policy], default=defaults.POLICY)
    parser.add_argument("--retries", type=int, default=defaults.ROUTER_RETRIES)
    parser.add_argument(
        "--hold",
        type=float,
        default=defaults.ROUTER_HOLD_S,
        help="seconds a request may wait for a backend when none can take it (0: 503 at once)",
    )
    parser.add_argument("--health-interval", type=float, default=defaults.HEALTH_INTERVAL_S)
    parser.add_argument("--health-timeout", type=float, default=defaults.HEALTH_TIMEOUT_S)
    parser.add_argument("--fall", type=int, default=defaults.FALL)
    parser.add_argument("--rise", type=int, default=defaults.RISE)
    parser.add_argument("--eject-after", type=int, default=defaults.EJECT_AFTER)
    parser.add_argument("--cooldown", type=float, default=defaults.COOLDOWN_S)
    parser.add_argument("--no-auth", action="store_true", help="no token (benchmarks only)")
    parser.add_argument(
        "--fd",
        type=int,
        default=None,
        help="serve on this listening socket (its respawn parent's), not a new one",
    )
    args = parser.parse_args(argv)
    state = Path(args.state_dir).expanduser().absolute()
    policy = HealthPolicy(
        args.health_interval, args.health_timeout, args.fall, args.rise,
        args.eject_after, args.cooldown,
    )  # fmt: skip
    state.mkdir(parents=True, exist_ok=True)
    addresses = [a for a in args.backends.split(",") if a]
    counts = Counts(addresses, services.counts_path(state))  # kept across its restarts
    registry = Registry(addresses, args.model, policy, counts)
    token = None if args.no_auth else services.token(state, "router")
    router = Router(registry, token, Policy(args.policy), args.retries, args.hold)

    def listening(port: int) -> None:
        services.when_room(
            lambda: services.write_info(
                state, "router", args.host, port, backends=list(registry.backends)
            ),
            "router.json",
        )
        print(f"ready port={port}", flush=True)

    try:
        eventloop.use_uvloop()
        sock = bound(args.host, args.port) if args.fd is None else socket.socket(fileno=args.fd)
        asyncio.run(run_router(router, sock, listening))
    finally:
        services.remove_info(state, "router")
