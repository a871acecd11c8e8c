"""The dashboard's web app (FastAPI): pages, their JSON under /api, server-sent events,
Prometheus /metrics, and the few actions (POST, token and same origin: guard.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    Response,
    StreamingResponse,
)
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpupod.dashboard import checkpoints, metrics, runs, serving
from tpupod.dashboard.charts import FILTERS, line_chart, title_of
from tpupod.dashboard.feed import Closing, Feed, sse
from tpupod.dashboard.guard import Access, Guard, set_session
from tpupod.dashboard.runs import FAILING, Batch, RunLogs
from tpupod.errors import JobNotFound, StateError, TpupodError, UsageError
from tpupod.launch.records import RunRecord

HERE = Path(__file__).parent
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8750
    token: str | None = None
    names: tuple[str, ...] = ()  # more names the Host header may carry
    interval: float = 5.0
    jobs_url: str | None = None
    bench: str | None = None  # `tpupod bench checkpoint --output`: its results and plots


def create_app(config: Config) -> FastAPI:
    feed = Feed(config.interval, config.jobs_url)
    closing = Closing()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        closing.bind()
        thread = feed.start()
        yield
        await asyncio.to_thread(feed.stop)
        await asyncio.to_thread(thread.join, 5)

    app = FastAPI(title="tpupod dashboard", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.feed = feed
    app.state.closing = closing
    app.state.pages = {}  # cached(): made pages by address, with their sources' versions
    templates = app.state.templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters.update(FILTERS)
    access = app.state.access = Access.of(config.host, config.names, config.token, config.port)
    app.add_middleware(Guard, access=access, sign_in=lambda why: _sign_in(templates, why))
    app.add_middleware(_Headers)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.exception_handler(TpupodError)(_error)
    _pages(app, feed)
    _api(app, feed, closing)
    _checkpoints(app, config.bench)
    return app


class _Headers:
    """ASGI middleware: ``HEADERS`` on every answer (a plain ASGI one: Starlette's
    ``BaseHTTPMiddleware`` copies each chunk of a stream through a queue of its own)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(HEADERS)
            await send(message)

        await self.app(scope, receive, with_headers)


def _sign_in(templates: Jinja2Templates, why: str) -> str:
    """The page a browser gets instead of a page it may not read yet: a token field (its
    script also takes the token from ``--open``'s URL fragment)."""
    page = templates.get_template("signin.html")
    return page.render(topics="", sources=[], fragment=False, why=why)


async def _error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, TpupodError)
    status = 404 if isinstance(exc, JobNotFound | StateError) else 503
    status = 400 if isinstance(exc, UsageError) else status
    if request.url.path.startswith("/api/"):
        return JSONResponse({"detail": exc.message, "hint": exc.hint}, status_code=status)
    return render(request, "error.html", (), status=status, message=exc.message, hint=exc.hint)


def render(
    request: Request, template: str, topics: tuple[str, ...], status: int = 200, **context: Any
) -> HTMLResponse:
    """A page, or only its live part when the script asks (``X-Fragment: 1``)."""
    feed: Feed = request.app.state.feed
    now = time.time()
    sources = [feed.sources[t].to_json(now) for t in topics]
    fragment = request.headers.get("x-fragment") == "1"
    context.update(topics=" ".join(topics), sources=sources, fragment=fragment, now=now)
    templates: Jinja2Templates = request.app.state.templates
    return templates.TemplateResponse(request, template, context, status_code=status)


PAGES_KEPT = 256  # made pages kept (a page and its live part, per address)


def cached(request: Request, topics: tuple[str, ...], make: Callable[[], Response]) -> Response:
    """A page made only of sampled data is the same until one of its sources changes: made
    once per change and served to every viewer (each change makes every open page fetch its
    live part again)."""
    kept: dict[tuple[str, bool], tuple[tuple[int, ...], int, bytes]] = request.app.state.pages
    feed: Feed = request.app.state.feed
    key = (str(request.url), request.headers.get("x-fragment") == "1")
    versions = tuple(feed.sources[t].version for t in topics)  # before making: a change
    found = kept.get(key)  # while it is made is seen by the next request
    if found is not None and found[0] == versions:
        return HTMLResponse(found[2], status_code=found[1])
    made = make()
    if len(kept) >= PAGES_KEPT:
        kept.clear()
    kept[key] = (versions, made.status_code, bytes(made.body))
    return made


