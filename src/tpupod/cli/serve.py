"""``tpupod serve``, ``tpupod agent`` and ``tpupod fanout``: the serving fleet."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tpupod import settings
from tpupod.cli.app import app, command
from tpupod.cli.options import PodOption
from tpupod.errors import ServeError, UsageError
from tpupod.fanout.report import LinePrinter, notice, print_columns
from tpupod.serve import defaults

if TYPE_CHECKING:
    from tpupod.serve.fleet.control import Fleet
    from tpupod.serve.fleet.status import FleetStatus, ServerStatus

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


# What 'serve endpoint' prints on stdout when it fails and stdout is not a terminal: eval
# "$(tpupod serve endpoint)" then fails (status 1: 'set -e' stops, '&&' does not go on),
# and says the variables were left as they were, beside tpupod's own error on stderr.
EVAL_FAILS = (
    "echo 'tpupod serve endpoint failed (see its error above): OPENAI_BASE_URL and "
    "OPENAI_API_KEY are left as they were' >&2; false"
)


def _fleet(pod: str | None) -> Fleet:
    from tpupod.serve.fleet.control import Fleet

    return Fleet.open(pod)


@command("up", group=serve_app, needs=("serve",))
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
    agent_port: Annotated[
        int,
        typer.Option(
            "--agent-port",
            help="The serving agent's port on each worker (any free one on a local pod).",
        ),
    ] = defaults.AGENT_PORT,
    router: Annotated[
        str,
        typer.Option(
            "--router",
            help="builtin, or sgl: sgl-router on worker 0 (pip install 'tpupod[sgl]' there).",
        ),
    ] = defaults.ROUTER,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help=f"builtin: least_outstanding (default), round_robin or power_of_two; sgl: "
            f"{defaults.SGL_POLICY} (default), round_robin, power_of_two or random.",
            show_default=False,
        ),
    ] = None,
    health_interval: Annotated[
        float, typer.Option("--health-interval", help="Seconds between health checks.")
    ] = defaults.HEALTH_INTERVAL_S,
    restart_backoff: Annotated[
        float, typer.Option("--restart-backoff", help="First wait before a restart (doubles).")
    ] = defaults.RESTART_BACKOFF_S,
    hold: Annotated[
        float | None,
        typer.Option(
            "--hold",
            help="Seconds the builtin router holds a request no server can take now (every "
            "one restarting), trying again as they come back; 0: 503 at once. "
            f"[default: {defaults.ROUTER_HOLD_S:g}]",
            show_default=False,
        ),
    ] = None,
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
    from tpupod.serve.fleet.record import up_options

    fleet = _fleet(pod)
    options = up_options(
        backend, policy, router, model=model, servers_per_worker=servers_per_worker,
        base_port=base_port, dtype=dtype, served_model_name=served_model_name,
        command=command_template, extra_args=tuple(backend_args or ()),
        startup_timeout=startup_timeout, python=fleet.pod.worker_python(worker_python),
        devices_per_worker=devices_per_worker, agent_port=agent_port, router_port=router_port,
        health_interval=health_interval, restart_backoff=restart_backoff, hold=hold,
        hosts_per_replica=hosts_per_replica, mesh=mesh,
    )  # fmt: skip
    done = fleet.up(options, notice, replace)
    if done.started:
        what = "replicas" if hosts_per_replica > 1 else "servers"
        notice(f"{len(done.record.servers)} {what} ready in {done.seconds:.1f}s")
    endpoint = done.record.base_url
    print(f"endpoint: {endpoint}  ('eval \"$(tpupod serve endpoint)\"' to use it)")


@command("status", group=serve_app)
def status(pod: PodOption = None, worker_python: WorkerPythonOption = None) -> None:
    """A table: worker, server, backend, state, restarts, requests, tokens/s; then the router
    (exit 1 when it or an agent is down and nothing starts it again)."""
    found = _fleet(pod).status(worker_python)
    print_columns(_status_table(found), sys.stdout)
    print(_router_line(found))
    for line in _notes(found):
        print(line)
    _refuse_down(found)


def _notes(found: FleetStatus) -> list[str]:
    """The lines after the router's: agents restarted, what runs with no keeper, what an
    unfinished serve up does."""
    notes = [restarted] if (restarted := _agents_line(found)) else []
    if found.unkept:
        notes.append(
            f"no keeper: {', '.join(found.unkept)} (its keeper was killed): if it dies, "
            "nothing starts it again; 'tpupod serve down' and 'serve up' make new ones"
        )
    if found.router_error is not None and found.starting is not None:
        notes.append(found.starting)
    return notes


def _refuse_down(found: FleetStatus) -> None:
    """A ServeError (exit 1) where a part of the fleet is down and nothing starts it again."""
    if found.starting is not None:
        return
    if found.router_down:
        raise ServeError(
            f"the fleet's router on w0 is down: nothing runs it, nothing starts it again "
            f"(the servers serve on; {found.record.base_url} refuses every request)",
            hint="run this fleet's 'tpupod serve up' again, with the same options: it starts "
            "only the router, on its port",
        )
    if found.agents_down:
        raise ServeError(
            f"the agent of {', '.join(f'w{w}' for w in found.agents_down)} is down: nothing "
            "runs it, nothing starts it again (its servers serve on; one that dies is not "
            "restarted)",
            hint="run this fleet's 'tpupod serve up' again, with the same options: it starts "
            "the agent, which takes its servers over",
        )


def _router_line(found: FleetStatus) -> str:
    """The router's address and view (or why it gave none), and its restarts."""
    kind = "" if found.record.router == "builtin" else f" ({found.router_kind})"
    n = found.router_restarts
    restarts = [] if n is None else [f"{n} restart{'' if n == 1 else 's'}"]
    if found.router_error is not None:
        down = "down: " if found.router_down and found.starting is None else ""
        counted = f" ({restarts[0]})" if n else ""
        return f"router{kind}: {down}{found.router_error}{counted}"
    seen = [f"{found.healthy}/{len(found.servers)} backends healthy"]
    seen += [f"its /health: {found.router_health}"] if found.router_health else []
    seen += [f"circuit {c}" for c in found.circuits]
    seen += [found.router_record] if found.router_record else []
    return f"router{kind}: {found.record.base_url} ({'; '.join([*seen, *restarts])})"


