"""``setup``: run a bootstrap script on every worker, once per script content.

Freshly booted VMs often run unattended-upgrades, holding the dpkg and apt
locks; the script waits (and says so) until they are free. A marker named
after the script's hash makes a second run with the same script a no-op.
"""

from __future__ import annotations

import asyncio
import hashlib
import shlex
from collections.abc import Sequence
from pathlib import Path

from tpupod.errors import UsageError
from tpupod.fanout.context import Interrupt
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult
from tpupod.fanout.worker import LineHandler
from tpupod.ops import defaults
from tpupod.ops.locks import WAIT_FOR_LOCKS
from tpupod.ops.transfer import put
from tpupod.pod.record import Pod, Worker
from tpupod.providers import Connector

DEFAULT_LOCKS = defaults.APT_LOCKS
DEFAULT_LOCK_WAIT_S = defaults.LOCK_WAIT_S
STATE_DIR = ".tpupod/setup"  # relative: each worker's home (SSH) or work folder (local)
LOCK_TIMEOUT_EXIT = 75  # EX_TEMPFAIL

RUN = """set -u
marker={state}/{digest}.done
if [ {force} = 0 ] && [ -f "$marker" ]; then
  echo "already set up with this script ({short}); skipping (--force runs it again)"
  exit 0
fi
{wait}
bash {state}/{digest}.sh
rc=$?
if [ $rc = 0 ]; then date -u +%FT%TZ > "$marker"; fi
exit $rc
"""


def script_digest(script: Path) -> str:
    return hashlib.sha256(script.read_bytes()).hexdigest()


async def setup(
    pod: Pod,
    script: Path,
    *,
    force: bool = False,
    lock_wait: float = DEFAULT_LOCK_WAIT_S,
    locks: Sequence[str] = DEFAULT_LOCKS,
    workers: Sequence[Worker] | None = None,
    connector: Connector | None = None,
    on_line: LineHandler | None = None,
    interrupt: Interrupt | None = None,
    timeout: float | None = None,
) -> FanoutResult:
    """Copy ``script`` to every worker and run it there, unless it already ran."""
    if not await asyncio.to_thread(script.is_file):
        raise UsageError(
            f"{script}: no such file", hint="pass the bootstrap script with --script FILE"
        )
    digest = await asyncio.to_thread(script_digest, script)
    sent = await put(pod, script, f"{STATE_DIR}/{digest}.sh", workers=workers, connector=connector)
    if not sent.ok:
        return sent
    wait = WAIT_FOR_LOCKS.format(
        locks=" ".join(shlex.quote(p) for p in locks), limit=int(lock_wait), code=LOCK_TIMEOUT_EXIT
    )
    command = RUN.format(
        state=STATE_DIR, digest=digest, short=digest[:12], force=int(force), wait=wait
    )
    return await execute_async(
        pod,
        command,
        workers=workers,
        connector=connector,
        on_line=on_line,
        interrupt=interrupt,
        timeout=timeout,
    )
