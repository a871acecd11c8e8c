"""A simulated pod: K hosts on this machine, each a set of Linux namespaces running real sshd.

Each host has

* its own network namespace with its own address on a shared bridge
  (pod N has ``198.18.0.0/15``'s N-th /23, the range RFC 2544 sets aside
  for benchmarking: up to 500 hosts, so a 256-host pod spans two /24s),
* its own hostname (UTS namespace) and process table (PID namespace, where
  sshd is PID 1: stopping it takes the whole host down, as a crash would),
* a private writable view of ``/tmp`` and of root's home (overlays over
  this machine's), so a host sees what is there but its writes are invisible
  to the others and to this machine,
* an ``/etc/hosts`` in which every host's name resolves to its namespace
  address (``/etc/netns/NS/hosts``, which ``ip netns exec`` binds over /etc/hosts).

It needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux) and
``sshd`` (openssh-server). Everything it makes is named with a prefix and
recorded in a manifest, so :func:`cleanup_stale` removes what a crashed run
left behind, and :meth:`SimPod.stop` tears down completely even after a
failed test.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tpupod import settings
from tpupod.base import procfs

PREFIX = "tps"
STATE_ROOT = Path("/run/tpupod-sim")
SSHD = "/usr/sbin/sshd"
NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
POD_PREFIX = 23  # each simulated pod's subnet: 512 addresses
FIRST_HOST_OFFSET = 10
MAX_HOSTS = 500
READY_TIMEOUT_S = 20.0  # plus READY_PER_HOST_S a host: sshd starts slower on a busy machine
READY_PER_HOST_S = 0.25
BUILD_THREADS = 16  # hosts built at once: each is a handful of `ip` and `ssh-keygen` runs


class SimError(RuntimeError):
    """The simulated pod could not be built (missing tool, not root, ...)."""


@dataclass
class SimHost:
    index: int
    hostname: str
    address: str
    netns: str
    root: Path  # this host's files on the machine: host key, home overlay
    launcher: subprocess.Popen[bytes] | None = None

    @property
    def sshd_pid(self) -> int | None:
        """The host's PID 1 (sshd) as this machine sees it."""
        if self.launcher is None or self.launcher.poll() is not None:
            return None
        children = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children")
        try:
            pids = children.read_text().split()
        except OSError:
            return None
        return int(pids[0]) if pids else None


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run a simulated pod (empty when it can)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for tool in ("ip", "unshare", "nsenter", "ssh-keygen"):
        if shutil.which(tool) is None:
            missing.append(tool)
    if not Path(SSHD).exists():
        missing.append("sshd (apt-get install openssh-server)")
    return missing