def find_run(feed: Feed, launch_id: str) -> RunRecord:
    return runs.find(feed.state, launch_id)


EMPTY_RUNS: dict[str, Any] = {
    "count": 0, "states": {}, "list": [], "failing": [], "failing_count": 0
}  # fmt: skip
EMPTY_JOBS: dict[str, Any] = {"counts": {}, "failed": []}


def overview(feed: Feed) -> dict[str, Any]:
    """Counts, and whatever is failing: every pod that is, the newest failing runs and
    failed jobs with why, and how many more of each (the sampler keeps them: the work does
    not grow with the history)."""
    pods = feed.sources["pods"].data or []
    found = feed.sources["runs"].data or EMPTY_RUNS
    jobs = feed.sources["jobs"].data or EMPTY_JOBS
    failing_pods = [
        {
            "what": f"pod {p['name']}",
            "why": p.get("error") or f"{len(p['workers']) - p['reachable']} unreachable",
            "href": f"/pods/{p['name']}",
        }
        for p in pods
        if p.get("error") or p["reachable"] < len(p["workers"])
    ]
    failing_runs = [
        {"what": f"run {r['id']}", "why": r["why"] or r["state"], "href": f"/runs/{r['id']}",
         "when": r["finished"] or r["started"]}
        for r in found["failing"]
    ]  # fmt: skip
    failed_jobs = [
        {"what": f"job {j['id']} ({j['name']})", "why": j["error"] or "failed",
         "href": f"/jobs/{j['id']}", "when": j["completed_at"]}
        for j in jobs["failed"]
    ]  # fmt: skip
    return {
        "pods": len(pods),
        "workers": sum(len(p["workers"]) for p in pods),
        "runs": found["count"],
        "running": found["states"].get("running", 0),
        "jobs": jobs["counts"],
        "failing": failing_pods,
        "failing_runs": failing_runs,
        "more_runs": found["failing_count"] - len(failing_runs),
        "failed_jobs": failed_jobs,
        "more_jobs": jobs["counts"].get("failed", 0) - len(failed_jobs),
    }


