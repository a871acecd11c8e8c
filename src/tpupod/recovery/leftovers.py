"""What earlier attempts left running on the workers, stopped before the next attempt.

A worker whose host stopped answering cannot be told to stop, and a launcher killed with
``kill -9`` stops nothing: when the host's network comes back (or ``run --resume`` goes
on), the earlier attempt's program may still run there, holding JAX's coordinator port,
the accelerator or a checkpoint's files, and the next attempt's preflight refused the
host as if the program had failed. Every process of an attempt carries its launch's
``TPUPOD_LAUNCH_ID`` (``tpupod run`` puts it in each worker's environment; children
inherit it), so each worker kills, by ``/proc``, the processes of the run's earlier
launches: never another run's, another state directory's or a user's. A worker that does
not answer is named at once (a resumed launcher that waited on it silently left a cut link
unnamed until it was back); what it runs is stopped before a later attempt, once it answers.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Sequence

from tpupod.base.plain import Plain
from tpupod.errors import TpupodError
from tpupod.fanout.context import NoticeHandler
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult, place
from tpupod.pod.record import Pod, Worker

TIMEOUT_S = 20.0
SLOW_S = 3.0  # a worker that has said nothing this long is named (the stop goes on)

# One line per launch and worker with processes found: "LAUNCH_ID WORKER_ID COUNT" (the
# worker's id from the process's TPUPOD_WORKER_ID, "-" without one). Each match is killed
# at once (SIGKILL): a program of an attempt that already ended has nothing to save. The
# script ends once none is left but zombies (a big process takes a moment to exit and
# free its ports; a zombie's environ reads empty), or after WAIT_S. One grep reads every
# process's environment: a tr and a grep for each process took 4 s on a local pod of 2
# workers on a busy machine, before every retry.
WAIT_S = 5
SCRIPT = """
echo started
found() {{
  grep -a -z -x -H -o -F {patterns} /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' |
    sed -n 's|^/proc/\\([0-9]*\\)/environ:TPUPOD_LAUNCH_ID=|\\1 |p'
}}
found | while read -r p id; do
  [ "$p" = "$$" ] && continue
  w=$(tr '\\0' '\\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^TPUPOD_WORKER_ID=//p')
  kill -KILL "$p" 2>/dev/null && echo "$id ${{w:--}}"
done | sort | uniq -c | awk '{{print $2, $3, $1}}'
i=0
while [ $i -lt {polls} ] && [ -n "$(found)" ]; do
  sleep 0.1; i=$((i + 1))
done
exit 0
"""


def leftovers_script(launch_ids: Sequence[str]) -> str:
    patterns = " ".join(f"-e {shlex.quote('TPUPOD_LAUNCH_ID=' + i)}" for i in launch_ids)
    return SCRIPT.format(patterns=patterns, polls=WAIT_S * 10)


class Stopped(Plain):
    """What :func:`stop_leftovers` did: ``found``, for each worker label where processes
    were found, launch id -> how many killed; ``silent``, each worker that did not answer
    (``w0 (host-0)``) -> why; ``failed``, why the whole stop could not be tried."""

    __slots__ = ("failed", "found", "silent")

    def __init__(self) -> None:
        self.found: dict[str, dict[str, int]] = {}
        self.silent: dict[str, str] = {}
        self.failed = ""


async def stop_leftovers(
    pod: Pod,
    launch_ids: Sequence[str],
    workers: Sequence[Worker] | None = None,
    notice: NoticeHandler | None = None,
) -> Stopped:
    """Kill the processes of ``launch_ids`` on every worker (of ``workers``: all) that
    answers. Workers that have said nothing after ``SLOW_S`` are told to ``notice``: a
    connection's retries (11 s), or the holder's connection from before a cut link (until
    the link is back), left a resumed run silent about the cut."""
    stopped = Stopped()
    if not launch_ids:
        return stopped
    # a local pod's workers are this machine's processes: one of them looks for all
    where = list(pod.workers[:1] if pod.provider == "local" else workers or pod.workers)
    heard: set[int] = set()
    stop = execute_async(
        pod,
        leftovers_script(launch_ids),
        workers=where,
        timeout=TIMEOUT_S,
        on_line=lambda worker, _: heard.add(worker.id),
    )
    task = asyncio.ensure_future(stop)
    done, _ = await asyncio.wait({task}, timeout=SLOW_S)
    quiet = [w for w in where if w.id not in heard]
    if not done and quiet and notice is not None:
        names = ", ".join(f"{w.label} ({place(w)})" for w in quiet)
        notice(
            f"{names} not answering after {SLOW_S:g} s (a cut link? a host down?): "
            f"waiting up to {TIMEOUT_S:g} s to stop what earlier attempts left there"
        )
    try:
        result: FanoutResult = await task
    except TpupodError as exc:
        stopped.failed = str(exc).splitlines()[0]
        return stopped
    labels = {str(w.id): w.label for w in pod.workers}
    for worker in result.workers:
        if not worker.ok and not worker.tail:
            why = worker.error or worker.outcome_text()
            stopped.silent[f"{worker.worker.label} ({place(worker.worker)})"] = why
        for line in worker.tail:
            launch, whose, count = [*line.split(" "), "", ""][:3]
            if launch in launch_ids and count.isdigit():
                label = labels.get(whose, worker.worker.label)
                found = stopped.found.setdefault(label, {})
                found[launch] = found.get(launch, 0) + int(count)
    return stopped
