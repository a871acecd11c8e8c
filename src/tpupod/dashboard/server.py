"""`tpupod dashboard`: check the bind, listen, open a browser if asked, serve until
interrupted."""

from __future__ import annotations

import dataclasses
import webbrowser
from collections.abc import Callable

from tpupod import settings
from tpupod.dashboard.app import Config
from tpupod.dashboard.guard import check_bind

TOKEN_ENV = "TPUPOD_DASHBOARD_TOKEN"


def url_of(config: Config) -> str:
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"http://{host}:{config.port}/"


def serve(config: Config, *, open_browser: bool = False, on_ready: Callable[[str], None]) -> None:
    """Serve the dashboard on ``config``'s address until interrupted. ``on_ready`` hears
    where (never the token); with ``open_browser`` the token travels in the URL's fragment,
    which browsers do not send to the server."""
    import uvicorn

    from tpupod.dashboard.app import create_app
    from tpupod.jobs.api import listen

    token = config.token or settings.named(TOKEN_ENV)
    check_bind(config.host, token)
    config = dataclasses.replace(config, token=token)
    listening = listen(config.host, config.port)  # a busy port is one error line
    config = dataclasses.replace(config, port=listening.getsockname()[1])  # --port 0: which
    url = url_of(config)
    actions = "actions need the token" if token else "read-only (no --token)"
    on_ready(f"dashboard on {url} ({actions}); Ctrl-C stops it")
    if open_browser:
        webbrowser.open(url + (f"#token={token}" if token else ""))
    app = create_app(config)
    # asyncio's own loop: the local transport's subprocesses need it (uvloop's differ)
    served = uvicorn.Config(app, loop="asyncio", log_level="warning", access_log=False)
    uvicorn.Server(served).run(sockets=[listening])