def _pages(app: FastAPI, feed: Feed) -> None:
    @app.get("/", response_class=HTMLResponse)
    def home(request: Request) -> Response:
        topics = ("pods", "runs", "jobs")
        make = lambda: render(request, "overview.html", topics, view=overview(feed))  # noqa: E731
        return cached(request, topics, make)

    @app.get("/pods", response_class=HTMLResponse)
    def pods(request: Request) -> Response:
        make = lambda: render(request, "pods.html", ("pods",), pods=feed.sources["pods"].data)  # noqa: E731
        return cached(request, ("pods",), make)

    @app.get("/pods/{name}", response_class=HTMLResponse)
    def pod(request: Request, name: str) -> Response:
        found = _pod(feed, name)

        def make() -> Response:  # the charts' history grows with each round of the pods
            start = time.time() - 3600
            charts = [
                line_chart(feed.history.since(key, start), *title_of(key))
                for key in (f"reachable:{name}", f"load:{name}", f"memory:{name}")
            ]
            topics = ("pods", "runs")
            return render(request, "pod.html", topics, name=name, pod=found, charts=charts,
                          pod_runs=_pod_runs(feed, name))  # fmt: skip

        return cached(request, ("pods", "runs"), make)

    @app.get("/runs", response_class=HTMLResponse)
    def run_list(
        request: Request, page: int = 1, state: str | None = None, pod: str | None = None
    ) -> Response:
        def make() -> Response:
            return render(request, "runs.html", ("runs",), **_run_page(feed, page, state, pod))

        return cached(request, ("runs",), make)

    @app.get("/runs/{launch_id}", response_class=HTMLResponse)
    def run(request: Request, launch_id: str) -> Response:
        retried = runs.find_retried(feed.state, launch_id)
        if retried is not None:
            return render(request, "retried.html", ("runs",), run=retried)
        record = find_run(feed, launch_id)
        view = runs.detail(record, runs.pod_of(record))
        return render(request, "run.html", ("runs",), run=view)

    @app.get("/jobs", response_class=HTMLResponse)
    def jobs(request: Request, status: str | None = None, before: int | None = None) -> Response:
        listing = feed.jobs.page(status or None, before)
        counts = (feed.sources["jobs"].data or {}).get("counts")
        return render(request, "jobs.html", ("jobs",), listing=listing, counts=counts)

    @app.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job(request: Request, job_id: int) -> Response:
        job = feed.jobs.one(job_id, _job_runs(feed, job_id))
        return render(request, "job.html", ("jobs", "runs"), job=job)

    @app.get("/serving", response_class=HTMLResponse)
    def serving_page(request: Request) -> Response:
        fleets = feed.sources["serving"].data
        make = lambda: render(request, "serving.html", ("serving",), fleets=fleets)  # noqa: E731
        return cached(request, ("serving",), make)

    @app.get("/serving/{pod}/log", response_class=HTMLResponse)
    def backend_log(request: Request, pod: str, worker: int, port: int) -> Response:
        lines = serving.log_tail(feed.state, pod, worker, port)
        return render(
            request, "backendlog.html", (), pod=pod, worker=worker, port=port, lines=lines
        )

    @app.get("/charts", response_class=HTMLResponse)
    def charts(request: Request, hours: float = 1.0) -> Response:
        start = time.time() - hours * 3600
        drawn = [
            line_chart(feed.history.since(key, start), *title_of(key))
            for key in sorted(feed.history.keys())
        ]
        return render(request, "charts.html", (), charts=drawn, hours=hours)

    @app.get("/api/charts")
    def api_charts(hours: float = 1.0) -> dict[str, Any]:
        """Every series of the last ``hours``: (time, value) points."""
        start = time.time() - hours * 3600
        return {"series": {k: feed.history.since(k, start) for k in sorted(feed.history.keys())}}


POD_RUNS = 10  # a pod's page lists its newest runs


def _pod_runs(feed: Feed, name: str) -> dict[str, Any] | None:
    """The pod's newest runs and how many it has (None while the runs load)."""
    found = feed.sources["runs"].data
    if found is None:
        return None
    mine = [r for r in found["list"] if r["pod"] == name]
    return {"runs": mine[:POD_RUNS], "count": len(mine)}


def _job_runs(feed: Feed, job_id: int) -> list[dict[str, Any]]:
    """The runs a job runner launched for job ``job_id`` (its record names the job)."""
    found = feed.sources["runs"].data or EMPTY_RUNS
    return [r for r in found["list"] if r.get("job") and r["job"]["id"] == job_id]


def _pod(feed: Feed, name: str) -> dict[str, Any] | None:
    """The pod's last sample (None while loading); an unknown pod is a 404."""
    feed.state.load_brief(name)
    return next((p for p in feed.sources["pods"].data or () if p["name"] == name), None)


RUN_PAGE = 50


