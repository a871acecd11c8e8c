"""The connection holder: one process per SSH pod that keeps its connections open between
CLI calls, as OpenSSH's ControlMaster does for one host.

A fresh ``tpupod exec`` would otherwise pay for importing asyncssh and for an
SSH handshake with every host on every call. Instead the CLI hands the
command to the pod's holder over a Unix socket (in a 0700 folder of this
user's) and prints what comes back; the holder starts on first use and exits
after ``TPUPOD_HOLDER_IDLE`` seconds without a request (default 600), when
the pod is taken down, or when its record changes.

Wire format: one JSON object per line. The client sends one request
(``{"op": "exec", ...}``, ``ping`` or ``stop``) and, while it runs,
``{"op": "interrupt", "signal": N}``; the holder streams ``line`` and
``notice`` events and ends with ``result`` (or ``error``). A client that goes
away mid-run counts as an interrupt, so nothing is left running on the hosts.

Design notes: docs/ssh.md.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tpupod import settings
from tpupod.errors import StateError


def socket_dir() -> Path:
    """A folder only this user can enter; sockets live here, not in the (maybe long) state path."""
    path = settings.runtime_dir()
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise StateError(
            f"{path} is not private to this user",
            hint="remove it or fix its owner and mode (0700); tpupod keeps its sockets there",
        )
    return path


def socket_path(pod_dir: Path) -> Path:
    """The holder socket of the pod whose state folder is ``pod_dir`` (short, whatever the path)."""
    digest = hashlib.sha256(str(pod_dir.resolve()).encode()).hexdigest()[:24]
    return socket_dir() / f"{digest}.sock"
