"""``tpupod serve``, ``tpupod agent`` and ``tpupod fanout``: the serving fleet."""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from tpupod import settings
from tpupod.cli import app, command, reporting_errors
from tpupod.cli.options import PodOption
from tpupod.errors import ServeError, UsageError
from tpupod.report import notice, print_columns
from tpupod.serve import defaults

if TYPE_CHECKING:
    from tpupod.pod import Pod
    from tpupod.serve.fleet import Fleet, FleetRecord

T = TypeVar("T")

serve_app = typer.Typer(
    name="serve",
    help="A fleet of OpenAI-compatible servers on a pod, one router in front.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(serve_app, name="serve")

WorkerPythonOption = Annotated[
    str | None,
    typer.Option(
        "--worker-python",
        help="Python with tpupod on the workers (default: this one on a local pod, else python3).",
        show_default=False,
    ),
]
WorkersOption = Annotated[
    str | None, typer.Option("--workers", "-w", help="Workers, e.g. 0,2-3.", show_default=False)
]
PortOption = Annotated[
    int | None, typer.Option("--port", help="Only the server on this port.", show_default=False)
]


def _pod(name: str | None) -> Pod:
    from tpupod.state import StateDir

    return StateDir().resolve(name)


def _with_fleet(pod: Pod, python: str, use: Callable[[Fleet], Awaitable[T]]) -> T:
    from tpupod.serve.fleet import Fleet

    async def go() -> T:
        fleet = Fleet(pod, python)
        try:
            return await use(fleet)
        finally:
            await fleet.close()

    return asyncio.run(go())


def _record(pod: Pod) -> FleetRecord:
    from tpupod.serve.fleet import load_record
    from tpupod.state import StateDir

    return load_record(StateDir(), pod.name)


@serve_app.command("up")
@reporting_errors
def up(
    model: Annotated[str, typer.Option("--model", help="A checkpoint folder or gs:// URL.")],
    pod: PodOption = None,
    backend: Annotated[
        str, typer.Option("--backend", help="builtin, sglang-jax, vllm or command.")
    ] = "builtin",
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="bfloat16 or float32.", show_default=False)
    ] = None,
    servers_per_worker: Annotated[
        int, typer.Option("--servers-per-worker", help="Servers (engines) per worker.")
    ] = 1,
    base_port: Annotated[
        int, typer.Option("--base-port", help="The first server port.")
    ] = defaults.BASE_PORT,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", help="Seconds for every server to answer.")
    ] = 600.0,
    command_template: Annotated[
        str | None,
        typer.Option(
            "--command",
            help="The command backend's template: {host} {port} {device_ids} {model} {python}.",
            show_default=False,
        ),
    ] = None,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            "--served-model-name", help="The model's name in the API.", show_default=False
        ),
    ] = None,
    devices_per_worker: Annotated[
        int | None,
        typer.Option("--devices-per-worker", help="Devices to split.", show_default=False),
    ] = None,
    router_port: Annotated[
        int | None,
        typer.Option(
            "--router-port",
            help=f"The router's port on worker 0 (default {defaults.ROUTER_PORT}; any free one "
            "on a local pod).",
            show_default=False,
        ),
    ] = None,
    policy: Annotated[
        str,
        typer.Option("--policy", help="least_outstanding, round_robin or power_of_two."),
    ] = defaults.POLICY,
    health_interval: Annotated[
        float, typer.Option("--health-interval", help="Seconds between health checks.")
    ] = defaults.HEALTH_INTERVAL_S,
    restart_backoff: Annotated[
        float, typer.Option("--restart-backoff", help="First wait before a restart (doubles).")
    ] = defaults.RESTART_BACKOFF_S,
    hosts_per_replica: Annotated[
        int,
        typer.Option(
            "--hosts-per-replica",
            help="Workers per replica: each run of K workers serves one model sharded over "
            "all their devices, in lockstep (builtin backend).",
        ),
    ] = 1,
    mesh: Annotated[
        str | None,
        typer.Option(
            "--mesh",
            help="model=M: a multi-host replica's tensor-parallel width (default: all its "
            "devices; the rest is a data axis).",
            show_default=False,
        ),
    ] = None,
    worker_python: WorkerPythonOption = None,
    replace: Annotated[
        bool,
        typer.Option(
            "--replace",
            help="Another fleet serves on the pod: stop every server of it, start this one.",
        ),
    ] = False,
    backend_args: Annotated[
        list[str] | None,
        typer.Argument(help="-- flags passed on to every server.", show_default=False),
    ] = None,
) -> None:
    """Start agents and servers on every worker, then the router; print the endpoint."""
    from tpupod.serve.backends import Backend
    from tpupod.serve.fleet import UpOptions
    from tpupod.serve.router import Policy

    found = _pod(pod)
    try:
        chosen = Backend(backend)
        Policy(policy)
    except ValueError as exc:
        raise UsageError(str(exc), hint="see 'tpupod serve up --help'") from None
    if found.on_this_machine and not model.startswith("gs://") and Path(model).exists():
        model = str(Path(model).absolute())  # a local worker starts in its own folder
    options = UpOptions(
        model=model,
        backend=chosen,
        servers_per_worker=servers_per_worker,
        base_port=base_port,
        dtype=dtype,
        served_model_name=served_model_name,
        command=command_template,
        extra_args=tuple(backend_args or ()),
        startup_timeout=startup_timeout,
        python=found.worker_python(worker_python),
        devices_per_worker=devices_per_worker,
        router_port=router_port,
        policy=policy,
        health_interval=health_interval,
        restart_backoff=restart_backoff,
        hosts_per_replica=hosts_per_replica,
        mesh=mesh,
    )
    began = time.monotonic()
    record = _with_fleet(found, options.python, lambda f: f.up(options, notice, replace))
    if record is None:  # the same fleet serves already: nothing was touched
        record = _record(found)
    else:
        what = "replicas" if hosts_per_replica > 1 else "servers"
        notice(f"{len(record.servers)} {what} ready in {time.monotonic() - began:.1f}s")
    print(f"endpoint: {record.base_url}  ('eval \"$(tpupod serve endpoint)\"' to use it)")


