"""Defaults of the worker operations, apart from the code (the CLI shows them in --help)."""

from __future__ import annotations

# setup: the locks a fresh VM's unattended-upgrades holds, and how long to wait for them.
APT_LOCKS = (
    "/var/lib/dpkg/lock",
    "/var/lib/dpkg/lock-frontend",
    "/var/lib/apt/lists/lock",
    "/var/cache/apt/archives/lock",
)
LOCK_WAIT_S = 300

# free-tpu: what a TPU holder has open, libtpu's lockfile, and how long TERM may take.
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/*")
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"
FREE_GRACE_S = 3.0
