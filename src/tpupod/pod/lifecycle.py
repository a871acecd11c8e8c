"""Bringing pods up and down: the provider does the work, the state directory remembers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tpupod import settings
from tpupod.errors import PodExists, StateError
from tpupod.pod import users as podusers
from tpupod.pod.choices import DEFAULT_SPEC_FILE
from tpupod.pod.record import Pod
from tpupod.pod.spec import GcpPodSpec, PodSpec, UpFlags, adoption, spec_from_flags
from tpupod.pod.state import StateDir
from tpupod.pod.users import PodUser
from tpupod.providers import gcp_api, provider_for

if TYPE_CHECKING:
    from tpupod.providers.gcp_api import ApiRequest

STOP_S = 30.0  # a runner stops its job (TERM, then KILL after 3 s) and gives it back


def spec_for(flags: UpFlags, state: StateDir | None = None) -> PodSpec:
    """The spec ``up``'s flags ask for; with ``--adopt``, the TPU is read from the API first
    (after the flags and the key file are checked, so a mistake costs no call). Only
    ``--name`` of a known pod (and no ./tpupod.yaml): that pod's recorded spec, so that
    ``up --recreate --name NAME`` brings a pod's TPU back without its flags."""
    state = state or StateDir()
    if flags.given() == ["name"] and not Path(DEFAULT_SPEC_FILE).is_file():
        assert flags.name is not None
        if state.exists(flags.name):
            return state.load(flags.name).spec
    adopted = None
    target = adoption(flags)
    if target is not None:
        # adopting a pod only: the GCP provider brings the gcp extra
        from tpupod.providers.gcp import describe_existing
        from tpupod.providers.ssh import check_key_file  # the SSH provider: asyncssh

        check_key_file(str(flags.key))  # before the API is asked
        adopted = describe_existing(*target)
    return spec_from_flags(flags, adopted)


def create_requests(spec: PodSpec) -> list[ApiRequest]:
    """The Cloud TPU API requests ``up`` would send for ``spec`` (one per TPU: a pod of
    separate slices has several; none for other pods), made without credentials; they
    refuse what neither TPU API makes."""
    if not isinstance(spec, GcpPodSpec):
        return []
    keys = f"{spec.user}:<the pod's public key> {spec.user}"
    return [gcp_api.create_request(tpu, _project(spec), keys) for tpu in spec.tpus()]


def delete_requests(pod: Pod) -> list[ApiRequest]:
    """The Cloud TPU API requests ``down`` would send (none: not a TPU, or an adopted one,
    which ``down`` never deletes)."""
    if not isinstance(pod.spec, GcpPodSpec) or pod.spec.adopted:
        return []
    return [gcp_api.delete_request(tpu, _project(pod.spec)) for tpu in pod.spec.tpus()]


def _project(spec: GcpPodSpec) -> str:
    return str(spec.project or settings.gcp_project() or "PROJECT_ID")


@dataclass(frozen=True)
class UpResult:
    pod: Pod
    created: bool  # False: an identical pod was already up


def up(spec: PodSpec, state: StateDir, *, recreate: bool = False) -> UpResult:
    """Create the pod, or return the existing one if it has the same spec; with
    ``recreate``, make a known pod's broken cloud resources again (:func:`remake`).

    The pod's folder is claimed first (an atomic mkdir), and removed again if
    the provider fails, so a pod is never recorded half-made.
    """
    if state.exists(spec.name) and recreate:
        return UpResult(remake(spec, state), created=True)
    if state.exists(spec.name):
        existing = state.load(spec.name)
        if existing.spec == spec:
            return UpResult(existing, created=False)
        raise PodExists(
            f"pod {spec.name!r} exists with a different spec ({_describe(existing.spec)})",
            hint=f"'tpupod down --pod {spec.name}' first, or pick another --name",
        )
    try:
        state.claim(spec.name)
    except FileExistsError:
        # A folder without a record: a crash during an earlier `up`. Nothing lives there.
        state.remove(spec.name)
        state.claim(spec.name)
    except OSError as exc:
        raise StateError(
            f"cannot create the pod's folder under {state.pods_dir}: {exc.strerror}",
            hint="set TPUPOD_HOME to a writable directory",
        ) from exc
    try:
        pod = asyncio.run(provider_for(spec.provider).create(spec, state, recreate=recreate))
        state.save(pod)
    except BaseException:
        state.remove(spec.name)
        raise
    return UpResult(pod, created=True)


