"""Replace a preempted TPU: delete it (never reuse it), create it again (its zone first,
then each of ``--zones``), and rerun the pod's setup on the fresh workers.

A pod of separate slices (``up --gcp --slices N``) replaces only the slices whose TPU was
preempted or is gone, in the pod's zone (slices joined over DCN share a zone); the others
stay up. When those cannot be made there and ``--zones`` names others, the whole pod is
made again in the next zone."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from tpupod.errors import GcpError, GcpRefused, TpupodError
from tpupod.fanout.context import NoticeHandler
from tpupod.fanout.worker import LineHandler
from tpupod.ops.setup import setup
from tpupod.pod.record import Pod
from tpupod.pod.spec import GcpPodSpec
from tpupod.pod.state import StateDir
from tpupod.providers import provider_for
from tpupod.recovery.confirm import REPLACE_STATES, with_budget
from tpupod.recovery.policy import RetryPolicy

T = TypeVar("T")


async def timed(phases: dict[str, float], name: str, work: Awaitable[T]) -> T:
    """Await ``work``, adding its time to ``phases[name]``."""
    started = time.monotonic()
    try:
        return await work
    finally:
        phases[name] = phases.get(name, 0.0) + time.monotonic() - started


async def delete_tpu(pod: Pod, state: StateDir, notice: NoticeHandler) -> None:
    provider = provider_for(pod.provider)
    await provider.destroy(pod, state)


async def lost_slices(pod: Pod, policy: RetryPolicy, notice: NoticeHandler) -> list[int]:
    """The slices of a pod of separate TPUs whose TPU must be made again (preempted, gone);
    empty: the whole pod (one TPU, every slice lost, or no answer within the budget)."""
    if not isinstance(pod.spec, GcpPodSpec) or pod.spec.slices < 2:
        return []
    from tpupod.providers.gcp import GcpProvider  # a pod of Cloud TPUs only: asyncssh, google

    provider = GcpProvider()
    states = await with_budget(lambda: provider.slice_states(pod), policy, "TPU states", notice)
    if states is None:
        return []
    lost = [k for k, found in enumerate(states) if found in REPLACE_STATES]
    return lost if len(lost) < len(states) else []


async def recreate(
    pod: Pod,
    state: StateDir,
    policy: RetryPolicy,
    phases: dict[str, float],
    *,
    notice: NoticeHandler,
    on_phase: Callable[[str], None],
    slices: Sequence[int] = (),
) -> Pod:
    """The pod on a new TPU of the same shape: the old one deleted, a new one created in
    the first zone that has room. The pod's record is rewritten (its zone may change).
    ``slices``: only those slices' TPUs (a pod of separate slices), the others kept."""
    assert isinstance(pod.spec, GcpPodSpec)
    zones = [pod.spec.zone, *(z for z in policy.zones if z != pod.spec.zone)]
    errors: list[str] = []
    refusals: list[GcpError] = []
    if slices:
        try:
            return await _replace_slices(pod, state, slices, phases, on_phase)
        except GcpError as exc:
            errors.append(f"{pod.spec.zone}: {exc}")
            refusals += [exc] if exc.lasting else []
            if len(zones) == 1:
                raise _not_made(pod, errors, refusals, zones) from None
            notice(f"{pod.spec.zone}: {exc}; making the whole pod again in another zone")
            zones = zones[1:]
    on_phase("delete")
    await timed(phases, "delete", delete_tpu(pod, state, notice))
    on_phase("create")
    for zone in zones:
        spec = pod.spec.model_copy(update={"zone": zone})
        notice(f"creating {spec.tpu_type} {spec.name!r} again in {zone}")
        provider = provider_for(pod.provider)
        try:
            new = await timed(phases, "create", provider.create(spec, state, recreate=True))
        except GcpError as exc:
            errors.append(f"{zone}: {exc}")
            refusals += [exc] if exc.lasting else []
            notice(f"{zone}: {exc}; trying the next zone" if zone != zones[-1] else str(exc))
            continue
        state.save(new)
        return new
    raise _not_made(pod, errors, refusals, errors)


async def _replace_slices(
    pod: Pod,
    state: StateDir,
    slices: Sequence[int],
    phases: dict[str, float],
    on_phase: Callable[[str], None],
) -> Pod:
    from tpupod.providers.gcp import GcpProvider  # a pod of Cloud TPUs only: asyncssh, google

    provider = GcpProvider()
    on_phase("delete")
    await timed(phases, "delete", provider.delete_slices(pod, slices))
    on_phase("create")
    new = await timed(phases, "create", provider.make_slices(pod, state, slices))
    state.save(new)
    return new


def _not_made(
    pod: Pod, errors: list[str], refusals: list[GcpError], tried: Sequence[object]
) -> GcpError:
    """The error of a recovery that made nothing: refused wherever it tried (quota, a
    permission: no retry changes that), or failed."""
    failed = f"could not create {pod.name!r} again: {'; '.join(errors)}"
    if len(refusals) == len(tried):
        return GcpRefused(failed, _refused_hint(refusals[-1]), quota=_quota(refusals[-1]))
    return GcpError(failed, hint="--zones z1,z2 lets the recovery try other zones")


def _quota(error: GcpError) -> bool:
    return isinstance(error, GcpRefused) and error.quota


def _refused_hint(error: GcpError) -> str:
    """What to do about a create refused everywhere: quota to ask for, or zones to add; the
    account's permissions."""
    if _quota(error):
        return (
            "ask for more TPU quota (https://console.cloud.google.com/iam-admin/quotas), or "
            "name zones that have it with --zones Z1,Z2"
        )
    return error.hint or "'tpupod status' shows the TPU's state"


async def rerun_setup(
    pod: Pod, script: Path, phases: dict[str, float], on_line: LineHandler | None = None
) -> None:
    """The pod's setup script on every worker (a fresh TPU has nothing from before; a slice
    kept up has run it, and only checks its marker); its output goes to ``on_line``."""
    result = await timed(phases, "setup", setup(pod, script, on_line=on_line))
    if not result.ok:
        first = result.first_failure
        detail = f"{first.worker.label}: {first.last_line}" if first else "failed"
        raise TpupodError(
            f"setup failed on the new TPU ({detail})", hint="'tpupod logs' shows more"
        )
