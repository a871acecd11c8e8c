"""``tpupod dashboard``: one live web page for pods, runs, serving and jobs."""

from __future__ import annotations

from typing import Annotated

import typer

from tpupod.cli.app import command
from tpupod.fanout.report import notice


@command("dashboard", needs=("dashboard",))
def dashboard(
    port: Annotated[int, typer.Option("--port", help="The port to listen on.")] = 8750,
    host: Annotated[
        str, typer.Option("--host", help="The address to bind; beyond loopback needs --token.")
    ] = "127.0.0.1",
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="Bearer token for actions (cancel a job, stop a run, restart a server); "
            "required off loopback (default: $TPUPOD_DASHBOARD_TOKEN).",
            show_default=False,
        ),
    ] = None,
    open_browser: Annotated[bool, typer.Option("--open", help="Open it in a browser.")] = False,
    allow_host: Annotated[
        list[str] | None,
        typer.Option("--allow-host", metavar="NAME", help="Another name the page is reached by."),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between samples of the workers.")
    ] = 5.0,
    db: Annotated[
        str | None,
        typer.Option(
            "--db",
            metavar="URL",
            help="The job store (default: as 'tpupod jobs').",
            show_default=False,
        ),
    ] = None,
    bench: Annotated[
        str | None,
        typer.Option(
            "--bench",
            metavar="OUTPUT",
            help="Show 'tpupod bench checkpoint' results "
            "kept here (the suite's --output: a folder or gs:// URL).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve the dashboard until Ctrl-C: pods, runs, serving, jobs, metrics, live."""
    from tpupod.dashboard.app import Config
    from tpupod.dashboard.server import serve

    names = tuple(allow_host or ())
    config = Config(host, port, token, names, interval, db, bench)
    raise typer.Exit(serve(config, open_browser=open_browser, on_ready=notice))
