"""Pod commands: up, down, list, status, hosts."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tpupod.cli.app import command
from tpupod.cli.options import EnvOption, Format, FormatOption, PodOption
from tpupod.errors import SpecError, TpupodError
from tpupod.fanout.report import notice, print_columns, print_error
from tpupod.pod.choices import DEFAULT_SPEC_FILE, Capacity, HostKeyPolicy, TpuApiKind

if TYPE_CHECKING:
    from tpupod.ops.status import PodStatus
    from tpupod.pod.record import Pod
    from tpupod.pod.spec import UpFlags
    from tpupod.pod.state import StateDir
    from tpupod.providers.gcp_api import ApiRequest


@command("up")
def up(
    name: Annotated[
        str | None, typer.Option("--name", "-n", help="Name of the pod.", show_default=False)
    ] = None,
    local: Annotated[
        int | None,
        typer.Option(
            "--local", metavar="N", help="A local pod of N simulated hosts.", show_default=False
        ),
    ] = None,
    devices_per_worker: Annotated[
        int | None,
        typer.Option(
            "--devices-per-worker",
            "-d",
            metavar="D",
            help="CPU devices JAX sees per local worker.",
            show_default=False,
        ),
    ] = None,
    slices: Annotated[
        int | None,
        typer.Option(
            "--slices",
            metavar="S",
            help="Split the workers, in order, into S slices of the same size; with --gcp, "
            "S separate TPUs of --tpu-type (NAME-0...), each replaced alone.",
            show_default=False,
        ),
    ] = None,
    ssh: Annotated[
        list[str] | None,
        typer.Option(
            "--ssh",
            metavar="HOST[,HOST...]",
            show_default=False,
            help="Existing hosts over SSH, [user@]host[:port]; worker ids follow the order. "
            "Given again: one slice each.",
        ),
    ] = None,
    user: Annotated[
        str | None, typer.Option("--user", help="SSH login user.", show_default=False)
    ] = None,
    port: Annotated[
        int | None,
        typer.Option("--port", help="SSH port for hosts that name none.", show_default=False),
    ] = None,
    key: Annotated[
        str | None, typer.Option("--key", help="SSH private key file.", show_default=False)
    ] = None,
    host_keys: Annotated[
        HostKeyPolicy | None,
        typer.Option(
            "--host-keys",
            show_default=False,
            help="tofu: remember on first use (default); strict: only remembered keys; "
            "insecure: never check (throwaway pods).",
        ),
    ] = None,
    gcp: Annotated[
        bool, typer.Option("--gcp", help="A Cloud TPU (needs --tpu-type and --zone).")
    ] = False,
    tpu_type: Annotated[
        str | None,
        typer.Option("--tpu-type", help="e.g. v4-16, v5litepod-64, v6e-16.", show_default=False),
    ] = None,
    zone: Annotated[
        str | None, typer.Option("--zone", help="e.g. us-central2-b.", show_default=False)
    ] = None,
    project: Annotated[
        str | None,
        typer.Option(
            "--project",
            help="Default: Application Default Credentials' project.",
            show_default=False,
        ),
    ] = None,
    runtime_version: Annotated[
        str | None,
        typer.Option(
            "--runtime-version", help="Default: the type's usual image.", show_default=False
        ),
    ] = None,
    capacity: Annotated[
        Capacity | None,
        typer.Option(
            "--capacity",
            help="on-demand (default), spot, preemptible, reserved or best-effort.",
            show_default=False,
        ),
    ] = None,
    spot: Annotated[bool, typer.Option("--spot", help="Same as --capacity spot.")] = False,
    preemptible: Annotated[
        bool, typer.Option("--preemptible", help="Same as --capacity preemptible.")
    ] = False,
    reserved: Annotated[
        bool, typer.Option("--reserved", help="Same as --capacity reserved.")
    ] = False,
    best_effort: Annotated[
        bool, typer.Option("--best-effort", help="Same as --capacity best-effort.")
    ] = False,
    node_count: Annotated[
        int | None,
        typer.Option(
            "--node-count",
            metavar="N",
            help="N slices of one multislice queued resource (GCP preempts and replaces it whole).",
            show_default=False,
        ),
    ] = None,
    api: Annotated[
        TpuApiKind | None,
        typer.Option(
            "--api",
            help="tpu-vm or queued-resource (default: a queued resource for multislice, "
            "spot, reserved and best-effort, else a TPU VM).",
            show_default=False,
        ),
    ] = None,
    network: Annotated[str | None, typer.Option("--network", show_default=False)] = None,
    subnetwork: Annotated[str | None, typer.Option("--subnetwork", show_default=False)] = None,
    tags: Annotated[
        list[str] | None,
        typer.Option("--tag", help="Network tag (repeatable).", show_default=False),
    ] = None,
    labels: Annotated[
        list[str] | None,
        typer.Option("--label", metavar="K=V", help="Label (repeatable).", show_default=False),
    ] = None,
    internal: Annotated[
        bool,
        typer.Option(
            "--internal",
            help="Reach workers at internal addresses (from a VM in the same network).",
        ),
    ] = False,
    recreate: Annotated[
        bool,
        typer.Option(
            "--recreate", help="Delete and create again a TPU that was preempted or failed."
        ),
    ] = False,
    adopt: Annotated[
        str | None,
        typer.Option(
            "--adopt",
            metavar="TPU",
            help="Record an existing TPU made "
            "elsewhere (never deleted by 'down'); needs --zone and --key.",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print what would be created (for gcp: the API request); create nothing.",
        ),
    ] = False,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            "-f",
            show_default=False,
            help=f"Pod spec file (default: ./{DEFAULT_SPEC_FILE} when no flag "
            "says which kind of pod).",
        ),
    ] = None,
    env: EnvOption = None,
) -> None:
    """Create a pod (or confirm that an identical one is up).

    For an SSH pod, every host must answer; its hostname and address are
    recorded, and its host key remembered (trust on first use).

    Examples:

      tpupod up --name dev --local 4 --devices-per-worker 2

      tpupod up --name lab --ssh root@10.0.0.5,root@10.0.0.6 --key ~/.ssh/id_ed25519

      tpupod up --name ms --local 4 --slices 2     # 2 slices of 2 workers

      tpupod up --name big --gcp --tpu-type v5litepod-16 --zone us-west4-a --slices 2 --spot

      tpupod up -f tpupod.yaml --name dev-2      # flags override the file
    """
    given = dict(locals())  # first: the parameters, named as UpFlags' fields
    from tpupod.pod import lifecycle
    from tpupod.pod.spec import SshPodSpec
    from tpupod.pod.state import StateDir

    spec = lifecycle.spec_for(_up_flags(given))
    if isinstance(spec, SshPodSpec):
        for line in spec.repeated_hosts():
            notice(f"warning: {line}: those workers share that host")
    if dry_run:
        requests = lifecycle.create_requests(spec)  # first: they refuse what no API makes
        print(f"dry run: would create pod {spec.name!r}: {spec.summary()}")
        _print_requests(requests)
        return
    result = lifecycle.up(spec, StateDir(), recreate=recreate)
    verb = "is up" if result.created else "was already up"
    print(f"pod {result.pod.name!r} {verb}: {spec.summary()}")


def _up_flags(given: dict[str, Any]) -> UpFlags:
    """``up``'s parameters as UpFlags (repeated options as tuples); a parameter that is not
    a field, other than --dry-run and --recreate, is a TypeError here."""
    from tpupod.pod.spec import UpFlags

    flags = {k: v for k, v in given.items() if k not in ("dry_run", "recreate")}
    for repeated in ("ssh", "tags", "labels", "env"):
        flags[repeated] = tuple(flags[repeated] or ())
    return UpFlags(**flags)


def _print_requests(requests: list[ApiRequest]) -> None:
    """Each request, numbered when there are several (one per separate slice)."""
    for i, request in enumerate(requests):
        which = f" (slice {i} of {len(requests)})" if len(requests) > 1 else ""
        print(f"API: Cloud TPU {request.version}, {request.api}{which}")
        print(f"{request.method} {request.url}")
        if request.body is not None:
            print(json.dumps(request.body, indent=2))


@command("down")
def down(
    pod: PodOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be deleted (for gcp: the request).")
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Also a pod in use: a job runner gives its job back to the queue and exits "
            "first, a run stops, a run with --retries is cancelled (as 'tpupod cancel').",
        ),
    ] = False,
) -> None:
    """Take a pod down and forget it (a local pod's leftover processes are killed;
    a Cloud TPU is deleted unless it was adopted). A pod that a job runner
    ('tpupod jobs worker --pod P') or a run is using is refused without --force.

    Examples:

      tpupod down --pod dev

      tpupod down --pod big-tpu --dry-run
    """
    from tpupod.pod import lifecycle
    from tpupod.pod.state import StateDir

    state = StateDir()
    target = state.resolve(pod)
    if dry_run:
        print(f"dry run: would take pod {target.name!r} down: {target.spec.summary()}")
        _print_requests(lifecycle.delete_requests(target))
        return
    asked, left = lifecycle.down(
        target, state, force=force, before=lambda: _stop_fleet(target, state)
    )
    for user in asked:
        done = "did not stop in time (it stops when it sees the pod gone)" if user in left else ""
        print(f"stopped {user.describe()}" if not done else f"{user.describe()} {done}")
    print(f"pod {target.name!r} is down")


def _stop_fleet(pod: Pod, state: StateDir) -> None:
    """The pod's serving fleet, stopped as 'serve down' does: hosts that outlive the pod (an
    SSH pod's, an adopted TPU's) would serve on with no record left to stop them. A local
    pod's processes, and a deleted TPU's, go with it anyway."""
    from tpupod.serve.fleet.record import record_path

    if not record_path(state, pod.name).exists():
        return
    if pod.on_this_machine:
        notice(f"pod {pod.name!r} has a serving fleet: it stops with the pod")
        return
    from tpupod.serve.fleet.control import Fleet

    notice(f"pod {pod.name!r} has a serving fleet: stopping its serving fleet first")
    try:
        Fleet(pod, state).down(notice)
    except TpupodError as exc:  # hosts that do not answer: the pod goes all the same
        notice(f"its fleet could not be stopped everywhere ({exc}); going on")


@command("list")
def list_pods(
    output: FormatOption = Format.TEXT,
    all_tpus: Annotated[
        bool, typer.Option("--all", help="Also every Cloud TPU in --zone, made by tpupod or not.")
    ] = False,
    zone: Annotated[str | None, typer.Option("--zone", show_default=False)] = None,
    project: Annotated[str | None, typer.Option("--project", show_default=False)] = None,
) -> None:
    """List known pods (and with --all, every TPU in a zone).

    Examples:

      tpupod list

      tpupod list --all --zone us-central2-b
    """
    from tpupod.pod.state import StateDir

    if all_tpus:  # before any output: a missing --zone or gcp extra is said first, alone
        if not zone:
            raise SpecError(
                "--all needs --zone", hint="e.g. tpupod list --all --zone us-central2-b"
            )
        from tpupod.extras import require

        require("talking to Cloud TPUs", "gcp")
    pods, broken = StateDir().pods()
    if output is Format.JSON:
        print(json.dumps([json.loads(p.model_dump_json()) for p in pods], indent=2))
    elif not pods and not broken:
        print("no pods (create one with 'tpupod up --name dev --local 2')", file=sys.stderr)
    else:
        rows = [p.listing() for p in pods]
        rows += [(name, "?", "?", "?", "its record is unreadable (below)") for name in broken]
        _print_columns([("NAME", "PROVIDER", "WORKERS", "CREATED", "DETAILS"), *sorted(rows)])
    for exc in broken.values():
        print_error(f"error: {exc.message}", exc.hint, sys.stderr)
    if broken:
        raise typer.Exit(next(iter(broken.values())).exit_code)
    if all_tpus and zone:
        from tpupod.providers.gcp import list_tpus

        print(f"\nCloud TPUs in {zone}:")
        _print_columns([("API", "NAME", "TYPE", "STATE"), *list_tpus(zone, project)])


@command("hosts")
def hosts(pod: PodOption = None, output: FormatOption = Format.TEXT) -> None:
    """Show every worker: id, slice (on a pod of slices), hostname, internal and external
    address (nothing is contacted).

    Examples:

      tpupod hosts

      tpupod hosts --pod dev --format json | jq -r '.[].internal_address'
    """
    from tpupod.pod.state import StateDir

    target = StateDir().resolve(pod)
    if output is Format.JSON:
        print(json.dumps([w.model_dump(exclude={"workdir"}) for w in target.workers], indent=2))
        return
    sliced = target.slices > 1
    rows = [("WORKER", *(("SLICE",) if sliced else ()), "HOSTNAME", "INTERNAL", "EXTERNAL")]
    for w in target.workers:
        where = (str(w.slice),) if sliced else ()
        rows.append((str(w.id), *where, w.hostname, w.internal_address, w.external_address or "-"))
    _print_columns(rows)


@command("status")
def status(
    pod: PodOption = None,
    output: FormatOption = Format.TEXT,
    tpu: Annotated[
        str | None,
        typer.Option(
            "--tpu", help="Any Cloud TPU by name (with --zone), pod or not.", show_default=False
        ),
    ] = None,
    zone: Annotated[str | None, typer.Option("--zone", show_default=False)] = None,
    project: Annotated[str | None, typer.Option("--project", show_default=False)] = None,
) -> None:
    """Show a pod (on a pod of slices, each worker's slice) and check that every worker
    answers (runs 'hostname' on each); each running run: every worker's step and steps/s
    (tpupod.heartbeat) or its last line, and its latest stacks; the latest run if it ended
    hung: why, and the digest of its stacks; with the pod's latest 'run --retries' run: its
    attempts, their causes and each phase's time.

    Examples:

      tpupod status --pod dev
    """
    from tpupod.launch.standing import pod_standings
    from tpupod.ops.status import pod_status
    from tpupod.pod.state import StateDir
    from tpupod.recovery.record import latest_recovery

    if tpu is not None:
        _status_of_tpu(tpu, zone, project)
        return
    state = StateDir()
    found = pod_status(state.resolve(pod))
    recovery = latest_recovery(state, found.pod.name)
    standings = pod_standings(state, found.pod.name)
    if output is Format.JSON:
        shown = [s.to_json() for s in standings]
        as_json = {**found.to_json(), "runs": shown, "recovery": recovery and recovery.to_json()}
        print(json.dumps(as_json, indent=2))
    else:
        _print_status(found)
        for run in standings:
            print("\n".join(run.lines()))
        if recovery is not None:
            print("\n  ".join([recovery.headline(), *recovery.told()]))
        if found.advice:
            print(f"hint: {found.advice}", file=sys.stderr)
    if not found.healthy:
        raise typer.Exit(found.exit_code or 1)


def _print_status(found: PodStatus) -> None:
    target = found.pod
    print(
        f"pod {target.name!r}: {target.spec.summary()}, "
        f"created {target.created_at:%Y-%m-%d %H:%M:%S} UTC"
        + (f", cloud state {found.cloud_text}" if found.cloud_state else "")
    )
    sliced = target.slices > 1
    if sliced:
        print(target.slice_layout())
    rows = [("WORKER", *(("SLICE",) if sliced else ()), "HOSTNAME", "REACHABLE", "ANSWER", "TIME")]
    for w in found.workers:
        where = (str(w.slice),) if sliced else ()
        reachable = "yes" if w.reachable else "NO"
        rows.append((str(w.worker), *where, w.hostname, reachable, w.answer, f"{w.seconds:.3f}s"))
    _print_columns(rows)


def _status_of_tpu(name: str, zone: str | None, project: str | None) -> None:
    from tpupod.providers.gcp import find_tpu, tpu_summary

    if not zone:
        raise SpecError(
            "--tpu needs --zone", hint="e.g. tpupod status --tpu my-tpu --zone us-central2-b"
        )
    kind, found = find_tpu(name, zone, project)
    tpu_type, state = tpu_summary(kind, found)
    print(f"{name}: {kind}, {tpu_type}, {state}")


def _print_columns(rows: Sequence[Sequence[str]]) -> None:
    print_columns(rows, sys.stdout)
