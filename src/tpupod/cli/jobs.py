"""``tpupod jobs``: submit work to the job store, follow it, and run runners."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tpupod.cli import app, reporting_errors
from tpupod.cli.options import PodOption
from tpupod.errors import JobError, PodNotFound, UsageError
from tpupod.execflow import join_command
from tpupod.report import notice

if TYPE_CHECKING:
    from collections.abc import Callable

    from tpupod.jobs.attempt import Executor
    from tpupod.jobs.k8s_manifest import Target
    from tpupod.jobs.models import Job, JobRequest
    from tpupod.jobs.pool import Pool
    from tpupod.jobs.runner import Runner
    from tpupod.jobs.store import Store
    from tpupod.pod import Pod
    from tpupod.state import StateDir

jobs_app = typer.Typer(
    name="jobs",
    help="Queued jobs: submit Python code or a command, gang-run it on a pod, follow it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(jobs_app, name="jobs")

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        metavar="URL",
        help="The job store: sqlite:///PATH or postgresql://... "
        "(default: $TPUPOD_JOBS_DB, else jobs.db in the state directory).",
        show_default=False,
    ),
]
# read as text and checked by ``_job_id``: click's message for a non-number is not plain
JobId = Annotated[str, typer.Argument(metavar="ID", help="The job's id.", show_default=False)]
POLL_S = 0.2
LOG_PAGE = 5000


def _job_id(text: str) -> int:
    if not text.isdigit():
        raise UsageError(f"job id {text!r} is not a number", hint="'tpupod jobs ls' lists the ids")
    return int(text)


def _seconds(option: str, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise UsageError(f"{option} {value:g}: must be more than 0 seconds", hint=f"{option} 300")
    return value


def _store(db: str | None, *, create: bool = False) -> Store:
    """The job store; only commands that add jobs or serve make one where none is."""
    from tpupod.jobs.store import Store

    return Store.open(db, create=create)


def _request(args: list[str], dashed: bool) -> JobRequest:
    """``FILE.py`` (code), ``FILE.json`` (seed 003's job document) or ``-- CMD...``."""
    from pydantic import ValidationError

    from tpupod.jobs.code import syntax_problem
    from tpupod.jobs.models import JobRequest

    if not args:
        raise UsageError("nothing to submit", hint="tpupod jobs submit FILE.py | -- CMD...")
    if dashed or len(args) > 1 or not args[0].endswith((".py", ".json")):
        return JobRequest(command=join_command(args))  # as exec and run read it
    path = Path(args[0])
    if not path.is_file():
        raise UsageError(f"{path}: no such file", hint="give a .py or .json file, or -- CMD...")
    if path.suffix == ".py":
        source = path.read_text()
        if problem := syntax_problem(source, str(path)):
            raise UsageError(problem, hint=f"fix the code: 'python -m py_compile {path}'")
        return JobRequest(code=source)
    try:
        return JobRequest.model_validate(json.loads(path.read_text()))
    except (ValueError, ValidationError) as exc:
        raise UsageError(f"{path}: {_first_problem(exc)}", hint=JSON_HINT) from exc


JSON_HINT = 'a job document: {"code": "...", "timeout": 300} or {"command": "..."}'


def _first_problem(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        cause = err.get("ctx", {}).get("error")  # our own validator's words, unprefixed
        said = str(cause) if isinstance(cause, ValueError) else str(err["msg"])
        return f"{where}: {said}" if where else said
    return f"not JSON: {exc}"


def _labels(values: list[str] | None) -> dict[str, str]:
    from tpupod.envargs import parse_pairs

    return parse_pairs(values, option="--label", example="team=ml")


@jobs_app.command("submit")
@reporting_errors
def submit(
    what: Annotated[
        list[str],
        typer.Argument(metavar="FILE.py | FILE.json | -- CMD...", show_default=False),
    ],
    db: DbOption = None,
    pod: PodOption = None,
    name: Annotated[str, typer.Option("--name", help="A name to know it by.")] = "",
    label: Annotated[
        list[str] | None,
        typer.Option("--label", "-l", metavar="NAME=VALUE", help="Repeatable."),
    ] = None,
    priority: Annotated[int, typer.Option("--priority", help="Higher runs first.")] = 0,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Seconds.", show_default=False)
    ] = None,
    max_attempts: Annotated[
        int | None,
        typer.Option(
            "--max-attempts",
            help="Attempts in all, lost runners' too (default: 3, or --retries + 1).",
            show_default=False,
        ),
    ] = None,
    retries: Annotated[
        int,
        typer.Option("--retries", help="Run it again when the program fails, this many times."),
    ] = 0,
    wait: Annotated[bool, typer.Option("--wait", help="Wait, then print the result.")] = False,
    remote_pod: Annotated[
        bool,
        typer.Option("--remote-pod", help="--pod names a pod whose runner is on another machine."),
    ] = False,
) -> None:
    """Queue a job; print its id alone on stdout (id=$(tpupod jobs submit ...))."""
    from pydantic import ValidationError

    from tpupod.jobs.quick import attempts_for, check_pod

    dashed = "--" in sys.argv
    try:
        request = _request(what, dashed)
        changes = {"name": name or request.name, "priority": priority or request.priority}
        extra: dict[str, object] = {"timeout": _seconds("--timeout", timeout), "pod": pod}
        extra["labels"] = _labels(label) or None
        changes.update({k: v for k, v in extra.items() if v is not None})
        if retries < 0:
            raise UsageError(f"--retries {retries}: must be 0 or more", hint="--retries 2")
        if retries:
            changes["retries"] = retries
        if max_attempts is not None or retries >= request.max_attempts:
            changes["max_attempts"] = max_attempts or attempts_for(retries)
        request = type(request).model_validate({**request.model_dump(), **changes})
    except ValidationError as exc:
        raise UsageError(_first_problem(exc), hint=JSON_HINT) from exc
    check_pod(request.pod, remote_pod)
    store = _store(db, create=True)
    job_id = store.submit(request)
    print(job_id, flush=True)
    if wait:
        _wait_and_print(store, job_id, None)


@jobs_app.command("ls")
@reporting_errors
def ls(
    db: DbOption = None,
    status: Annotated[
        list[str] | None, typer.Option("--status", "-s", help="Repeatable.", show_default=False)
    ] = None,
    label: Annotated[
        list[str] | None, typer.Option("--label", "-l", metavar="NAME=VALUE", show_default=False)
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="At most this many, newest first.")] = 50,
) -> None:
    """List jobs, newest first."""
    from tpupod.jobs.models import JobStatus

    try:
        statuses = [JobStatus(s) for s in status or []]
    except ValueError as exc:
        choices = ", ".join(s.value for s in JobStatus)
        raise UsageError(f"--status {exc.args[0].split()[0]}", hint=f"one of {choices}") from exc
    found = _store(db).find(statuses=statuses, labels=_labels(label), limit=limit)
    print(f"{'ID':>6}  {'STATUS':<10} {'TRY':>3}  {'AGE':>7}  {'POD':<12} NAME")
    for job in found:
        age = _age(time.time() - job.created_at)
        tries = f"{job.attempt}" if job.status.finished else f"{job.attempt}/{job.max_attempts}"
        where = job.pod or "-"
        print(f"{job.id:>6}  {job.status.value:<10} {tries:>3}  {age:>7}  {where:<12} {job.name}")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