def remake(spec: PodSpec, state: StateDir) -> Pod:
    """A known pod made again where it broke (a preempted, failed or gone TPU), keeping its
    folder: its key, run logs and recovery records. The provider checks before it changes
    anything (a healthy TPU is refused), and the record is replaced only once the new
    resources are up. No run with --retries may be recovering the pod meanwhile."""
    state.hold(spec.name, "tpupod up --recreate", f"kill {os.getpid()}")
    try:
        pod = asyncio.run(provider_for(spec.provider).create(spec, state, recreate=True))
        state.save(pod)
    finally:
        state.release(spec.name)
    return pod


def down(
    pod: Pod,
    state: StateDir,
    *,
    force: bool = False,
    stop_s: float = STOP_S,
    before: Callable[[], None] | None = None,
) -> tuple[list[PodUser], list[PodUser]]:
    """Take the pod's workers down, then forget it; returns the users it asked to let go,
    and those of them that had not within ``stop_s`` (they stop when they see it gone).

    A pod that a job runner serves or a run uses (``tpupod run``, and what runs through
    it) is refused: its work would be killed and recorded as failed. With ``force`` they
    are asked to let go first (a runner gives its job back to the queue and exits, a run
    stops its workers, up to ``stop_s``).
    ``before`` runs once the pod may go, before its workers do (the CLI stops a serving
    fleet there: on hosts that outlive the pod it would run on with no record)."""
    found = one_per_run(podusers.users(state, pod.name))
    if found and not force:
        raise _in_use(pod.name, found)
    by = f"'tpupod down --force' (pid {os.getpid()})"
    left = podusers.stop(state, pod.name, found, stop_s, by) if found else []
    # Held while it goes: a recovery or 'up --recreate' that still holds it is named (it
    # would make the TPU again), and none may begin meanwhile.
    state.hold(pod.name, "tpupod down", f"kill {os.getpid()}")
    try:
        if before is not None:
            before()
        podusers.mark_going_down(state, pod.name)  # a user that did not let go stops now
        try:
            asyncio.run(provider_for(pod.provider).destroy(pod, state))
        except BaseException:
            podusers.unmark_going_down(state, pod.name)
            raise
        state.remove(pod.name)
    finally:
        state.release(pod.name)
    return found, left


def one_per_run(found: list[PodUser]) -> list[PodUser]:
    """The users, those that say how to stop them first; a run with --retries and its
    attempt's launch are one run (its cancel stops both): the launch is left out."""
    stoppable = {user.pid for user in found if user.stop}
    kept = [user for user in found if user.stop or user.pid not in stoppable]
    return sorted(kept, key=lambda user: not user.stop)


def _in_use(pod: str, found: list[PodUser]) -> StateError:
    """The refusal of a pod in use, naming its users and how to stop the first."""
    first = found[0]
    command = first.stop or (f"tpupod cancel {first.run_id}" if first.run_id else "")
    stop = f"'{command}'" if command else f"kill -TERM {first.pid}"
    return StateError(
        f"pod {pod!r} is in use by {', '.join(user.describe() for user in found)}",
        hint=f"stop it first ({stop}), or add --force: {', '.join(_forced(found))}",
    )


def _forced(found: list[PodUser]) -> list[str]:
    """What --force does to each kind of user ``found`` holds, in their order."""
    said: dict[str, None] = {}
    for user in found:
        if user.run_id:
            said["a run stops"] = None
        elif user.what.startswith("a job runner"):
            said["a job runner gives its running job back to the queue"] = None
        elif user.what == "tpupod serve up":  # serve.fleet.remote.SERVE_UP
            said["a 'serve up' stops (the fleet stops with the pod)"] = None
        else:
            said["it is asked to stop (SIGTERM)"] = None
    return list(said)


def _describe(spec: PodSpec) -> str:
    return f"{spec.provider}: {spec.summary()}"