def _agents_line(found: FleetStatus) -> str | None:
    """``agents: w0 restarted 1 time``: the agents started again after they died (their
    keeper does it at once; the servers serve on), None when none was."""
    restarted = [
        f"w{w} restarted {n} time{'' if n == 1 else 's'}"
        for w, n in enumerate(found.agent_restarts)
        if n
    ]
    return f"agents: {', '.join(restarted)}" if restarted else None


def _status_table(found: FleetStatus) -> list[list[str]]:
    """The header and a row per server; a replica's followers and their restarts beside."""
    header = ["WORKER", "SERVER", "BACKEND", "STATE", "PID", "RESTARTS", "REQUESTS", "TOK/S"]
    table = [
        [
            f"w{s.worker}", s.address, s.backend, s.state, _cell(s.pid), _restarts_cell(s),
            _cell(s.requests), _cell(s.tokens_per_s),
        ]
        for s in found.servers
    ]  # fmt: skip
    if found.replicated:  # replicas across workers: one row per group
        header[0] = "LEADER"
        header.insert(1, "FOLLOWERS")
        for row, s in zip(table, found.servers, strict=True):
            pairs = zip(s.followers, s.follower_restarts, strict=True)
            restarts = [f"w{f}:{_cell(n)}" for f, n in pairs]
            row.insert(1, ",".join(f"w{f}" for f in s.followers) or "-")
            row[6] = f"{row[6]} ({' '.join(restarts)})" if restarts else row[6]
    return [header, *table]


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _restarts_cell(s: ServerStatus) -> str:
    """``3 (engine 1, front end 1, server 1)``: the restarts, and of which process (the
    agent's of the whole server, the server's own keeper's of its engine or front end)."""
    if s.restarts is None or s.restarts == 0:
        return _cell(s.restarts)
    return f"{s.restarts} ({', '.join(f'{process} {n}' for process, n in s.restarted)})"


