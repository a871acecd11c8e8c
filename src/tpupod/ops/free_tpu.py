"""``free-tpu``: kill what holds the accelerator on every worker, then remove a stale libtpu lock.

libtpu lets one process per host own the TPU; a killed owner can leave
``/tmp/libtpu_lockfile`` behind. Holders are found by their open files
(``/proc/PID/fd``), shown, sent TERM, then KILL after a grace (JAX catches
TERM); the lockfile is removed only once nothing holds it, and the host is
checked again.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from tpupod.fanout.context import Interrupt
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult
from tpupod.fanout.worker import LineHandler
from tpupod.ops import defaults
from tpupod.pod.record import Pod, Worker
from tpupod.providers import Connector

DEFAULT_DEVICES = defaults.ACCELERATOR_DEVICES
DEFAULT_LOCKFILE = defaults.LIBTPU_LOCKFILE
DEFAULT_GRACE_S = defaults.FREE_GRACE_S
STILL_BUSY_EXIT = 1

SCRIPT = """set -u
lockfile={lockfile}
holders() {{
  find /proc/[0-9]*/fd -maxdepth 1 \\( {matches} \\) -printf '%h\\n' 2>/dev/null \\
    | cut -d/ -f3 | sort -un | grep -vx "$$" || true
}}
pids=$(holders)
if [ -z "$pids" ]; then
  if [ -e "$lockfile" ] && [ {dry} = 0 ]; then rm -f "$lockfile"; echo "removed a stale $lockfile"; fi
  echo "free: nothing holds the accelerator"
  exit 0
fi
ps -o pid=,user=,args= -p "$(echo $pids | tr ' ' ,)" | sed 's/^ */holder: /'
if [ {dry} = 1 ]; then echo "dry run: would kill $(echo $pids | wc -w) process(es)"; exit 0; fi
kill -TERM $pids 2>/dev/null
i=0
while [ $i -lt {polls} ]; do
  alive=""; for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
  [ -z "$alive" ] && break
  sleep 0.1; i=$((i + 1))
done
for p in $pids; do kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null && echo "killed $p with SIGKILL"; done
sleep 0.1
left=$(holders)
if [ -n "$left" ]; then
  echo "still busy: $(echo $left | tr '\\n' ' ')" >&2
  exit {busy}
fi
rm -f "$lockfile"
echo "freed: stopped $(echo $pids | wc -w) process(es), removed $lockfile"
"""


def free_tpu_script(
    devices: Sequence[str] = DEFAULT_DEVICES,
    lockfile: str = DEFAULT_LOCKFILE,
    grace: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
) -> str:
    patterns = [*devices, lockfile]
    matches = " -o ".join(f"-lname {shlex.quote(p)}" for p in patterns)
    return SCRIPT.format(
        lockfile=shlex.quote(lockfile),
        matches=matches,
        dry=int(dry_run),
        polls=max(1, int(grace * 10)),
        busy=STILL_BUSY_EXIT,
    )


async def free_tpu(
    pod: Pod,
    *,
    devices: Sequence[str] = DEFAULT_DEVICES,
    lockfile: str = DEFAULT_LOCKFILE,
    grace: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    workers: Sequence[Worker] | None = None,
    connector: Connector | None = None,
    on_line: LineHandler | None = None,
    interrupt: Interrupt | None = None,
) -> FanoutResult:
    """Free the accelerator on every selected worker; a worker still busy afterwards fails."""
    return await execute_async(
        pod,
        free_tpu_script(devices, lockfile, grace, dry_run),
        workers=workers,
        connector=connector,
        on_line=on_line,
        interrupt=interrupt,
        timeout=grace + 60,
    )