def _run_page(
    feed: Feed, page: int, state: str | None = None, pod: str | None = None
) -> dict[str, Any]:
    """A page of runs, newest first; ``state`` (``failing``: failed or launcher gone) and
    ``pod`` filter."""
    found = feed.sources["runs"].data
    query = "&".join(f"{k}={v}" for k, v in (("state", state), ("pod", pod)) if v)
    if found is None:
        return {"runs": None, "page": 1, "pages": 1, "state": state, "pod": pod, "query": query}
    listed = found["list"]
    if state:
        wanted = FAILING if state == "failing" else (state,)
        listed = [r for r in listed if r["state"] in wanted]
    if pod:
        listed = [r for r in listed if r["pod"] == pod]
    pages = max(1, -(-len(listed) // RUN_PAGE))
    page = min(max(page, 1), pages)
    shown = listed[(page - 1) * RUN_PAGE : page * RUN_PAGE]
    return {"runs": shown, "page": page, "pages": pages, "state": state, "pod": pod, "query": query}


def _api(app: FastAPI, feed: Feed, closing: Closing) -> None:
    def sourced(topic: str, data: Any) -> Response:
        """The data with its source's state and age (plain JSON: no model to validate)."""
        return JSONResponse({**feed.sources[topic].to_json(time.time()), "data": data})

    @app.get("/api/pods")
    def api_pods() -> Response:
        return sourced("pods", feed.sources["pods"].data)

    @app.get("/api/pods/{name}")
    def api_pod(name: str) -> Response:
        return sourced("pods", _pod(feed, name))

    @app.get("/api/runs")
    def api_runs(page: int = 1, state: str | None = None, pod: str | None = None) -> Response:
        return sourced("runs", _run_page(feed, page, state, pod))

    @app.get("/api/runs/{launch_id}")
    def api_run(launch_id: str) -> dict[str, Any]:
        record = find_run(feed, launch_id)
        return runs.detail(record, runs.pod_of(record))

    @app.get("/api/runs/{launch_id}/follow")
    def api_run_follow(
        launch_id: str, last_event_id: Annotated[str | None, Header()] = None
    ) -> StreamingResponse:
        """Every worker's log: its tail, then what is written; from the batch after
        ``Last-Event-ID`` when a browser reconnects."""
        return sse(_follow_run(find_run(feed, launch_id), last_event_id), closing)

    @app.get("/api/runs/{launch_id}/logs/{worker}")
    def api_run_log(launch_id: str, worker: int) -> FileResponse:
        """A worker's whole log, as a file to keep."""
        record = find_run(feed, launch_id)
        if worker not in {w.id for w in record.workers}:
            raise StateError(f"run {launch_id} has no worker {worker}", hint="w0 to w{N-1}")
        name = f"{launch_id}-w{worker}.log"
        return FileResponse(record.log_file(worker), media_type="text/plain", filename=name)

    @app.post("/api/runs/{launch_id}/stop")
    def api_run_stop(launch_id: str) -> dict[str, Any]:
        find_run(feed, launch_id).stop(by="a stop from the dashboard")
        return {"stopping": launch_id}

    @app.post("/api/runs/{launch_id}/stacks")
    def api_run_stacks(launch_id: str) -> dict[str, Any]:
        """Every worker's stacks now (py-spy on each, as ``tpupod stacks``): the digest,
        saved in the run's folder, where the run page shows it."""
        return runs.take_stacks(feed.state, find_run(feed, launch_id))

    @app.get("/api/jobs")
    def api_jobs(status: str | None = None, before: int | None = None) -> dict[str, Any]:
        return feed.jobs.page(status or None, before)

    @app.get("/api/jobs/{job_id}")
    def api_job(job_id: int) -> dict[str, Any]:
        return feed.jobs.one(job_id, _job_runs(feed, job_id))

    @app.get("/api/jobs/{job_id}/follow")
    def api_job_follow(
        job_id: int,
        after: int | None = None,
        last_event_id: Annotated[str | None, Header()] = None,
    ) -> StreamingResponse:
        """The job's log: its tail (or the lines after offset ``after``), then what is
        written; after ``Last-Event-ID`` (an offset) when a browser reconnects."""
        feed.jobs.one(job_id)  # 404 before the stream starts
        if last_event_id is not None and last_event_id.isdigit():
            after = int(last_event_id)
        return sse(feed.jobs.follow(job_id, after), closing)

    @app.get("/api/jobs/{job_id}/log")
    def api_job_log(job_id: int) -> StreamingResponse:
        """The job's whole log, as a file to keep (``[wN]`` labels on a pod's job)."""
        feed.jobs.one(job_id)
        headers = {"Content-Disposition": f'attachment; filename="job-{job_id}.log"'}
        return StreamingResponse(
            feed.jobs.text(job_id), media_type="text/plain; charset=utf-8", headers=headers
        )

    @app.post("/api/jobs/{job_id}/cancel")
    def api_job_cancel(job_id: int) -> dict[str, Any]:
        job = feed.jobs.cancel(job_id)
        feed.publish("jobs")
        return job

    @app.get("/api/serving")
    def api_serving() -> Response:
        return sourced("serving", feed.sources["serving"].data)

    @app.post("/api/serving/{pod}/restart")
    def api_restart(pod: str, worker: int, port: int) -> dict[str, Any]:
        restarted = serving.restart(feed.state, pod, worker, port)
        feed.publish("serving")
        return {"restarted": restarted}

    @app.post("/api/session", status_code=204)
    def api_session(request: Request) -> Response:
        """The session cookie for the token this request carries (the guard checked it)."""
        response = Response(status_code=204)
        set_session(response, request.app.state.access)
        return response

    @app.get("/api/events")
    def api_events() -> StreamingResponse:
        return sse(_events(feed), closing)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.exposition(feed), media_type=metrics.CONTENT_TYPE)

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)