@serve_app.command("status")
@reporting_errors
def status(pod: PodOption = None, worker_python: WorkerPythonOption = None) -> None:
    """A table: worker, server, backend, state, restarts, requests, tokens/s."""
    from tpupod.serve.fleet import status_rows

    found = _pod(pod)
    record = _record(found)
    agents, router = _with_fleet(found, record.python, lambda f: f.status())
    rows = status_rows(record, agents, router)
    header = ["WORKER", "SERVER", "BACKEND", "STATE", "PID", "RESTARTS", "REQUESTS", "TOK/S"]
    table = [
        [
            f"w{r['worker']}",
            r["address"],
            r["backend"],
            r["state"],
            _cell(r["pid"]),
            _cell(r["restarts"]),
            _cell(r["requests"]),
            _cell(r["tokens_per_s"]),
        ]
        for r in rows
    ]
    if any(r["followers"] for r in rows):  # replicas across workers: one row per group
        header[0] = "LEADER"
        header.insert(1, "FOLLOWERS")
        for row, r in zip(table, rows, strict=True):
            pairs = zip(r["followers"], r["follower_restarts"], strict=True)
            restarts = [f"w{f}:{_cell(n)}" for f, n in pairs]
            row.insert(1, ",".join(f"w{f}" for f in r["followers"]) or "-")
            row[6] = f"{row[6]} ({' '.join(restarts)})" if restarts else row[6]
    _print_table(header, table)
    if isinstance(router, str):
        print(f"router: {router}")
    else:
        healthy = len(router.get("backends", []))
        print(f"router: {record.base_url} ({healthy}/{len(rows)} backends healthy)")


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    print_columns([header, *rows], sys.stdout)


