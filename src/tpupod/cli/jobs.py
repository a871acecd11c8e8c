"""``tpupod jobs``: submit work to the job store, follow it, and run runners.

Each command parses its options, calls one library function (``tpupod.jobs.service``,
``.request``, ``.runnerflow``, ``.api``) and prints what it returns."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

from tpupod.cli.app import app, command
from tpupod.cli.flow.submit import DB, SubmitArgs
from tpupod.cli.options import PodOption
from tpupod.cli.typed import annotated, takes
from tpupod.fanout.report import notice

if TYPE_CHECKING:
    from tpupod.jobs.models import Job

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

if TYPE_CHECKING:
    DbOption = str | None
else:
    DbOption = annotated(DB, str | None)
# read as text and checked by ``service.job_id``: click's message for a non-number is not plain
JobId = Annotated[str, typer.Argument(metavar="ID", help="The job's id.", show_default=False)]


@command("submit", group=jobs_app, needs=("jobs",))
@takes(SubmitArgs)
def submit(args: SubmitArgs) -> None:
    """Queue a job; print its id alone on stdout (id=$(tpupod jobs submit ...))."""
    from tpupod.jobs import service
    from tpupod.jobs.request import build_request
    from tpupod.jobs.rows import check_key, new_submit_key

    key = new_submit_key() if args.key is None else check_key(args.key)
    request = build_request(
        args.what,
        dashed="--" in sys.argv,  # click drops the "--": after it, everything is the command
        name=args.name,
        label=args.label,
        priority=args.priority,
        timeout=args.timeout,
        max_attempts=args.max_attempts,
        retries=args.retries,
        pod=args.pod,
    )
    job_id = service.submit(request, db=args.db, remote_pod=args.remote_pod, key=key, say=notice)
    print(job_id, flush=True)
    if args.wait:
        _print_result(service.wait(service.open_store(args.db), job_id, say=notice))


@command("ls", group=jobs_app, needs=("jobs",))
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
    from tpupod.jobs import service
    from tpupod.jobs.request import labels

    wanted = service.statuses(status or [])
    header = f"{'ID':>6}  {'STATUS':<10} {'TRY':>3}  {'AGE':>7}  {'POD':<12} NAME"
    if (unmade := service.unmade_default_store(db)) is not None:
        print(header)
        notice(f"no jobs yet: the first 'tpupod jobs submit' makes {unmade}")
        return
    page = service.list_jobs(
        service.open_store(db), statuses=wanted, labels=labels(label), limit=limit
    )
    print(header)
    for job in page.jobs:
        age = _age(time.time() - job.created_at)
        tries = (
            f"{job.attempt}"
            if job.status.finished
            else f"{job.counted_attempts}/{job.max_attempts}"  # given back: not counted
        )
        where = job.pod or "-"
        gone = service.gone_runner(job)
        note = f"  ({gone})" if gone else ""
        row = f"{job.id:>6}  {job.status.value:<10} {tries:>3}  {age:>7}  {where:<12} {job.name}"
        print(row + note)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


@command("show", group=jobs_app, needs=("jobs",))
def show(
    job_id: JobId,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="The whole record as JSON.")] = False,
) -> None:
    """One job's record."""
    from tpupod.jobs import service

    ident = service.job_id(job_id)  # a usage error before the store is opened
    job = service.open_store(db).get(ident)
    if as_json:
        print(json.dumps(job.to_dict(), indent=2))
        return
    print(f"job {job.id} {job.name}".rstrip())
    print(f"  status    {service.status_text(job)}")
    print(f"  runs      {job.command if job.command is not None else 'Python code'}")
    print(f"  pod       {job.pod or 'any runner'}")
    for label, stamp in service.times(job):
        print(f"  {label:<9} {stamp}")
    for number, text in enumerate(service.attempt_texts(job)):
        print(f"  {'attempts' if number == 0 else '':<9} {text}")
    if job.result is not None:
        print(f"  result    {service.result_text(job.result)}")
    if job.error:
        print(f"  error     {job.error}")


@command("logs", group=jobs_app, needs=("jobs",))
def logs(
    job_id: JobId,
    db: DbOption = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Until the job ends.")] = False,
    offset: Annotated[int, typer.Option("--offset", help="Only lines after this offset.")] = 0,
    attempt: Annotated[
        int | None,
        typer.Option("--attempt", metavar="N", help="Only attempt N's lines.", show_default=False),
    ] = None,
) -> None:
    """A job's output lines ([wN] shows the worker on a pod; '--- attempt N (runner R,
    started T) ---' where each attempt begins, when it ran more than once)."""
    from tpupod.jobs import service

    ident = service.job_id(job_id)
    store = service.open_store(db)
    job = store.get(ident)
    service.check_attempt(job, attempt)
    view = service.LogView(job)
    pages = service.log_pages(
        store, ident, after=offset, until_end=follow, say=notice, attempt=attempt
    )
    for page in pages:
        sys.stdout.write("".join(text + "\n" for _, text in view.lines(page)))
        sys.stdout.flush()


@command("cancel", group=jobs_app, needs=("jobs",))
def cancel(job_id: JobId, db: DbOption = None) -> None:
    """Cancel a job: a pending one at once, a running one on every worker."""
    from tpupod.jobs import service

    ident = service.job_id(job_id)
    job = service.open_store(db).cancel(ident)
    state = job.status.value if job.status.finished else "cancel requested"
    print(f"job {job.id}: {state}")


@command("wait", group=jobs_app, needs=("jobs",))
def wait(
    job_id: JobId,
    db: DbOption = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Seconds.", show_default=False)
    ] = None,
) -> None:
    """Wait for a job to end; print its result (exit 1 when it did not complete)."""
    from tpupod.jobs import service
    from tpupod.jobs.request import positive_seconds

    ident, limit = service.job_id(job_id), positive_seconds("--timeout", timeout)
    _print_result(service.wait(service.open_store(db), ident, timeout=limit, say=notice))


def _print_result(job: Job) -> None:
    from tpupod.jobs.service import result_text

    if job.result is not None:
        print(result_text(job.result))


@command("worker", group=jobs_app, needs=("jobs",))
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
    from tpupod.jobs.runnerflow import K8sOptions, RunnerOptions, preview_jobset, run_runner

    where = K8sOptions(
        tpu=tpu,
        image=image,
        topology=topology,
        namespace=namespace,
        kubeconfig=kubeconfig,
        context=context,
        service_account=service_account,
    )
    options = RunnerOptions(
        db=db,
        pod=pod,
        local=local,
        k8s=where if k8s else None,
        lease_s=lease,
        until_empty=until_empty,
        max_jobs=max_jobs,
        worker_python=worker_python,
        concurrency=concurrency,
        pool=pool,
    )
    if dry_run:
        _print_jobset(*preview_jobset(options))
        return
    run_runner(options, on_event=None if quiet else notice)


def _print_jobset(job: Job, body: dict[str, object]) -> None:
    import yaml

    which = f"job {job.id}, the next queued" if job.id else "a sample job (none is queued)"
    typer.echo(f"# the JobSet for {which}; nothing was sent")
    typer.echo(yaml.safe_dump(body, sort_keys=False), nl=False)


@command("serve", group=jobs_app, needs=("jobs",))
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
    from tpupod.jobs.api import serve_api
    from tpupod.jobs.rows import START_WAIT_S
    from tpupod.jobs.store import Store

    # a service started beside a database restart (or before its server) waits for it
    store = Store.open_waiting(db, create=True, wait_s=START_WAIT_S, say=notice)
    serve_api(store, host, port, on_ready=notice)
