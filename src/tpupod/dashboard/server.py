"""`tpupod dashboard`: check the bind, listen, open a browser if asked, serve until
interrupted."""

from __future__ import annotations

import dataclasses
import socket
import webbrowser
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from urllib.parse import quote

import uvicorn

from tpupod import settings
from tpupod.base import storage
from tpupod.dashboard.app import Config, create_app
from tpupod.dashboard.feed import Closing
from tpupod.dashboard.guard import check_bind, check_token, is_loopback, is_wildcard
from tpupod.errors import UsageError
from tpupod.jobs.api import listen

TOKEN_ENV = "TPUPOD_DASHBOARD_TOKEN"
MIN_INTERVAL_S = 0.2
BENCH_SUITE = "examples/bench_checkpoint.yaml"  # the README's suite


def check_options(config: Config) -> Config:
    """Bad options as one error line with a hint, before anything listens; the config with
    its token (``--token``, else the environment's)."""
    if not 0 <= config.port <= 65535:
        raise UsageError(
            f"--port {config.port} is not a port",
            hint="a port is 1 to 65535, or 0 for any free one",
        )
    if config.interval < MIN_INTERVAL_S:
        raise UsageError(
            f"--interval {config.interval:g} is too short",
            hint=f"sample at most 5 times a second: --interval {MIN_INTERVAL_S:g} or more",
        )
    bench = config.bench
    local = bench is not None and not storage.is_remote(bench)  # a bucket's prefix: once used
    if local and bench is not None and not Path(bench).is_dir():
        raise UsageError(
            f"--bench {bench}: no such folder",
            hint=f"tpupod bench checkpoint --config {BENCH_SUITE} --output {bench}",
        )
    token, source = config.token, "--token"
    if token is None:
        token, source = settings.named(TOKEN_ENV), f"${TOKEN_ENV}"
    if token is not None:
        check_token(token, source)
    check_bind(config.host, token)
    return dataclasses.replace(config, token=token)


def url_of(config: Config, *, here: bool = False) -> str:
    """Where the dashboard is reached: bound to every address, by this machine's name (no
    browser goes to 0.0.0.0), or from ``here`` by loopback."""
    host = config.host
    if is_wildcard(host):
        host = "127.0.0.1" if here else socket.gethostname()
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{config.port}/"


def open_url(config: Config) -> str:
    """The URL ``--open`` gives the browser: the token in its fragment (browsers do not send
    it), quoted (a base64 token's ``+`` and ``/`` came through as a space)."""
    url = url_of(config, here=True)
    return url + (f"#token={quote(config.token, safe='')}" if config.token else "")


class _Server(uvicorn.Server):
    """uvicorn's server, which also tells the app's open streams that it stops (they held
    its graceful shutdown until every browser left), and ends quietly: uvicorn raised the
    signal again inside its loop, and a second Ctrl-C skipped the app's shutdown, which
    each logged the lifespan's cancel as a traceback. The stop is bounded (the streams end
    at once, the sampler is given a second), so a second signal changes nothing."""

    def __init__(self, config: uvicorn.Config, closing: Closing) -> None:
        super().__init__(config)
        self.closing = closing
        self.stopped_by: int | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.closing.set()
        self.stopped_by = self.stopped_by or sig
        self.should_exit = True


def serve(config: Config, *, open_browser: bool = False, on_ready: Callable[[str], None]) -> int:
    """Serve the dashboard on ``config``'s address until interrupted; the exit code (130
    after Ctrl-C). ``on_ready`` hears where (never the token); with ``open_browser`` the
    token travels in the URL's fragment, which browsers do not send to the server."""
    config = check_options(config)
    token = config.token
    listening = listen(config.host, config.port)  # a busy port is one error line
    config = dataclasses.replace(config, port=listening.getsockname()[1])  # --port 0: which
    url = url_of(config)
    actions = "read-only (no --token)"
    if token:
        actions = "actions need the token" if is_loopback(config.host) else "pages need the token"
    on_ready(f"dashboard on {url} ({actions}); Ctrl-C stops it")
    if open_browser:
        webbrowser.open(open_url(config))
    app = create_app(config)
    # asyncio's own loop: the local transport's subprocesses need it (uvloop's differ)
    served = uvicorn.Config(
        app, loop="asyncio", log_level="warning", access_log=False, timeout_graceful_shutdown=1
    )
    server = _Server(served, app.state.closing)
    server.run(sockets=[listening])
    return 0 if server.stopped_by is None else 128 + server.stopped_by
