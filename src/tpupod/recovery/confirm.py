"""Is it a preemption? Only the provider may say so.

A TPU counts as preempted when the Cloud TPU API says so (the node PREEMPTED, the
queued resource SUSPENDING or SUSPENDED) or a worker's metadata server answers
``instance/preempted`` TRUE; a TPU the API no longer has (``GONE``) is made again
as a preempted one is. An API call that fails, or a worker that does not answer, is
retried with backoff for the policy's budget (``probe_s``; ``probe_tries``, when set,
caps the tries) and is never taken for a preemption: recovery loops that destroyed
healthy runs did exactly that.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tpupod import settings
from tpupod.errors import TpupodError
from tpupod.fanout.context import NoticeHandler
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import Outcome
from tpupod.pod.record import Pod, Worker
from tpupod.pod.spec import GcpPodSpec
from tpupod.providers import GONE, Connector, provider_for
from tpupod.recovery.policy import RetryPolicy

PREEMPTED_STATES = frozenset({"PREEMPTED", "SUSPENDING", "SUSPENDED"})
REPLACE_STATES = PREEMPTED_STATES | {GONE}  # the TPU must be made again
METADATA_TIMEOUT_S = 10.0
T = TypeVar("T")


def backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (0, 1, ...): 0.5, 1, 2, ... up to 10."""
    return float(min(0.5 * 2**attempt, 10.0))


def another_try(policy: RetryPolicy, tries: int, started: float) -> float | None:
    """Seconds to wait before try ``tries + 1``, or None when the budget is spent: its
    time (``probe_s``), or its count where one is set (``probe_tries`` > 0)."""
    left = policy.probe_s - (time.monotonic() - started)
    if left <= 0 or 0 < policy.probe_tries <= tries:
        return None
    return min(backoff(tries - 1), left)


async def with_budget(
    call: Callable[[], Awaitable[T]], policy: RetryPolicy, what: str, notice: NoticeHandler
) -> T | None:
    """``call()``, retried with backoff while it raises, for the policy's budget; None
    when the budget is spent without an answer. Says so at the first failure and the end."""
    started = time.monotonic()
    tries = 0
    while True:
        try:
            found = await call()
        except TpupodError as exc:
            tries += 1
            delay = another_try(policy, tries, started)
            if delay is None:
                said = str(exc).rstrip(".")  # the API's message may end a sentence
                notice(f"{what}: no answer within the budget ({said}); not a preemption")
                return None
            if tries == 1:
                said = str(exc).rstrip(".")
                notice(f"{what}: {said}; retrying for up to {policy.probe_s:.0f}s")
            await asyncio.sleep(delay)
            continue
        if tries:
            notice(f"{what}: answered after {time.monotonic() - started:.0f}s")
        return found


async def api_state(
    pod: Pod, policy: RetryPolicy, notice: NoticeHandler, slices: Sequence[int] | None = None
) -> str | None:
    """The TPU's state as the API reports it, or None (no answer within the budget, or a
    provider without a cloud state). ``slices``: of those slices only (an elastic run's,
    while another is made again)."""
    return await with_budget(lambda: state_of(pod, slices), policy, "TPU state", notice)


async def state_of(pod: Pod, slices: Sequence[int] | None = None) -> str | None:
    """The TPU's state read once; ``slices``: the worst of those slices' (separate TPUs)."""
    provider = provider_for(pod.provider)
    if slices is None:
        return await provider.live_state(pod)
    from tpupod.providers.gcp import GcpProvider  # separate TPU slices only: the gcp extra
    from tpupod.providers.gcp_api import worst_state  # as above

    states = await GcpProvider().slice_states(pod)
    return worst_state([states[k] for k in slices])