@jobs_app.command("show")
@reporting_errors
def show(
    job_id: JobId,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="The whole record as JSON.")] = False,
) -> None:
    """One job's record."""
    ident = _job_id(job_id)  # a usage error before the store is opened
    job = _store(db).get(ident)
    if as_json:
        print(json.dumps(job.to_dict(), indent=2))
        return
    print(f"job {job.id} {job.name}".rstrip())
    print(f"  status    {_status(job)}")
    print(f"  runs      {job.command if job.command is not None else 'Python code'}")
    print(f"  pod       {job.pod or 'any runner'}")
    if job.result is not None:
        print(f"  result    {_plain(job.result)}")
    if job.error:
        print(f"  error     {job.error}")


def _status(job: Job) -> str:
    """The status, and the attempts only where another one can still happen."""
    if job.status.finished:
        return job.status.value + (f" after {job.attempt} attempts" if job.attempt > 1 else "")
    if job.attempt and job.max_attempts > 1:
        return f"{job.status.value} (attempt {job.attempt} of {job.max_attempts})"
    return job.status.value


def _plain(value: object) -> str:
    """A result as a person (or ``$(...)``) reads it: a string as is, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


@jobs_app.command("logs")
@reporting_errors
def logs(
    job_id: JobId,
    db: DbOption = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Until the job ends.")] = False,
    offset: Annotated[int, typer.Option("--offset", help="Only lines after this offset.")] = 0,
) -> None:
    """A job's output lines ([wN] shows the worker on a pod)."""
    ident = _job_id(job_id)
    store = _store(db)
    pod = store.get(ident).pod
    while True:
        finished = store.get(ident).status.finished if follow else True
        page = store.logs(ident, after=offset, limit=LOG_PAGE)
        if page:
            text = (f"[w{line.worker}] {line.line}" if pod else line.line for line in page)
            sys.stdout.write("\n".join(text) + "\n")
            sys.stdout.flush()
            offset = page[-1].seq
        if len(page) == LOG_PAGE:
            continue  # more is written already: read on, no waiting
        if finished:
            return
        time.sleep(POLL_S)


