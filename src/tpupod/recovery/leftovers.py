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

import shlex
from collections.abc import Sequence

from tpupod.base.plain import Plain
from tpupod.errors import TpupodError
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult, place
from tpupod.pod.record import Pod

TIMEOUT_S = 20.0

# One line per launch with processes found: "LAUNCH_ID COUNT". Each match is killed
# at once (SIGKILL): a program of an attempt that already ended has nothing to save. The
# script ends once none is left but zombies (a big process takes a moment to exit and
# free its ports), or after WAIT_S.
WAIT_S = 5
SCRIPT = """
for d in /proc/[0-9]*; do
  p=${{d#/proc/}}
  [ "$p" = "$$" ] && continue
  id=$({{ tr '\\0' '\\n' < "$d/environ"; }} 2>/dev/null | grep -m1 -xF {patterns})
  [ -n "$id" ] && kill -KILL "$p" 2>/dev/null && echo "${{id#*=}}"
done | sort | uniq -c | awk '{{print $2, $1}}'
i=0
while [ $i -lt {polls} ]; do
  alive=""
  for d in /proc/[0-9]*; do
    id=$({{ tr '\\0' '\\n' < "$d/environ"; }} 2>/dev/null | grep -m1 -xF {patterns})
    [ -z "$id" ] && continue
    state=$(sed 's/.*) //' "$d/stat" 2>/dev/null | cut -c1) && [ "$state" != Z ] && alive=1
  done
  [ -z "$alive" ] && break
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


async def stop_leftovers(pod: Pod, launch_ids: Sequence[str]) -> Stopped:
    """Kill the processes of ``launch_ids`` on every worker that answers."""
    stopped = Stopped()
    if not launch_ids:
        return stopped
    try:
        result: FanoutResult = await execute_async(
            pod, leftovers_script(launch_ids), timeout=TIMEOUT_S
        )
    except TpupodError as exc:
        stopped.failed = str(exc).splitlines()[0]
        return stopped
    for worker in result.workers:
        if not worker.ok and not worker.tail:
            why = worker.error or worker.outcome_text()
            stopped.silent[f"{worker.worker.label} ({place(worker.worker)})"] = why
        for line in worker.tail:
            launch, _, count = line.partition(" ")
            if launch in launch_ids and count.isdigit():
                stopped.found.setdefault(worker.worker.label, {})[launch] = int(count)
    return stopped
