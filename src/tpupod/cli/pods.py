"""Pod commands: up, down, list, status, hosts."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tpupod.choices import DEFAULT_SPEC_FILE, Capacity, HostKeyPolicy
from tpupod.cli import command
from tpupod.cli.options import EnvOption, Format, FormatOption, PodOption, parse_env
from tpupod.errors import SpecError

if TYPE_CHECKING:
    from tpupod.spec import PodSpec

# Flags that map onto spec fields, so errors about a field can name the flag.
FLAG_FOR_FIELD = {
    "name": "--name",
    "workers": "--local",
    "devices_per_worker": "--devices-per-worker",
}
PROBE_TIMEOUT_S = 10.0


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
    ssh: Annotated[
        str | None,
        typer.Option(
            "--ssh",
            metavar="HOST[,HOST...]",
            show_default=False,
            help="Existing hosts over SSH, [user@]host[:port]; worker ids follow the order.",
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
        typer.Option("--node-count", help="Slices (multislice when > 1).", show_default=False),
    ] = None,
    network: Annotated[str | None, typer.Option("--network", show_default=False)] = None,
    subnetwork: Annotated[str | None, typer.Option("--subnetwork", show_default=False)] = None,
    tag: Annotated[
        list[str] | None,
        typer.Option("--tag", help="Network tag (repeatable).", show_default=False),
    ] = None,
    label: Annotated[
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
            help=f"Pod spec file (default: ./{DEFAULT_SPEC_FILE} when neither --local nor --ssh).",
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

      tpupod up -f tpupod.yaml --name dev-2      # flags override the file
    """
    from tpupod.lifecycle import up as pod_up
    from tpupod.state import StateDir

    overrides: dict[str, Any] = {"name": name, "env": parse_env(env) or None}
    if local is not None or devices_per_worker is not None:
        overrides |= {
            "provider": "local",
            "workers": local,
            "devices_per_worker": devices_per_worker,
        }
    if ssh is not None:
        overrides |= {"provider": "ssh", "hosts": _ssh_hosts(ssh, port)}
    if ssh is not None or user or key or host_keys:
        overrides |= {"user": user, "key": key, "host_keys": host_keys}
    if adopt:
        overrides |= _adopted(adopt, zone, project, user, key)
    elif gcp or tpu_type:
        capacity = _capacity(
            capacity, spot=spot, preemptible=preemptible, reserved=reserved, best_effort=best_effort
        )
        overrides |= {
            "provider": "gcp",
            "tpu_type": tpu_type,
            "zone": zone,
            "project": project,
            "runtime_version": runtime_version,
            "capacity": capacity,
            "node_count": node_count,
            "network": network,
            "subnetwork": subnetwork,
            "tags": tag or None,
            "labels": _labels(label),
            "internal": internal or None,
        }
    spec = _spec_from_args(overrides, file)
    if dry_run:
        _dry_run_up(spec)
        return
    result = pod_up(spec, StateDir(), recreate=recreate)
    verb = "is up" if result.created else "was already up"
    print(f"pod {result.pod.name!r} {verb}: {spec.summary()}")


def _adopted(
    tpu: str, zone: str | None, project: str | None, user: str | None, key: str | None
) -> dict[str, Any]:
    """The spec of an existing TPU, read from the API (type, slices, capacity)."""
    from tpupod.providers.gcp import describe_existing

    if not zone or not key:
        raise SpecError(
            "--adopt needs --zone and --key (and --user if not tpupod)",
            hint="e.g. --adopt my-tpu --zone us-central2-b --key ~/.ssh/google_compute_engine "
            "--user root",
        )
    found = describe_existing(tpu, zone, project)
    return {
        "provider": "gcp",
        "name": tpu,
        "zone": zone,
        "project": project,
        "adopted": True,
        "user": user or "tpupod",
        "key": key,
        **found,
    }


def _capacity(given: Capacity | None, **flags: bool) -> Capacity | None:
    """--capacity, or one of its shorthands (--spot, --preemptible, --reserved, --best-effort)."""
    chosen = [Capacity(name.replace("_", "-")) for name, on in flags.items() if on]
    if given is not None:
        chosen.append(given)
    if len(set(chosen)) > 1:
        names = " and ".join(sorted({c.value for c in chosen}))
        raise SpecError(f"{names} contradict each other", hint="pick one kind of capacity")
    return chosen[0] if chosen else None


def _labels(items: list[str] | None) -> dict[str, str] | None:
    if not items:
        return None
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(
                f"bad --label {item!r}", hint="write --label KEY=VALUE, e.g. --label team=ml"
            )
        labels[key] = value
    return labels


def _dry_run_up(spec: PodSpec) -> None:
    """What `up` would do, without doing it (and, for a TPU, without credentials)."""
    from tpupod.spec import GcpPodSpec

    print(f"dry run: would create pod {spec.name!r}: {spec.summary()}")
    if isinstance(spec, GcpPodSpec):
        from tpupod.providers.gcp_api import create_request

        request = create_request(
            spec, _project(spec), f"{spec.user}:<the pod's public key> {spec.user}"
        )
        _print_request(request)


def _project(spec: Any) -> str:
    from tpupod import settings

    return str(spec.project or settings.gcp_project() or "PROJECT_ID")


def _print_request(request: Any) -> None:
    print(f"API: Cloud TPU {request.version}, {request.api}")
    print(f"{request.method} {request.url}")
    if request.body is not None:
        print(json.dumps(request.body, indent=2))