@jobs_app.command("cancel")
@reporting_errors
def cancel(job_id: JobId, db: DbOption = None) -> None:
    """Cancel a job: a pending one at once, a running one on every worker."""
    ident = _job_id(job_id)
    job = _store(db).cancel(ident)
    state = job.status.value if job.status.finished else "cancel requested"
    print(f"job {job.id}: {state}")


@jobs_app.command("wait")
@reporting_errors
def wait(
    job_id: JobId,
    db: DbOption = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Seconds.", show_default=False)
    ] = None,
) -> None:
    """Wait for a job to end; print its result (exit 1 when it did not complete)."""
    ident, limit = _job_id(job_id), _seconds("--timeout", timeout)
    _wait_and_print(_store(db), ident, limit)


def _wait_and_print(store: Store, job_id: int, timeout: float | None) -> None:
    from tpupod.jobs.models import JobStatus

    deadline = None if timeout is None else time.monotonic() + timeout
    job = store.get(job_id)
    while not job.status.finished:
        if deadline is not None and time.monotonic() > deadline:
            raise JobError(
                f"job {job_id} is still {job.status.value} after {timeout:g} s",
                hint=f"'tpupod jobs logs -f {job_id}' follows it",
            )
        time.sleep(POLL_S)
        job = store.get(job_id)
    if job.status is not JobStatus.COMPLETED:
        raise _job_failed(job)
    if job.result is not None:
        print(_plain(job.result))


def _job_failed(job: Job) -> JobError:
    return JobError(
        f"job {job.id} {job.status.value}: {job.error}",
        hint=f"'tpupod jobs logs {job.id}' shows its output",
    )