class SimPod:
    """``with SimPod(4) as sim:`` gives four hosts reachable over SSH as root with ``sim.key``.

    ``sshd_options`` are added to (or replace) the hosts' sshd_config lines; an
    option set to None is left out, so ``{"Subsystem": None}`` makes hosts
    without SFTP, like a minimal image's or a hardened sshd.
    """

    def __init__(self, hosts: int, *, sshd_options: dict[str, str | None] | None = None) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise SimError(f"a simulated pod has 1 to {MAX_HOSTS} hosts, not {hosts}")
        missing = missing_prerequisites()
        if missing:
            raise SimError(f"cannot simulate a pod here: missing {', '.join(missing)}")
        self.count = hosts
        self.sshd_options = sshd_options or {}
        self.index = -1
        self.hosts: list[SimHost] = []
        self.dir = Path()
        self.startup_s = 0.0

    # -- life cycle ---------------------------------------------------------------------

    def __enter__(self) -> SimPod:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.index}br"

    @property
    def key(self) -> Path:
        """The private key that logs in as root on every host."""
        return self.dir / "client_key"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        """This pod's addresses (a /23 of 198.18.0.0/15, by pod index)."""
        base = int(NETWORK.network_address) + self.index * 2 ** (32 - POD_PREFIX)
        return ipaddress.IPv4Network((base, POD_PREFIX))

    @property
    def gateway(self) -> str:
        return str(self.subnet[1])

    def start(self) -> None:
        """Build and boot every host (in parallel); ``startup_s`` says how long it took."""
        started = time.monotonic()
        cleanup_stale()
        self.index, self.dir = _claim_index()
        try:
            self._write_manifest()
            self._make_keys()
            self._make_bridge()
            with ThreadPoolExecutor(min(BUILD_THREADS, self.count)) as pool:
                self.hosts = list(pool.map(self._make_host, range(self.count)))
            self._write_hosts_files()
            self._write_sshd_config()
            for host in self.hosts:
                self.start_host(host.index)
            self.wait_ready(timeout=READY_TIMEOUT_S + READY_PER_HOST_S * self.count)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def stop(self) -> None:
        """Kill every host and remove every namespace, link and file the pod made."""
        for host in self.hosts:
            self.stop_host(host.index)
        _teardown(self.index)

    # -- hosts ----------------------------------------------------------------------------

    def start_host(self, index: int) -> None:
        """Boot host ``index``: a fresh PID, UTS and mount namespace running sshd as PID 1."""
        host = self.hosts[index]
        homefs = host.root / "homefs"
        boot = "; ".join(
            [
                "set -e",
                "mkdir -p /run/sshd",
                f"hostname {host.hostname}",
                f"mount -t tmpfs tmpfs {homefs}",
                f"mkdir -p {homefs}/home {homefs}/home.work {homefs}/tmp {homefs}/tmp.work",
                f"chmod 1777 {homefs}/tmp",
                f"mount -t overlay overlay -o lowerdir={Path.home()},upperdir={homefs}/home,"
                f"workdir={homefs}/home.work {Path.home()}",
                f"mount -t overlay overlay -o lowerdir=/tmp,upperdir={homefs}/tmp,"
                f"workdir={homefs}/tmp.work /tmp",
                f"exec {SSHD} -D -e -f {self.dir / 'sshd_config'} -h {host.root / 'host_key'}",
            ]
        )
        log = open(host.root / "sshd.log", "ab")  # noqa: SIM115 (the child keeps it)
        host.launcher = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.netns,
                "unshare",
                "--uts",
                "--pid",
                "--mount",
                "--fork",
                "--mount-proc",
                "--propagation",
                "private",
                "--",
                "/bin/sh",
                "-c",
                boot,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()

    def unplug(self, index: int) -> None:
        """Make host ``index`` silent: its link goes down, so packets vanish (no reset, no error),
        as when a host's network fails. Its processes keep running."""
        _run(["ip", "-n", self.hosts[index].netns, "link", "set", "eth0", "down"])

    def plug(self, index: int) -> None:
        """Bring host ``index``'s link back after :meth:`unplug`."""
        _run(["ip", "-n", self.hosts[index].netns, "link", "set", "eth0", "up"])

    def stop_host(self, index: int) -> None:
        """Take host ``index`` down: killing its PID 1 ends every process on it."""
        host = self.hosts[index]
        if host.launcher is None:
            return
        pid = host.sshd_pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(host.launcher.pid, signal.SIGKILL)
        host.launcher.wait(timeout=10)
        host.launcher = None

    def wait_ready(
        self, indexes: list[int] | None = None, timeout: float = READY_TIMEOUT_S
    ) -> None:
        """Wait until sshd accepts connections on the given hosts (default: all)."""
        deadline = time.monotonic() + timeout
        for index in indexes if indexes is not None else range(self.count):
            host = self.hosts[index]
            while not _port_open(host.address, 22):
                if host.launcher is None or host.launcher.poll() is not None:
                    log = (host.root / "sshd.log").read_text(errors="replace")[-2000:]
                    raise SimError(f"{host.hostname}: sshd did not start:\n{log}")
                if time.monotonic() > deadline:
                    raise SimError(f"{host.hostname}: sshd not answering after {timeout:g}s")
                time.sleep(0.02)

    def run_on(
        self, index: int, command: str, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell command inside host ``index``'s namespaces (for checks, not through SSH)."""
        pid = self.hosts[index].sshd_pid
        if pid is None:
            raise SimError(f"{self.hosts[index].hostname} is down")
        return subprocess.run(
            ["nsenter", "-t", str(pid), "-n", "-m", "-u", "-p", "--", "/bin/sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def processes(self, index: int) -> list[tuple[int, str]]:
        """(pid, command line) of every process on host ``index`` but sshd's own and this check."""
        out = self.run_on(index, "ps -ww -eo pid=,args=").stdout  # -ww: whole command lines
        rows = []
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            if int(pid) != 1 and not args.startswith(("ps -ww", "/bin/sh -c ps -ww", "sshd:")):
                rows.append((int(pid), args))
        return rows

    def authorize(self, keys: str) -> None:
        """Accept more public keys for root on every host, given as GCE ``ssh-keys`` metadata
        (``user:ssh-ed25519 AAAA... comment`` lines), as a TPU VM's guest agent would."""
        lines = [line.split(":", 1)[-1].strip() for line in keys.splitlines() if line.strip()]
        with (self.dir / "authorized_keys").open("a") as f:
            f.writelines(line + "\n" for line in lines)

    def kill_all(self, index: int) -> None:
        """Kill every process on host ``index`` but its sshd (PID 1) and sshd's sessions."""
        pids = " ".join(str(pid) for pid, _ in self.processes(index))
        if pids:
            self.run_on(index, f"kill -KILL {pids} 2>/dev/null; true")

    # -- building -------------------------------------------------------------------------

    def _write_manifest(self) -> None:
        manifest = {"owner": os.getpid(), "hosts": self.count, "dir": str(self.dir)}
        (self.dir / "manifest.json").write_text(json.dumps(manifest))

    def _make_keys(self) -> None:
        _run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tpupod-sim", "-f", str(self.key)]
        )
        shutil.copy(self.key.with_suffix(".pub"), self.dir / "authorized_keys")

    def _make_bridge(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.gateway}/{POD_PREFIX}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])

    def _make_host(self, i: int) -> SimHost:
        netns = f"{PREFIX}{self.index}h{i}"
        address = str(self.subnet[FIRST_HOST_OFFSET + i])
        host = SimHost(i, f"host-{i}", address, netns, self.dir / f"host{i}")
        (host.root / "homefs").mkdir(parents=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host.root / "host_key")])
        outside, inside = f"{netns}a", f"{netns}b"
        _run(["ip", "netns", "add", netns])
        _run(["ip", "link", "add", outside, "type", "veth", "peer", "name", inside])
        _run(["ip", "link", "set", outside, "master", self.bridge, "up"])
        _run(["ip", "link", "set", inside, "netns", netns])
        ns = ["ip", "-n", netns]
        _run([*ns, "link", "set", inside, "name", "eth0"])
        _run([*ns, "addr", "add", f"{address}/{POD_PREFIX}", "dev", "eth0"])
        _run([*ns, "link", "set", "eth0", "up"])
        _run([*ns, "link", "set", "lo", "up"])
        return host

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{h.address} {h.hostname}" for h in self.hosts]
        text = "\n".join(lines) + "\n"
        for host in self.hosts:
            etc = Path("/etc/netns") / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(text)
            (etc / "hostname").write_text(host.hostname + "\n")

    def _write_sshd_config(self) -> None:
        # The hosts run on this machine: a JAX compilation cache the starting process has
        # (the test suite gives its processes one) is theirs too.
        shared = [
            f"{name}={value}"
            for name, value in settings.jax_cache_env().items()
            if not any(c.isspace() for c in value)
        ]
        options = {
            "ListenAddress": "0.0.0.0",
            "PidFile": "none",
            "PermitRootLogin": "prohibit-password",
            "PasswordAuthentication": "no",
            "KbdInteractiveAuthentication": "no",
            "AuthorizedKeysFile": str(self.dir / "authorized_keys"),
            "StrictModes": "no",
            "UsePAM": "no",
            "UseDNS": "no",
            "MaxSessions": "200",
            "MaxStartups": "200:30:400",
            "Subsystem": "sftp internal-sftp",
            # bash sources ~/.bashrc when sshd starts it with SHLVL < 2; root's runs `pyenv init`.
            "SetEnv": " ".join(["SHLVL=1", *shared]),
            "LogLevel": "ERROR",
            **self.sshd_options,
        }
        text = "".join(f"{key} {value}\n" for key, value in options.items() if value is not None)
        (self.dir / "sshd_config").write_text(text)


