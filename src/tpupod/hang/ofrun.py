"""``tpupod stacks``: the stacks of a running run, on the workers it ran on (as it numbered
them), digested and saved in its folder."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tpupod.errors import TpupodError, UsageError
from tpupod.fanout.report import worker_list
from tpupod.hang import digest, progress
from tpupod.hang.stacks import WorkerStacks, take
from tpupod.launch.records import RunRecord, get_run
from tpupod.pod.state import StateDir
from tpupod.providers import provider_for


def stacks_of_run(
    state: StateDir, pod_name: str, run_id: str | None, selection: str | None, native: bool
) -> tuple[list[WorkerStacks], list[str], float, Path]:
    """The stacks of a running run (the pod's latest without ``run_id``) on its selected
    workers (``selection`` as the run numbered them), their digest (groups that tie in size
    ordered by the workers' steps, where the run has heartbeats), the seconds they took,
    and where the dump was saved."""
    record = get_run(pod_name, run_id, state)
    if record.ended():
        raise UsageError(
            f"run {record.launch_id} is not running ({record.state()}): no stacks to take",
            hint="'tpupod logs --list' lists the runs; a hung run's stacks are in its folder",
        )
    found, took = asyncio.run(_take(state, pod_name, record, selection, native))
    if all(w.problem is not None for w in found):
        first = found[0]
        same = [w.worker.id for w in found if w.problem == first.problem]
        more = (
            f" ({len(found) - len(same)} more for other reasons)" if len(same) < len(found) else ""
        )
        raise TpupodError(
            f"no stacks taken: {worker_list(same)}: {first.problem}{more}",
            hint=first.hint or "check the workers and retry",
        )
    steps = {w: v.get("step") for w, v in progress.read(record.folder).items()}
    lines = digest.lines(found, lambda w: float(steps.get(w) or 0))
    return found, lines, took, digest.save(record.folder, found, lines)


async def _take(
    state: StateDir, pod_name: str, record: RunRecord, selection: str | None, native: bool
) -> tuple[list[WorkerStacks], float]:
    pod = state.load(pod_name)
    by_id = {w.id: w for w in pod.workers}
    by_host = {w.hostname: w for w in pod.workers}
    ran = [by_id[w.pod_id] if w.pod_id in by_id else by_host[w.hostname] for w in record.workers]
    run_pod = pod.subset(ran)
    connector = provider_for(pod.provider).connect(run_pod, state)
    try:
        return await take(
            run_pod, record.launch_id, run_pod.select(selection), connector=connector, native=native
        )
    finally:
        await connector.close()
