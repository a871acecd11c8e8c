"""Bringing pods up and down: the provider does the work, the state directory remembers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tpupod.errors import PodExists, StateError
from tpupod.pod import Pod
from tpupod.providers import provider_for
from tpupod.spec import PodSpec
from tpupod.state import StateDir


@dataclass(frozen=True)
class UpResult:
    pod: Pod
    created: bool  # False: an identical pod was already up


def up(spec: PodSpec, state: StateDir, *, recreate: bool = False) -> UpResult:
    """Create the pod, or return the existing one if it has the same spec.

    The pod's folder is claimed first (an atomic mkdir), and removed again if
    the provider fails, so a pod is never recorded half-made.
    """
    if state.exists(spec.name) and recreate:
        state.remove(spec.name)  # the provider replaces what the record described
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


def down(pod: Pod, state: StateDir) -> None:
    """Take the pod's workers down, then forget it."""
    asyncio.run(provider_for(pod.provider).destroy(pod, state))
    state.remove(pod.name)


def _describe(spec: PodSpec) -> str:
    return f"{spec.provider}: {spec.summary()}"