async def preempted_of(pod: Pod, state: str, slices: Sequence[int] | None = None) -> str:
    """What is ``state``: ``TPU 'el-2' (slice 2)`` on a pod of separate TPU slices (the
    slices of ``slices`` in that state, or gone further, read again), else ``the TPU``."""
    if not isinstance(pod.spec, GcpPodSpec) or pod.spec.slices == 1:
        return "the TPU"
    from tpupod.providers.gcp import GcpProvider  # separate TPU slices only: the gcp extra

    try:
        states = await GcpProvider().slice_states(pod)
    except TpupodError:
        return "the TPU"  # it said the state a moment ago: which slice is a detail
    tpus = pod.spec.tpus()
    watched = range(len(states)) if slices is None else slices
    hit = [k for k in watched if states[k] == state]
    hit = hit or [k for k in watched if states[k] in REPLACE_STATES]  # SUSPENDING went on
    if not hit:
        return "the TPU"
    names = ", ".join(repr(tpus[k].name) for k in hit)
    return f"TPU {names} (slice {', '.join(map(str, hit))})"


_METADATA_SCRIPT = (
    "import sys, urllib.request as u\n"
    "r = u.Request(sys.argv[1] + '/instance/preempted', headers={'Metadata-Flavor': 'Google'})\n"
    "print(u.urlopen(r, timeout=5).read().decode().strip())"
)
METADATA_READ = "python3 -c " + shlex.quote(_METADATA_SCRIPT) + " "


async def metadata_preempted(
    pod: Pod, connector: Connector, workers: Sequence[Worker] | None = None
) -> list[int]:
    """The workers whose metadata server answers ``instance/preempted`` TRUE (those that
    answer at all: a worker taken away says nothing, and that alone proves nothing)."""
    command = METADATA_READ + shlex.quote(settings.metadata_url())
    result = await execute_async(
        pod, command, workers=workers, connector=connector, timeout=METADATA_TIMEOUT_S
    )
    return [r.worker.id for r in result.workers if r.outcome is Outcome.OK and "TRUE" in r.tail]


async def reachable(
    pod: Pod,
    connector: Connector,
    timeout: float = METADATA_TIMEOUT_S,
    workers: Sequence[Worker] | None = None,
) -> list[int]:
    """The workers (of ``workers``: all) that do not answer a plain command in ``timeout``."""
    result = await execute_async(pod, "true", workers=workers, connector=connector, timeout=timeout)
    return [r.worker.id for r in result.workers if r.outcome is not Outcome.OK]


async def wait_reachable(
    pod: Pod,
    connector: Connector,
    policy: RetryPolicy,
    notice: NoticeHandler,
    workers: Sequence[Worker] | None = None,
) -> list[int]:
    """Probe the workers (``workers``: all) with backoff for the budget; those still silent
    at its end."""
    started = time.monotonic()
    silent = await reachable(pod, connector, workers=workers)
    tries = 1
    while silent and (delay := another_try(policy, tries, started)) is not None:
        names = ", ".join(f"w{w}" for w in silent)
        notice(f"{names} not answering; probing again in {delay:.1f}s")
        await asyncio.sleep(delay)
        # the last probe ends with the budget, not a probe's timeout past it
        left = policy.probe_s - (time.monotonic() - started)
        timeout = max(1.0, min(METADATA_TIMEOUT_S, left))
        silent = await reachable(pod, connector, timeout, workers)
        tries += 1
    return silent


async def watch(
    pod: Pod,
    interval: float,
    on_preempted: Callable[[str, str], None],
    stopped: asyncio.Event,
    slices: Sequence[int] | None = None,
) -> None:
    """Read the TPU's state every ``interval`` seconds during an attempt; tell
    ``on_preempted`` (the state, and what is in it: ``preempted_of``) once the API says it
    was preempted. A failed read is skipped."""
    while not stopped.is_set():
        try:
            await asyncio.wait_for(stopped.wait(), interval)
            return
        except TimeoutError:
            pass
        try:
            state = await state_of(pod, slices)
        except TpupodError:
            continue  # the API failed: that alone says nothing
        if state in PREEMPTED_STATES:
            on_preempted(state, await preempted_of(pod, state, slices))
            return