@command("logs", group=serve_app)
def logs(
    pod: PodOption = None,
    workers: WorkersOption = None,
    port: PortOption = None,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines per server.")] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
    ] = False,
    router: Annotated[
        bool,
        typer.Option("--router", help="The router's log instead (on w0: its starts and ends)."),
    ] = False,
    agent: Annotated[
        bool,
        typer.Option("--agent", help="Each worker's agent's log instead (its starts and ends)."),
    ] = False,
) -> None:
    """The servers' log lines, prefixed by worker (tail -F with --follow)."""
    fleet = _fleet(pod)
    printer = LinePrinter(fleet.pod.select(workers), sys.stdout, sys.stderr)
    printed: list[int] = []

    def on_line(worker: Any, line: Any) -> None:  # a Worker, an OutputLine: counted, printed
        printed.append(worker.id)
        printer(worker, line)

    fleet.logs(
        on_line, workers=workers, port=port, lines=lines, follow=follow, router=router,
        agent=agent,
    )  # fmt: skip
    if not printed and not follow:  # said: an empty log and no log read look alike
        which = "router's log is" if router else "agents' logs are" if agent else "logs are"
        notice(f"no lines: the {which} empty")


@command("restart", group=serve_app)
def restart(
    pod: PodOption = None,
    workers: WorkersOption = None,
    port: PortOption = None,
    worker_python: WorkerPythonOption = None,
) -> None:
    """Restart servers (all, or those of some workers, or the one on --port)."""
    done = _fleet(pod).restart(workers, port)
    notice(f"restarted {len(done)}: {', '.join(done)}")


@command("down", group=serve_app)
def down(pod: PodOption = None, worker_python: WorkerPythonOption = None) -> None:
    """Stop the router, every agent and every server: nothing is left running."""
    _fleet(pod).down(notice, worker_python)


@command("endpoint", group=serve_app)
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
    try:
        found = _fleet(pod).endpoint(direct, notice)
    except Exception:
        if not sys.stdout.isatty():  # eval "$(...)": make the eval fail too, and say so
            print(EVAL_FAILS)
        raise
    print(f"export OPENAI_BASE_URL={shlex.quote(found.url)}")
    print(f"export OPENAI_API_KEY={shlex.quote(found.token)}")


@command("agent", needs=("serve",), hidden=True)  # started on workers by 'serve up'
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
    from tpupod.serve.agent.server import serve as serve_agent

    serve_agent(Path(state_dir).expanduser().absolute(), host, port)


@command("fanout", needs=("serve",))
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
    from tpupod.serve.fleet.broadcast import broadcast

    if registry_url is None:
        record = _fleet(pod).record()
        if record.router != "builtin":  # sgl-router keeps no seed-000 registry at /backends
            raise UsageError(
                f"the fleet on pod {record.pod!r} runs sgl-router, which has no registry of "
                "backends (/backends) to fan out to",
                hint="serve up --router builtin for tpupod fanout, or --registry-url URL",
            )
        registry_url = f"http://{record.router_host}:{record.router_port}"
        token = token or record.token
    began = time.monotonic()
    answers = broadcast(
        registry_url, token or settings.openai_api_key(), prompt, model=model,
        max_tokens=max_tokens, timeout=timeout, concurrency=concurrency,
        on_answer=lambda a: print(a.line(), flush=True),
    )  # fmt: skip
    ok = sum(a.ok for a in answers)
    print(f"DONE backends={len(answers)} ok={ok} wall_sec={time.monotonic() - began:.2f}")
    if ok < len(answers):
        raise typer.Exit(1)
