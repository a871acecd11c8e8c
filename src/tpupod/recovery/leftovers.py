"""What earlier attempts left running on the workers, stopped before the next attempt.

A worker whose host stopped answering cannot be told to stop, and a launcher killed with
``kill -9`` stops nothing: when the host's network comes back (or ``run --resume`` goes
on), the earlier attempt's program may still run there, holding JAX's coordinator port,
the accelerator or a checkpoint's files, and the next attempt's preflight refused the
host as if the program had failed. Every process of an attempt carries its launch's
``TPUPOD_LAUNCH_ID`` (``tpupod run`` puts it in each worker's environment; children
inherit it), so each worker kills, by ``/proc``, the processes of the run's earlier
launches: never another run's, another state directory's or a user's.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from tpupod.errors import TpupodError
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult
from tpupod.pod.record import Pod

TIMEOUT_S = 20.0  # a worker that does not answer is the next launch's to report

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


async def stop_leftovers(pod: Pod, launch_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Kill the processes of ``launch_ids`` on every worker that answers: for each worker
    label where some were found, launch id -> how many."""
    if not launch_ids:
        return {}
    try:
        result: FanoutResult = await execute_async(
            pod, leftovers_script(launch_ids), timeout=TIMEOUT_S
        )
    except TpupodError:
        return {}  # the next launch's preflight names what does not answer
    found: dict[str, dict[str, int]] = {}
    for worker in result.workers:
        for line in worker.tail:
            launch, _, count = line.partition(" ")
            if launch in launch_ids and count.isdigit():
                found.setdefault(worker.worker.label, {})[launch] = int(count)
    return found
