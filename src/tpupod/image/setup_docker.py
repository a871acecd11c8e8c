"""``tpupod setup --docker``: the bootstrap script that gives a worker a container engine.

It runs through ``tpupod setup`` (the apt/dpkg lock wait, once per script content),
as the login user: root, or a user with passwordless sudo as on TPU VMs. It installs
Debian's or Ubuntu's ``docker.io`` unless Docker is there, starts and enables the
daemon, and adds the login user to the ``docker`` group. That user's current sessions
do not have the group yet; tpupod does not need them to: where the socket is not
writable it runs ``sudo -n -E docker`` (``engine.py``), so no re-login is needed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tpupod.base.files import write_atomic

SCRIPT = """#!/bin/bash
# tpupod setup --docker: install and start Docker on this worker (idempotent).
set -eu
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
if ! command -v docker >/dev/null 2>&1 || ! command -v dockerd >/dev/null 2>&1; then
  echo "installing docker.io"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io
fi
if [ -d /run/systemd/system ]; then
  $SUDO systemctl enable --now docker
else
  $SUDO service docker start
fi
user=$(id -un)
if [ "$user" != root ] && ! id -nG "$user" | grep -qw docker; then
  $SUDO usermod -aG docker "$user"
  echo "added $user to the docker group (tpupod uses sudo until a new login has it)"
fi
for _ in $(seq 100); do
  if $SUDO docker info >/dev/null 2>&1; then break; fi
  sleep 0.1
done
$SUDO docker info --format 'docker {{.ServerVersion}} ready'
"""


def script_file() -> Path:
    """The script as a file for ``tpupod setup`` (its name does not matter: its hash does)."""
    path = Path(tempfile.gettempdir()) / f"tpupod-setup-docker-{os.getuid()}.sh"
    write_atomic(path, SCRIPT, mode=0o644)
    return path