@jobs_app.command("worker")
@reporting_errors
def worker(
    db: DbOption = None,
    pod: PodOption = None,
    local: Annotated[bool, typer.Option("--local", help="Run jobs here, not on a pod.")] = False,
    lease: Annotated[
        float, typer.Option("--lease", help="Lease seconds (heartbeats at 1/3).")
    ] = 15.0,
    until_empty: Annotated[
        bool, typer.Option("--until-empty", help="Exit when no job is left to run.")
    ] = False,
    max_jobs: Annotated[
        int | None, typer.Option("--max-jobs", help="Exit after this many.", show_default=False)
    ] = None,
    worker_python: Annotated[
        str | None,
        typer.Option(
            "--worker-python",
            help="Python on the workers, for code jobs (default: this one on a local pod, "
            "python3 on hosts and in --k8s images).",
            show_default=False,
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No line per job.")] = False,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency",
            "-c",
            min=1,
            help="--local: jobs run at once (default: the CPU count). A pod runner runs one "
            "gang job at a time.",
            show_default=False,
        ),
    ] = None,
    pool: Annotated[
        bool,
        typer.Option(
            "--pool/--no-pool",
            help="--local: run code jobs in warm Python processes (no fork and exec per "
            "job); --no-pool: a fresh interpreter each.",
        ),
    ] = True,
    k8s: Annotated[
        bool,
        typer.Option(
            "--k8s",
            help="Run each job as a JobSet on a GKE TPU slice (--tpu, --image); "
            "--pod then only names the jobs it takes.",
        ),
    ] = False,
    tpu: Annotated[
        str | None,
        typer.Option("--tpu", metavar="TYPE", help="--k8s: the slice, e.g. v5litepod-16."),
    ] = None,
    topology: Annotated[
        str | None,
        typer.Option("--topology", help="--k8s: the node pool's, if not GKE's usual one."),
    ] = None,
    image: Annotated[
        str | None, typer.Option("--image", help="--k8s: the container image (with tpupod).")
    ] = None,
    namespace: Annotated[str, typer.Option("--namespace", help="--k8s: where.")] = "default",
    kubeconfig: Annotated[
        str | None, typer.Option("--kubeconfig", help="--k8s: default $KUBECONFIG, ~/.kube.")
    ] = None,
    context: Annotated[str | None, typer.Option("--context", help="--k8s: kube context.")] = None,
    service_account: Annotated[
        str | None, typer.Option("--service-account", help="--k8s: the pods' account.")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="--k8s: print the JobSet for the next queued job (or a sample job) and exit.",
        ),
    ] = False,
) -> None:
    """Run jobs: on every worker of a pod (gang-run through 'tpupod run'), here (--local),
    or as JobSets on a GKE TPU slice (--k8s)."""
    from tpupod.jobs.execute import LocalExecutor, PodExecutor
    from tpupod.jobs.runner import Runner
    from tpupod.state import StateDir

    executor: Executor
    target = None
    if local and k8s:
        raise UsageError("--local and --k8s", hint="a runner runs jobs in one place")
    if dry_run and not k8s:
        raise UsageError("--dry-run is for --k8s runners", hint="it prints a JobSet")
    if not local and concurrency not in (None, 1):
        raise UsageError(
            "--concurrency is for --local runners",
            hint="a pod runs one gang job at a time: start a runner per pod",
        )
    slots = (concurrency or os.cpu_count() or 1) if local else 1
    job_pool = None
    store = _store(db, create=True)
    if local:
        if pool:
            from tpupod.jobs.pool import Pool

            job_pool = Pool(slots)
        executor = LocalExecutor(pool=job_pool)
    elif k8s:
        target = pod
        k8s_target = _k8s_target(
            store,
            tpu=tpu,
            topology=topology,
            image=image,
            namespace=namespace,
            service_account=service_account,
            worker_python=worker_python or "python3",
        )
        if dry_run:
            _print_jobset(store, k8s_target, pod)
            return
        executor = _k8s_executor(
            k8s_target,
            kubeconfig=kubeconfig,
            context=context,
            on_event=None if quiet else notice,
        )
    else:
        found = _runner_pod(StateDir(), pod)
        target = found.name
        executor = PodExecutor(found, worker_python=found.worker_python(worker_python))
    runner = Runner(
        store,
        executor,
        pod=target,
        lease_s=lease,
        on_event=None if quiet else notice,
        concurrency=slots,
    )
    asyncio.run(_serve(runner, until_empty, max_jobs, job_pool))