@serve_app.command("logs")
@reporting_errors
def logs(
    pod: PodOption = None,
    workers: WorkersOption = None,
    port: PortOption = None,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines per server.")] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
    ] = False,
) -> None:
    """The servers' log lines, prefixed by worker (tail -F with --follow)."""
    from tpupod.fanout import execute_async
    from tpupod.report import LinePrinter
    from tpupod.serve.ctl import STATE_DIR

    found = _pod(pod)
    record = _record(found)
    chosen = [s for s in record.servers if port is None or s.port == port]
    if not chosen:
        raise UsageError(
            f"no server listens on port {port}", hint="'tpupod serve status' lists them"
        )
    # each worker its own servers' logs: a log of another fleet's server stays out
    arms = []
    for w in found.workers:
        names = sorted({s.name for s in chosen if w.id in (s.worker, *s.followers)})
        files = " ".join(shlex.quote(f"{STATE_DIR}/logs/{name}.log") for name in names)
        if names:
            arms.append(f"{w.id}) set -- {files};;")
    command_line = (
        f'case "$TPUPOD_WORKER_ID" in {" ".join(arms)} *) exit 0;; esac; '
        f'tail -q -n {lines} {"-F" if follow else ""} "$@" 2>/dev/null; true'
    )
    printer = LinePrinter(found.select(workers), sys.stdout, sys.stderr)
    asyncio.run(execute_async(found, command_line, workers=workers, on_line=printer))


@serve_app.command("restart")
@reporting_errors
def restart(
    pod: PodOption = None,
    workers: WorkersOption = None,
    port: PortOption = None,
    worker_python: WorkerPythonOption = None,
) -> None:
    """Restart servers (all, or those of some workers, or the one on --port)."""
    found = _pod(pod)
    record = _record(found)
    names = {s.name for s in record.servers if port is not None and s.port == port}
    if port is not None and not names:
        raise UsageError(
            f"no server listens on port {port}", hint="'tpupod serve status' lists them"
        )
    shared = sorted({s.port for s in record.servers if s.name in names and s.port != port})
    if shared:  # a restart is of a process: it would take these ports down too
        others = ", ".join(f":{p}" for p in shared)
        worker = next(s.worker for s in record.servers if s.port == port)
        raise UsageError(
            f"the server on :{port} runs in one process with {others} (the builtin backend "
            "serves a worker's ports from one process): restarting it restarts them all",
            hint=f"restart them together: tpupod serve restart -w {worker}",
        )
    selected = found.select(workers)
    if names:
        selected = [
            w
            for w in selected
            if any(
                (s.worker == w.id or w.id in s.followers) and s.port == port for s in record.servers
            )
        ]
    name = next(iter(names), None)
    done = _with_fleet(found, record.python, lambda f: f.restart(selected, name))
    notice(f"restarted {len(done)}: {', '.join(done)}")


@serve_app.command("down")
@reporting_errors
def down(pod: PodOption = None, worker_python: WorkerPythonOption = None) -> None:
    """Stop the router, every agent and every server: nothing is left running."""
    from tpupod.serve.fleet import load_record
    from tpupod.state import StateDir

    found = _pod(pod)
    try:
        record = load_record(StateDir(), found.name)
    except ServeError:
        record = None
    python = record.python if record is not None else found.worker_python(worker_python)
    _with_fleet(found, worker_python or python, lambda f: f.down(notice))
    if record is not None and not found.on_this_machine:
        from tpupod.holder.client import close_forward

        close_forward(
            StateDir(), found.name, worker=0, host=record.router_host, port=record.router_port
        )


@serve_app.command("endpoint")
@reporting_errors
def endpoint(
    pod: PodOption = None,
    direct: Annotated[
        bool,
        typer.Option(
            "--direct",
            help="The router's own address on worker 0 (for clients inside the pod's "
            "network), not a local port forwarded to it.",
        ),
    ] = False,
) -> None:
    """Print export lines for OpenAI clients: eval "$(tpupod serve endpoint)".

    On an SSH or cloud pod the router listens on worker 0's internal address: this
    forwards a local port to it over the pod's own SSH connection (held by the pod's
    connection holder until 'tpupod serve down') and points the clients there.
    """
    found = _pod(pod)
    record = _record(found)
    url = record.base_url
    if not found.on_this_machine and not direct:
        url = _forwarded(found, record)
    print(f"export OPENAI_BASE_URL={shlex.quote(url)}")
    print(f"export OPENAI_API_KEY={shlex.quote(record.token)}")


