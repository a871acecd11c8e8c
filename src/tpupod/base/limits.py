"""Raise this process's soft resource limits to what a pod of this size needs.

A 256-host pod or a 4,096-worker rendezvous needs more open files than the
usual soft limit of 1,024. The soft limit may be raised up to the hard limit
without privileges, so tpupod does that itself instead of asking the user to
run ``ulimit -n``; only when the hard limit is too low is there anything to say.
"""

from __future__ import annotations

import resource

MARGIN = 64  # files the process needs besides the pod's (logs, pipes, the interpreter's)


def raise_soft_limit(kind: int, needed: int) -> str | None:
    """Raise the soft limit ``kind`` to at least ``needed`` (capped by the hard limit).

    Returns None when that is enough, else one line saying the hard limit is too low.
    """
    soft, hard = resource.getrlimit(kind)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(kind, (target, hard))
    if target >= needed:
        return None
    name = {resource.RLIMIT_NOFILE: "open files", resource.RLIMIT_NPROC: "processes"}.get(
        kind, str(kind)
    )
    return (
        f"the hard limit on {name} is {hard}, {needed} are needed: "
        f"raise it (ulimit -H, /etc/security/limits.conf or systemd LimitNOFILE/LimitNPROC)"
    )


def open_files(needed: int) -> str | None:
    """Make room for ``needed`` open files (plus a margin); None, or why that is not possible."""
    return raise_soft_limit(resource.RLIMIT_NOFILE, needed + MARGIN)
