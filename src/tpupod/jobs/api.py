"""The job API (FastAPI): submit, list, read, follow and cancel jobs over HTTP.

Every route needs ``Authorization: Bearer TOKEN``. A log follow is a stream of server-sent
events whose ids are the lines' offsets, so a client that reconnects with
``Last-Event-ID`` (or ``?offset=``) gets every line once: none missed, none repeated.
Without ``follow``, lines come in pages: a page with more after it says where the next
starts (``X-Next-Offset`` and ``Link: <...>; rel="next"``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tpupod import settings
from tpupod.base.envargs import parse_pairs
from tpupod.base.files import write_atomic
from tpupod.errors import JobNotFound, JobStoreError, PodNotFound, UsageError
from tpupod.jobs.models import JobRequest, JobStatus, LogLine
from tpupod.jobs.rows import check_key, check_pod
from tpupod.jobs.service import follow
from tpupod.jobs.store import Store

PAGE = 500  # lines in a page of GET /jobs/ID/logs, unless ?limit= says (up to PAGE_MAX)
PAGE_MAX = 10_000


BEARER = HTTPBearer(auto_error=False)


def authorized(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]
) -> None:
    token: str = request.app.state.token
    given = creds.credentials if creds is not None else ""
    if not secrets.compare_digest(given.encode(), token.encode()):
        raise HTTPException(
            401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"}
        )


def create_app(store: Store, token: str) -> FastAPI:
    app = FastAPI(title="tpupod jobs", dependencies=[Depends(authorized)])
    app.state.token = token

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own handler echoes the input in UTF-8: half a surrogate pair in it
        # (which JSON may escape) could not be encoded, and the 422 became a 500
        body = json.dumps({"detail": jsonable_encoder(exc.errors())})  # ASCII: \ud800
        return Response(body, status_code=422, media_type="application/json")

    @app.exception_handler(JobNotFound)
    async def _not_found(request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=404)

    @app.exception_handler(JobStoreError)
    async def _store_down(request: Request, exc: JobStoreError) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=503)

    @app.post("/jobs", status_code=201)
    def submit(
        body: JobRequest,
        remote_pod: bool = False,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> dict[str, int]:
        """Queue a job; for a pod this machine does not know only with ``remote_pod`` (its
        runner is elsewhere), as 'tpupod jobs submit --remote-pod'. A request sent again
        with the same ``Idempotency-Key`` (its answer lost) adds nothing and answers the
        job the first one added, as 'jobs submit --key'."""
        try:
            check_pod(body.pod, remote_pod, how="POST /jobs?remote_pod=true")
            key = None if idempotency_key is None else check_key(idempotency_key)
            return {"id": store.submit(body, key=key)}
        except (PodNotFound, UsageError) as exc:
            raise HTTPException(422, f"{exc.message}; {exc.hint}") from exc

    @app.get("/jobs")
    def listing(
        status: Annotated[list[JobStatus] | None, Query()] = None,
        label: Annotated[list[str] | None, Query(description="NAME=VALUE")] = None,
        since: float | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        try:
            labels = parse_pairs(label, option="label", example="team=ml")
        except UsageError as exc:
            raise HTTPException(422, "label filters are NAME=VALUE") from exc
        found = store.find(statuses=status or [], labels=labels, since=since, limit=limit)
        return [job.to_dict() for job in found]

    @app.get("/jobs/{job_id}")
    def one(job_id: int) -> dict[str, Any]:
        return store.get(job_id).to_dict()

    @app.post("/jobs/{job_id}/cancel")
    def cancel(job_id: int) -> dict[str, Any]:
        return store.cancel(job_id).to_dict()

    @app.get("/jobs/{job_id}/logs", response_model=None)
    def logs(  # noqa: PLR0917 (FastAPI reads each parameter as a query or a header)
        job_id: int,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=PAGE_MAX)] = PAGE,
        follow: bool = False,
        attempt: Annotated[int | None, Query(ge=1)] = None,
        last_event_id: Annotated[int | None, Header()] = None,
    ) -> StreamingResponse | JSONResponse:
        store.get(job_id)  # 404 before a stream starts
        after = last_event_id if last_event_id is not None else offset
        if follow:
            lines = _follow(store, job_id, after, attempt)
            return StreamingResponse(lines, media_type="text/event-stream")
        page = store.logs(job_id, after=after, limit=limit + 1, attempt=attempt)
        return _page(page, job_id, limit, attempt)

    return app


def _page(lines: list[LogLine], job_id: int, limit: int, attempt: int | None) -> JSONResponse:
    """Up to ``limit`` lines; when more are there already, the next page's offset in
    ``X-Next-Offset`` and a ``Link: <...>; rel="next"`` to it (absent: that was all)."""
    page = lines[:limit]
    headers = {}
    if len(lines) > limit:
        after = page[-1].seq
        headers["X-Next-Offset"] = str(after)
        one = f"&attempt={attempt}" if attempt is not None else ""
        headers["Link"] = f'</jobs/{job_id}/logs?offset={after}&limit={limit}{one}>; rel="next"'
    return JSONResponse([asdict(line) for line in page], headers=headers)


async def _follow(store: Store, job_id: int, after: int, attempt: int | None) -> AsyncIterator[str]:
    """Lines after ``after`` (of ``attempt`` only, if given) as they come, then an ``end``
    event with the job's status."""
    async for lines in follow(store, job_id, after=after, page=PAGE, attempt=attempt):
        for line in lines:
            yield f"id: {line.seq}\nevent: line\ndata: {json.dumps(asdict(line))}\n\n"
    status = (await asyncio.to_thread(store.get, job_id)).status.value
    yield f"event: end\ndata: {json.dumps({'status': status})}\n\n"