def _forwarded(pod: Pod, record: FleetRecord) -> str:
    """A local URL forwarded to the router over worker 0's SSH connection."""
    from tpupod.holder.client import forward_port
    from tpupod.state import StateDir

    host, port = record.router_host, record.router_port
    if not settings.holder_enabled():  # the holder is what keeps a forward open
        head = pod.workers[0]
        assert head.ssh is not None
        login = head.ssh.model_copy(update={"host": head.external_address or head.ssh.host})
        notice(
            "the router listens on worker 0's internal address and TPUPOD_HOLDER=0 keeps no "
            f"forward open; from outside the pod's network: ssh -N -L {port}:{host}:{port} "
            f"{login}, then use http://127.0.0.1:{port}/v1"
        )
        return record.base_url
    local = forward_port(StateDir(), pod.name, worker=0, host=host, port=port, local_port=port)
    notice(f"127.0.0.1:{local} forwards to the router at {host}:{port} over w0's SSH connection")
    return f"http://127.0.0.1:{local}/v1"


@command("agent")
def agent(
    host: Annotated[str, typer.Option("--host", help="The worker's internal address.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option("--port", help="0: any free port.")] = defaults.AGENT_PORT,
    state_dir: Annotated[
        str, typer.Option("--state-dir", help="Pidfile, token and logs.")
    ] = ".tpupod/serve",
) -> None:
    """The worker agent in the foreground ('tpupod serve up' starts it detached)."""
    from tpupod.serve.agent import serve as serve_agent

    serve_agent(Path(state_dir).expanduser().absolute(), host, port)


@command("fanout")
def fanout(
    prompt: Annotated[str, typer.Option("--prompt", help="The user message.")],
    pod: PodOption = None,
    registry_url: Annotated[
        str | None,
        typer.Option("--registry-url", help="Default: the pod's router.", show_default=False),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", help="Default: the fleet's ($OPENAI_API_KEY).", show_default=False),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Default: the registry's.", show_default=False)
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per request.")] = 600.0,
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", help="At most this many at once.", show_default=False),
    ] = None,
) -> None:
    """One chat request to every backend at once: a RESP line each, then DONE."""
    import httpx

    from tpupod.serve.broadcast import fanout as ask_all
    from tpupod.serve.broadcast import registry_backends

    if registry_url is None:
        record = _record(_pod(pod))
        registry_url = f"http://{record.router_host}:{record.router_port}"
        token = token or record.token
    token = token or settings.openai_api_key()
    began = time.monotonic()
    try:
        listed = asyncio.run(registry_backends(registry_url, token, 30.0))
    except httpx.HTTPStatusError as exc:
        refused = exc.response.status_code in (401, 403)
        raise ServeError(
            f"the registry at {registry_url} refused the token (HTTP {exc.response.status_code})"
            if refused
            else f"the registry at {registry_url} answered HTTP {exc.response.status_code}",
            hint="leave --token out to use the fleet's ('tpupod serve endpoint' prints it)"
            if refused
            else "'tpupod serve status' shows the fleet",
        ) from exc
    except httpx.HTTPError as exc:
        raise ServeError(
            f"the registry at {registry_url} does not answer: {exc}",
            hint="'tpupod serve status' shows the fleet",
        ) from exc
    if not listed.healthy and not listed.down:
        raise ServeError("the registry lists no backend", hint="'tpupod serve status'")
    down = listed.down_answers()
    for answer in down:  # a server the registry marks down is reported, not asked
        print(answer.line(), flush=True)
    answers = asyncio.run(
        ask_all(
            listed.healthy,
            model or listed.model,
            prompt,
            max_tokens=max_tokens,
            timeout=timeout,
            concurrency=concurrency,
            on_answer=lambda a: print(a.line(), flush=True),
        )
    )
    answers += down
    ok = sum(a.ok for a in answers)
    print(f"DONE backends={len(answers)} ok={ok} wall_sec={time.monotonic() - began:.2f}")
    if ok < len(answers):
        raise typer.Exit(1)
