#!/usr/bin/env bash
# The Debian packages the tests and the demo need: as root, installs the missing ones
# (apt-get, only when something is missing); otherwise installs nothing and names them.
# `make test` and `make demo` run it first; .ci/run runs it when `make` itself is missing.
#
#   openssh-server, openssh-client  simulated hosts run real sshd; ssh-keygen makes their keys
#   iproute2, util-linux            network namespaces (ip), unshare, nsenter, flock, setsid
#   procps, psmisc, git, make       ps/pgrep/pkill, fuser, tpupod sync, make itself
#   python3, python3-venv           only when $PYTHON is missing or cannot make a venv
# (PostgreSQL and podman join this list with the tiers that need them.)
set -euo pipefail

packages=(make procps psmisc git iproute2 util-linux openssh-server openssh-client)
packages+=(postgresql) # tests/test_jobs.py starts its own PostgreSQL cluster on loopback
# tests/test_image.py: podman with runc (its containers.conf picks runc), catatonit for --init,
# and a busybox-static rootfs imported as the base image (no image registry is reachable)
packages+=(podman runc catatonit busybox-static)
packages+=(chromium) # tests/test_dashboard_browser.py: playwright drives this browser (no download)
packages+=(zsh fish) # tests/test_ssh_shells.py: SSH users whose login shell is not bash
# tests/test_image.py: the docker CLI against a socket nobody serves (no daemon is started)
command -v docker >/dev/null 2>&1 || packages+=(docker.io)
python=${PYTHON:-python3}
if ! command -v "$python" >/dev/null 2>&1; then
  packages+=(python3 python3-venv)
elif ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  packages+=(python3-venv) # Debian's python3 leaves ensurepip to this package
fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "test-prereqs: not a Debian system; install by hand: ${packages[*]}" >&2
  exit 0
fi

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ]; then
  echo "test-prereqs: missing Debian packages (as root, make test installs them): ${missing[*]}" >&2
  exit 0
fi

echo "test-prereqs: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