TOKEN_FILE = "jobs-token"


def api_token() -> tuple[str, str]:
    """The API's token and where it came from: $TPUPOD_JOBS_TOKEN, else a file of ours (0600)."""
    given = settings.jobs_token()
    if given:
        return given, "$TPUPOD_JOBS_TOKEN"
    path = settings.state_home() / TOKEN_FILE
    if not path.exists():
        write_atomic(path, secrets.token_urlsafe(32) + "\n")  # 0600
    return path.read_text().strip(), str(path)


def serve_api(
    store: Store, host: str, port: int, on_ready: Callable[[str], None] | None = None
) -> None:
    """Serve the API on ``host:port`` until interrupted; ``on_ready`` hears where, and where
    the token came from (never the token)."""
    token, source = api_token()
    app = create_app(store, token)
    listening = listen(host, port)  # ours, so a busy port is one error line
    port = listening.getsockname()[1]  # --port 0: the one picked
    if on_ready is not None:
        on_ready(f"job API on http://{host}:{port} (bearer token: {source})")
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[listening])


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a busy port or a foreign address is one error
    line with a hint (uvicorn would log a traceback). The job API and the dashboard use it.

    TCP_NODELAY is set here, and accepted connections inherit it (Linux): asyncio sets it
    only on sockets made with proto IPPROTO_TCP, and ``create_server``'s have proto 0, so
    every keep-alive answer with a body waited 40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listening = socket.create_server((host, port), family=family)
        listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return listening
    except OSError as exc:
        busy = exc.errno == errno.EADDRINUSE
        hint = f"something else listens there: pick another, --port {port + 1}"
        raise UsageError(
            f"cannot listen on {host}:{port}: {_why_not(exc, host)}",
            hint=hint if busy else "--host takes an address of this machine (127.0.0.1)",
        ) from exc


def _why_not(exc: OSError, host: str) -> str:
    """Why a bind failed, in words. A name that does not resolve is getaddrinfo's error,
    whose negative code (``create_server`` passes it on as an OSError's) ``os.strerror``
    calls 'Unknown error -2'."""
    if isinstance(exc, socket.gaierror) or (exc.errno is not None and exc.errno < 0):
        return f"the name {host} does not resolve to an address"
    return os.strerror(exc.errno) if exc.errno else str(exc)
