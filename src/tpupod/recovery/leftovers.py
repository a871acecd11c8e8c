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
# at once (SIGKILL): a program of an attempt that already ended has nothing to save.
SCRIPT = """
for id in {ids}; do
  n=0
  for d in /proc/[0-9]*; do
    p=${{d#/proc/}}
    [ "$p" = "$$" ] && continue
    if tr '\\0' '\\n' < "$d/environ" 2>/dev/null | grep -qxF "TPUPOD_LAUNCH_ID=$id"; then
      kill -KILL "$p" 2>/dev/null && n=$((n + 1))
    fi
  done
  [ "$n" -gt 0 ] && echo "$id $n"
done
exit 0
"""


def leftovers_script(launch_ids: Sequence[str]) -> str:
    return SCRIPT.format(ids=" ".join(shlex.quote(i) for i in launch_ids))


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