def _ssh_hosts(text: str, port: int | None) -> list[dict[str, Any]]:
    from tpupod.spec import parse_host

    hosts = [parse_host(item.strip()) for item in text.split(",") if item.strip()]
    if port is not None:
        for host in hosts:
            host.setdefault("port", port)
    return hosts


def _spec_from_args(overrides: dict[str, Any], file: Path | None) -> PodSpec:
    from tpupod.spec import load_spec_file, spec_from_mapping

    given = {key: value for key, value in overrides.items() if value is not None}
    if file is None and "provider" not in given and Path(DEFAULT_SPEC_FILE).is_file():
        file = Path(DEFAULT_SPEC_FILE)
    if file is not None:
        return load_spec_file(file, given)
    if "provider" not in given:
        raise SpecError(
            "nothing to create: no --local N, no --ssh HOSTS and no tpupod.yaml here",
            hint="try 'tpupod up --name dev --local 2', or pass a spec with -f FILE",
        )
    if "name" not in given:
        raise SpecError("the pod needs a name", hint="add --name NAME, e.g. --name dev")
    return spec_from_mapping(given, "", labels=FLAG_FOR_FIELD)


@command("down")
def down(
    pod: PodOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be deleted (for gcp: the request).")
    ] = False,
) -> None:
    """Take a pod down and forget it (a local pod's leftover processes are killed;
    a Cloud TPU is deleted unless it was adopted).

    Examples:

      tpupod down --pod dev

      tpupod down --pod big-tpu --dry-run
    """
    from tpupod.lifecycle import down as pod_down
    from tpupod.spec import GcpPodSpec
    from tpupod.state import StateDir

    state = StateDir()
    target = state.resolve(pod)
    if dry_run:
        print(f"dry run: would take pod {target.name!r} down: {target.spec.summary()}")
        if isinstance(target.spec, GcpPodSpec) and not target.spec.adopted:
            from tpupod.providers.gcp_api import delete_request

            _print_request(delete_request(target.spec, _project(target.spec)))
        return
    pod_down(target, state)
    print(f"pod {target.name!r} is down")


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
    from tpupod.state import StateDir

    pods = StateDir().pods()
    if output is Format.JSON:
        print(json.dumps([json.loads(p.model_dump_json()) for p in pods], indent=2))
    elif not pods:
        print("no pods (create one with 'tpupod up --name dev --local 2')", file=sys.stderr)
    else:
        rows = [("NAME", "PROVIDER", "WORKERS", "CREATED", "DETAILS")]
        rows += [
            (
                p.name,
                p.provider,
                str(len(p.workers)),
                p.created_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
                p.spec.summary(),
            )
            for p in pods
        ]
        _print_columns(rows)
    if all_tpus:
        if not zone:
            raise SpecError(
                "--all needs --zone", hint="e.g. tpupod list --all --zone us-central2-b"
            )
        from tpupod.providers.gcp import list_tpus

        print(f"\nCloud TPUs in {zone}:")
        _print_columns([("API", "NAME", "TYPE", "STATE"), *list_tpus(zone, project)])


@command("hosts")
def hosts(pod: PodOption = None, output: FormatOption = Format.TEXT) -> None:
    """Show every worker: id, hostname, internal and external address (nothing is contacted).

    Examples:

      tpupod hosts

      tpupod hosts --pod dev --format json | jq -r '.[].internal_address'
    """
    from tpupod.state import StateDir

    target = StateDir().resolve(pod)
    if output is Format.JSON:
        print(json.dumps([w.model_dump(exclude={"workdir"}) for w in target.workers], indent=2))
        return
    rows = [("WORKER", "HOSTNAME", "INTERNAL", "EXTERNAL")]
    rows += [
        (str(w.id), w.hostname, w.internal_address, w.external_address or "-")
        for w in target.workers
    ]
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
    """Show a pod and check that every worker answers (runs 'hostname' on each).

    Examples:

      tpupod status --pod dev
    """
    import asyncio

    from tpupod.fanout import execute
    from tpupod.providers import provider_for
    from tpupod.state import StateDir

    if tpu is not None:
        _status_of_tpu(tpu, zone, project)
        return
    target = StateDir().resolve(pod)
    live = asyncio.run(provider_for(target.provider).live_state(target))
    probe = execute(target, "hostname", timeout=PROBE_TIMEOUT_S, grace=1.0)
    rows_json = [
        {
            "worker": r.worker.id,
            "hostname": r.worker.hostname,
            "reachable": r.ok,
            "answer": r.last_line if r.ok else f"{r.outcome_text()}: {r.last_line}",
            "seconds": round(r.duration, 3),
        }
        for r in probe.workers
    ]
    if output is Format.JSON:
        print(
            json.dumps(
                {
                    "pod": target.name,
                    "provider": target.provider,
                    "workers": rows_json,
                    "cloud_state": live,
                    "healthy": probe.ok,
                },
                indent=2,
            )
        )
    else:
        print(
            f"pod {target.name!r}: {target.spec.summary()}, "
            f"created {target.created_at:%Y-%m-%d %H:%M:%S} UTC"
            + (f", cloud state {live}" if live else "")
        )
        rows = [("WORKER", "HOSTNAME", "REACHABLE", "ANSWER", "TIME")]
        rows += [
            (
                str(r["worker"]),
                str(r["hostname"]),
                "yes" if r["reachable"] else "NO",
                str(r["answer"]),
                f"{r['seconds']:.3f}s",
            )
            for r in rows_json
        ]
        _print_columns(rows)
    if not probe.ok:
        raise typer.Exit(1)


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
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