def _checkpoints(app: FastAPI, output: str | None) -> None:
    """The checkpoint suite's runs: read when asked (they do not change), not sampled."""

    @app.get("/checkpoints", response_class=HTMLResponse)
    def listing(request: Request) -> Response:
        found = checkpoints.runs(output)
        return render(request, "checkpoints.html", (), runs=found, output=output)

    @app.get("/checkpoints/{suite}/{launch_id}", response_class=HTMLResponse)
    def one(request: Request, suite: str, launch_id: str) -> Response:
        run = checkpoints.detail(output, suite, launch_id)
        return render(request, "checkpoint.html", (), run=run)

    @app.get("/checkpoints/{suite}/{launch_id}/{name}")
    def plot(suite: str, launch_id: str, name: str) -> Response:
        return Response(checkpoints.plot(output, suite, launch_id, name), media_type="image/png")

    @app.get("/api/checkpoints")
    def api_listing() -> list[dict[str, Any]]:
        return checkpoints.runs(output)

    @app.get("/api/checkpoints/{suite}/{launch_id}")
    def api_one(suite: str, launch_id: str) -> dict[str, Any]:
        return checkpoints.detail(output, suite, launch_id)


async def _events(feed: Feed) -> AsyncIterator[str]:
    """A topic's name whenever its data changes; a comment every 15 s keeps proxies open."""
    queue = feed.listen()
    try:
        while True:
            try:
                topic = await asyncio.wait_for(queue.get(), timeout=15)
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            yield f"data: {topic}\n\n"
    finally:
        feed.forget(queue)


async def _follow_run(record: RunRecord, cursor: str | None) -> AsyncIterator[str]:
    """Every worker's log as batches of lines (``logs.RunLogs``: the tail first, or on
    from ``cursor``, the id of the last batch a reconnecting browser got), then ``end``.
    They are read in a thread of this follow's own, which ends when the viewer leaves: a
    follow that held one of asyncio's few executor threads polled on after its viewer
    left, until the run ended, and the next viewers' follows waited for a thread (and the
    process's exit for them all)."""
    loop = asyncio.get_running_loop()
    batches: asyncio.Queue[Batch | None] = asyncio.Queue()
    stop = threading.Event()
    found = RunLogs(record, cursor)

    def pump() -> None:
        try:
            for batch in found.batches(stop):
                loop.call_soon_threadsafe(batches.put_nowait, batch)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(batches.put_nowait, None)

    threading.Thread(target=pump, name=f"follow {record.launch_id}", daemon=True).start()
    try:
        while (batch := await batches.get()) is not None:
            if batch.lines or batch.reset or batch.first:
                data = json.dumps({"lines": batch.lines, "reset": batch.reset})
                yield f"id: {batch.cursor}\nevent: lines\ndata: {data}\n\n"
            if batch.progress is not None:  # no id: a reconnect resumes after the lines
                yield f"event: progress\ndata: {json.dumps(batch.progress)}\n\n"
        yield "event: end\ndata: {}\n\n"
    finally:
        stop.set()