def _runner_pod(state: StateDir, pod: str | None) -> Pod:
    """The pod a runner serves; without --pod, a hint that also offers --local."""
    try:
        return state.resolve(pod)
    except PodNotFound as exc:
        if pod is not None:
            raise
        also = "or run jobs on this machine: 'tpupod jobs worker --local'"
        raise PodNotFound(exc.message, hint=f"{exc.hint}; {also}") from exc


def _k8s_target(
    store: Store,
    *,
    tpu: str | None,
    topology: str | None,
    image: str | None,
    namespace: str,
    service_account: str | None,
    worker_python: str,
) -> Target:
    from tpupod.jobs.k8s_manifest import Target, store_label, tpu_slice

    if tpu is None or image is None:
        raise UsageError(
            "--k8s needs --tpu and --image",
            hint="e.g. --k8s --tpu v5litepod-16 --image us-docker.pkg.dev/P/R/worker:1",
        )
    return Target(
        tpu_slice(tpu, topology),
        image=image,
        namespace=namespace,
        store=store_label(store.url),
        worker_python=worker_python,
        service_account=service_account,
    )


def _print_jobset(store: Store, target: Target, pod: str | None) -> None:
    import yaml

    from tpupod.jobs.k8s_manifest import preview

    job, body = preview(store, target, pod)
    which = f"job {job.id}, the next queued" if job.id else "a sample job (none is queued)"
    typer.echo(f"# the JobSet for {which}; nothing was sent")
    typer.echo(yaml.safe_dump(body, sort_keys=False), nl=False)


def _k8s_executor(
    target: Target,
    *,
    kubeconfig: str | None,
    context: str | None,
    on_event: Callable[[str], None] | None,
) -> Executor:
    from tpupod.jobs.k8s import KubernetesExecutor, connect

    cluster = connect(
        kubeconfig=kubeconfig,
        context=context,
        namespace=target.namespace,
        pool=target.slice.hosts + 8,
    )
    return KubernetesExecutor(cluster, target, on_event=on_event)


async def _serve(
    runner: Runner, until_empty: bool, max_jobs: int | None, pool: Pool | None
) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runner.shutdown.set)
    try:
        if pool is not None:
            await pool.start()  # warm before the first job
        await runner.serve(until_empty=until_empty, max_jobs=max_jobs)
    finally:
        if pool is not None:
            await pool.close()


TOKEN_FILE = "jobs-token"


def _token() -> tuple[str, str]:
    """The API's token and where it came from: $TPUPOD_JOBS_TOKEN, else a file of ours (0600)."""
    import secrets

    from tpupod import settings

    given = settings.jobs_token()
    if given:
        return given, "$TPUPOD_JOBS_TOKEN"
    path = settings.state_home() / TOKEN_FILE
    if not path.exists():
        from tpupod.files import write_atomic

        write_atomic(path, secrets.token_urlsafe(32) + "\n")  # 0600
    return path.read_text().strip(), str(path)


@jobs_app.command("serve")
@reporting_errors
def serve(
    db: DbOption = None,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (loopback unless you mean it).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to bind.")] = 8765,
) -> None:
    """The HTTP API: POST/GET /jobs, GET /jobs/ID, /jobs/ID/logs (SSE follow), cancel.

    Every request needs 'Authorization: Bearer TOKEN' ($TPUPOD_JOBS_TOKEN, else the
    token file in the state directory, which this prints the path of, never the token)."""
    import uvicorn

    from tpupod.jobs.api import create_app

    token, source = _token()
    app = create_app(_store(db, create=True), token)
    listening = _listen(host, port)  # ours, so a busy port is one error line
    notice(f"job API on http://{host}:{port} (bearer token: {source})")
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[listening])


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        busy = exc.errno == errno.EADDRINUSE
        hint = f"something else listens there: pick another, --port {port + 1}"
        raise UsageError(
            f"cannot listen on {host}:{port}: {os.strerror(exc.errno) if exc.errno else exc}",
            hint=hint if busy else "--host takes an address of this machine (127.0.0.1)",
        ) from exc