def _claim_index() -> tuple[int, Path]:
    """A free pod index (0-255): its state folder is created atomically."""
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    for index in range(256):
        path = STATE_ROOT / str(index)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return index, path
    raise SimError(f"no free simulated-pod index under {STATE_ROOT}")


def cleanup_stale() -> None:
    """Remove the pods whose owner process is gone (a crashed test run)."""
    if not STATE_ROOT.is_dir():
        return
    for path in STATE_ROOT.iterdir():
        try:
            owner = json.loads((path / "manifest.json").read_text())["owner"]
        except (OSError, ValueError, KeyError):
            owner = None
        if owner is None and time.time() - path.stat().st_mtime < 60:
            continue  # being created right now
        if owner is None or not procfs.alive(owner):
            _teardown(int(path.name))


def _teardown(index: int) -> None:
    if index < 0:
        return
    tag = f"{PREFIX}{index}h"
    # Every process still inside one of this pod's network namespaces.
    namespaces = _run(["ip", "netns", "list"], check=False).stdout.split()
    for netns in (n for n in namespaces if n.startswith(tag)):
        for pid in _run(["ip", "netns", "pids", netns], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run(["ip", "netns", "del", netns], check=False)
        shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
    # And anything still running from this pod's files (an sshd whose namespace is gone).
    marker = f"{STATE_ROOT / str(index)}/".encode()
    for number in procfs.pids():
        try:
            with open(f"/proc/{number}/cmdline", "rb") as f:
                if marker in f.read():
                    os.kill(number, signal.SIGKILL)
        except OSError:
            continue
    # A namespace's end frees its veth pair only once the kernel gets to it: remove our ends.
    links = _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    for name in (line.split(":")[1].strip().split("@")[0] for line in links if ":" in line):
        if name.startswith(tag):
            _run(["ip", "link", "del", name], check=False)
    _run(["ip", "link", "del", f"{PREFIX}{index}br"], check=False)
    shutil.rmtree(STATE_ROOT / str(index), ignore_errors=True)


def _port_open(address: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        try:
            sock.connect((address, port))
        except OSError:
            return False
        return True


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise SimError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc
