"""Commands over SSH (asyncssh): one persistent connection per host, many channels on it.

With tarstream.py (files as a tar stream), the only module that uses asyncssh (imported
by sshlib.py, without cryptography's DSA warning).

Every remote command is wrapped so that

* it runs in a process group of its own (sshd's session, else ``setsid``),
  whose id it reports first on stderr, so ``kill`` can TERM and then KILL the
  whole group with a second channel, whatever the command started;
* the worker's environment is exported in the command itself, so nothing
  depends on the server's ``AcceptEnv``;
* a command killed by a signal is reported as killed by that signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import getpass
import math
import os
import posixpath
import random
import shlex
import signal as _signal
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from tpupod.base.files import file_over_folder, put_target, remove_path, replace, staging_name
from tpupod.errors import WorkerError
from tpupod.pod.choices import HostKeyPolicy
from tpupod.pod.record import Worker
from tpupod.pod.spec import SshHost
from tpupod.transport import tarstream
from tpupod.transport.base import (
    BEGIN_MARK,
    ExitStatus,
    OutputLine,
    Stream,
    command_script,
    for_login_shell,
)
from tpupod.transport.lines import LineSplitter
from tpupod.transport.sshlib import asyncssh

PGID_MARKER = b"\x1etpupod-pgid "
PGID_TEXT = PGID_MARKER.decode()
PROBE_MARK = "tpupod-probe"
PROBE = f'echo {PROBE_MARK}; hostname; echo "$SHELL"'  # the same in bash, zsh, fish, csh
HELD_LINES = 200  # the login's lines kept, in case the command never begins (they say why)
QUEUE_HIGH = 1024
KILL_POLL_S = 0.05
KILL_ANSWER_S = 1.0  # a kill that gets no answer within this (and its grace) is given up
# curve25519 first: OpenSSH 9.2's default post-quantum exchange costs ~60 ms of CPU per
# connection on a small host, curve25519 ~9 ms. The rest of asyncssh's defaults follow.
PREFERRED_KEX = ("curve25519-sha256", "curve25519-sha256@libssh.org")
# AES-GCM first: asyncssh's chacha20-poly1305 builds two cipher contexts per packet in
# Python; AES-GCM is one call into OpenSSL (AES-NI). Measured: see BENCHMARKS.md.
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
RETRY_BASE_S = 0.25
RETRY_CAP_S = 5.0


@dataclass(frozen=True)
class ConnectOptions:
    """How to reach a pod's hosts; from the SSH pod spec."""

    user: str | None = None
    key: str | None = None
    host_keys: HostKeyPolicy = HostKeyPolicy.TOFU
    known_hosts: Path | None = None
    concurrency: int = 64
    stagger_s: float = 0.002
    timeout_s: float = 5.0  # to connect, and for a host to answer a new command
    keepalive_s: float = 5.0  # a silent connection is dropped after keepalive_s * keepalive_count
    keepalive_count: int = 3
    retries: int = 3


class KnownHosts:
    """Host keys remembered per pod, in OpenSSH's known_hosts format."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    @staticmethod
    def pattern(host: str, port: int) -> str:
        return host if port == 22 else f"[{host}]:{port}"

    def lookup(self, host: str, port: int) -> list[asyncssh.SSHKey]:
        if self.path is None or not self.path.exists():
            return []
        wanted = self.pattern(host, port)
        keys = []
        for line in self.path.read_text().splitlines():
            names, _, key = line.partition(" ")
            if wanted in names.split(","):
                keys.append(asyncssh.import_public_key(key))
        return keys

    def remember(self, host: str, port: int, key: asyncssh.SSHKey) -> None:
        if self.path is None:
            return
        line = f"{self.pattern(host, port)} {key.export_public_key().decode().strip()}\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line)


class SshPool:
    """Connections to a pod's hosts, opened on first use, concurrently, and kept open."""

    def __init__(self, options: ConnectOptions) -> None:
        self.options = options
        self.known_hosts = KnownHosts(options.known_hosts)
        self._conns: dict[SshHost, asyncssh.SSHClientConnection] = {}
        self._locks: dict[SshHost, asyncio.Lock] = {}
        self._slots: asyncio.Semaphore | None = None
        self._next_start = 0.0

    async def connection(
        self, target: SshHost, worker: int | None = None
    ) -> asyncssh.SSHClientConnection:
        lock = self._locks.setdefault(target, asyncio.Lock())
        async with lock:
            conn = self._conns.get(target)
            if conn is None or conn.is_closed():
                conn = await self._connect_with_retries(target, worker)
                self._conns[target] = conn
            return conn

    def drop(self, target: SshHost) -> None:
        """Forget a connection that failed, so the next use reconnects."""
        conn = self._conns.pop(target, None)
        if conn is not None:
            conn.abort()

    async def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        await asyncio.gather(*(c.wait_closed() for c in conns), return_exceptions=True)

    async def _connect_with_retries(
        self, target: SshHost, worker: int | None
    ) -> asyncssh.SSHClientConnection:
        attempts = self.options.retries + 1
        for attempt in range(attempts):
            try:
                return await self._connect_once(target)
            except (OSError, TimeoutError, asyncssh.ConnectionLost, asyncssh.ProtocolError) as exc:
                # A refusal or reset is often a host still booting: worth another try. Silence
                # for timeout_s is not: a host whose network is gone stays silent.
                if attempt + 1 == attempts or isinstance(exc, TimeoutError):
                    attempts = attempt + 1
                    raise _unreachable(target, worker, exc, attempts, self.options) from exc
                delay = min(RETRY_CAP_S, RETRY_BASE_S * 2**attempt)
                await asyncio.sleep(delay * (0.5 + random.random()))
            except asyncssh.HostKeyNotVerifiable as exc:
                raise self._host_key_error(target, worker) from exc
            except asyncssh.PermissionDenied as exc:
                raise _failure(
                    target,
                    worker,
                    "permission denied (publickey)",
                    hint="check --user and --key (or your ssh-agent); "
                    "tpupod never asks for a password",
                ) from exc
            except asyncssh.Error as exc:
                raise _failure(target, worker, exc.reason) from exc
        raise AssertionError("unreachable")

    async def _connect_once(self, target: SshHost) -> asyncssh.SSHClientConnection:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.options.concurrency)
        async with self._slots:
            await self._stagger()
            trusted = self.known_hosts.lookup(target.host, target.port)
            policy = self.options.host_keys
            if policy is HostKeyPolicy.STRICT and not trusted:
                raise asyncssh.HostKeyNotVerifiable("no remembered host key")
            check: tuple[list[asyncssh.SSHKey], list[asyncssh.SSHKey], list[asyncssh.SSHKey]] | None
            check = None if policy is HostKeyPolicy.INSECURE or not trusted else (trusted, [], [])
            conn = await asyncio.wait_for(
                asyncssh.connect(
                    target.host,
                    target.port,
                    username=target.user or self.options.user or _local_user(),
                    client_keys=[self.options.key] if self.options.key else (),
                    known_hosts=check,
                    config=None,
                    password=None,
                    kbdint_auth=False,
                    kex_algs=_preferring(PREFERRED_KEX, "kex"),
                    encryption_algs=_preferring(PREFERRED_CIPHERS, "encryption"),
                    keepalive_interval=self.options.keepalive_s or None,
                    keepalive_count_max=self.options.keepalive_count,
                ),
                self.options.timeout_s,
            )
            if policy is HostKeyPolicy.TOFU and not trusted:
                key = conn.get_server_host_key()
                if key is not None:
                    self.known_hosts.remember(target.host, target.port, key)
            return conn

    async def _stagger(self) -> None:
        """Space connection starts ``stagger_s`` apart: hosts and agent are not hit at once."""
        now = time.monotonic()
        start = max(now, self._next_start)
        self._next_start = start + self.options.stagger_s
        if start > now:
            await asyncio.sleep(start - now)

    def _host_key_error(self, target: SshHost, worker: int | None) -> WorkerError:
        where = self.known_hosts.path or "the pod's known_hosts"
        if self.options.host_keys is HostKeyPolicy.STRICT and not self.known_hosts.lookup(
            target.host, target.port
        ):
            return _failure(
                target,
                worker,
                "no remembered host key and host keys are strict",
                hint="connect once with host_keys: tofu, or add the key to " + str(where),
            )
        return _failure(
            target,
            worker,
            "the host key has CHANGED since it was remembered",
            hint=f"if the host was recreated, delete its line from {where}; "
            "for a throwaway pod, set host_keys: insecure",
        )


class SshTransport:
    """The way to one worker over a pool's connection."""

    def __init__(self, worker: Worker, pool: SshPool) -> None:
        assert worker.ssh is not None, "an SSH worker records its login target"
        self.worker = worker
        self.target = worker.ssh
        self.pool = pool

    def remote(self, script: str) -> str:
        """``script`` as this worker's login shell must be given it (bash runs it)."""
        return for_login_shell(script, self.worker.login_shell)

    async def start(
        self, command: str, env: Mapping[str, str], *, guard: bool = False
    ) -> SshProcess:
        conn = await self.pool.connection(self.target, self.worker.id)
        answer_s = self.pool.options.timeout_s
        try:
            # A connection kept open may lead to a host that has since gone silent: a command
            # that is not running within the connect timeout counts as unreachable.
            async with asyncio.timeout(answer_s):
                chan, session = await conn.create_session(
                    _CommandSession,
                    self.remote(
                        wrap_command(command_script(command, guard=guard), env, self.worker.workdir)
                    ),
                    encoding=None,
                )
                if not guard:
                    chan.write_eof()  # no input: a command that reads stdin sees its end
                pgid = await cast(_CommandSession, session).group
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            self.pool.drop(self.target)
            why = f"no answer in {answer_s:g}s" if isinstance(exc, TimeoutError) else _reason(exc)
            raise _failure(
                self.target,
                self.worker.id,
                f"cannot start the command: {why}",
                hint="check that the host is up ('tpupod status')",
                unreachable=True,
            ) from exc
        return SshProcess(self, cast(_CommandSession, session), conn, pgid)

    async def forward(
        self, local_port: int, remote_host: str, remote_port: int
    ) -> tuple[asyncssh.SSHListener, asyncssh.SSHClientConnection]:
        """Listen on 127.0.0.1:``local_port`` (0: any) here; each connection to it goes over
        this worker's SSH connection to ``remote_host:remote_port`` as seen from the worker.
        Returns the listener and the connection it lives on (it ends with that connection)."""
        conn = await self.pool.connection(self.target, self.worker.id)
        try:
            listener = await conn.forward_local_port(
                "127.0.0.1", local_port, remote_host, remote_port
            )
        except (asyncssh.Error, OSError) as exc:
            raise _failure(
                self.target,
                self.worker.id,
                f"cannot forward 127.0.0.1:{local_port} to {remote_host}:{remote_port}: "
                f"{_reason(exc)}",
                hint="another program may hold that local port",
                unreachable=False,
            ) from exc
        return listener, conn

    async def put(self, local: Path, remote: str) -> None:
        target = _sftp_path(put_target(local, remote))
        staged = staging_name(target)
        conn = await self.pool.connection(self.target, self.worker.id)
        sftp: asyncssh.SFTPClient | None = None
        try:
            folder = await asyncio.to_thread(local.is_dir)
            if (
                folder
                and conn not in _NO_TAR
                and await _by_tar(conn, tarstream.put(conn, local, target, staged, self.remote))
            ):
                return
            sftp = await _open_sftp(conn)
            if sftp is None:
                await tarstream.put(conn, local, target, staged, self.remote)
                return
            async with sftp:
                parent = posixpath.dirname(target)
                if parent:
                    await sftp.makedirs(parent, exist_ok=True)
                await sftp.put(str(local), staged, preserve=True, recurse=True)
                if await sftp.isdir(target):
                    if not folder:
                        await sftp.remove(staged)
                        reason, hint = file_over_folder(local, target)
                        raise _failure(self.target, self.worker.id, reason, hint=hint)
                    old = staging_name(target)
                    await sftp.rename(target, old)
                    await sftp.rename(staged, target)
                    await sftp.rmtree(old)
                else:
                    await sftp.posix_rename(staged, target)
        except tarstream.TarStreamError as exc:
            raise self._tar_error(f"put {local} -> {target}", exc) from exc
        except (asyncssh.Error, OSError) as exc:
            cleanup = (
                f"rm -rf -- {shlex.quote(staged)}"
                if sftp is not None
                else tarstream.cleanup_command(staged)
            )
            with contextlib.suppress(asyncssh.Error, OSError):
                await conn.run(self.remote(cleanup), check=False)
            raise _failure(
                self.target, self.worker.id, f"put {local} -> {target}: {_reason(exc)}"
            ) from exc

    async def get(self, remote: str, local: Path) -> None:
        path = _sftp_path(remote)
        staged = Path(staging_name(local))
        local.parent.mkdir(parents=True, exist_ok=True)
        conn = await self.pool.connection(self.target, self.worker.id)
        try:
            sftp = await _open_sftp(conn)
            if sftp is None:
                await tarstream.get(conn, path, staged, self.remote)
            else:
                async with sftp:
                    folder = conn not in _NO_TAR and await sftp.isdir(path)
                    if not folder or not await _by_tar(
                        conn, tarstream.get(conn, path, staged, self.remote)
                    ):
                        await sftp.get(path, str(staged), preserve=True, recurse=True)
            await asyncio.to_thread(replace, staged, local)
        except tarstream.TarStreamError as exc:
            raise self._tar_error(f"get {remote}", exc) from exc
        except (asyncssh.Error, OSError) as exc:
            raise _failure(self.target, self.worker.id, f"get {remote}: {_reason(exc)}") from exc
        finally:
            await asyncio.to_thread(remove_path, staged)

    def _tar_error(self, what: str, exc: tarstream.TarStreamError) -> WorkerError:
        """One line; a tar that is missing too is only reported when SFTP was missing first."""
        if exc.no_tar:
            reason = f"{what}: the host has neither SFTP nor tar ({exc.hint})"
        else:
            reason = f"{what}: {exc.reason}"
        return _failure(self.target, self.worker.id, reason, hint=exc.hint)


# Transfers: folders go as a tar stream over an exec channel (1,000 small files: 4-10x faster
# than asyncssh's SFTP, which copies one file after another; see BENCHMARKS.md), single files
# over SFTP (as fast, and no shell involved). Each falls back to the other where the host
# lacks it; what a host lacks is remembered per connection, so it is asked once.
_NO_SFTP: weakref.WeakSet[asyncssh.SSHClientConnection] = weakref.WeakSet()
_NO_TAR: weakref.WeakSet[asyncssh.SSHClientConnection] = weakref.WeakSet()


async def _open_sftp(conn: asyncssh.SSHClientConnection) -> asyncssh.SFTPClient | None:
    """An SFTP session, or None when the host has no SFTP subsystem (or one a login's
    banner garbles).

    sshd without ``Subsystem sftp`` refuses the request (asyncssh: ChannelOpenError,
    "Session request failed"); one whose sftp-server is missing closes the channel
    at once (SFTPConnectionLost) while the connection lives on.
    """
    if conn in _NO_SFTP:
        return None
    try:
        return await conn.start_sftp_client()
    except asyncssh.SFTPBadMessage:
        # sshd starts an sftp-server through the login shell; a ~/.bashrc that prints
        # garbles its first packet ('Max packet size exceeded'): the tar streams, which
        # skip a login's banner, do the transfer instead
        _NO_SFTP.add(conn)
        return None
    except (asyncssh.ChannelOpenError, asyncssh.SFTPConnectionLost) as exc:
        refused = not isinstance(exc, asyncssh.ChannelOpenError) or (
            exc.code == asyncssh.OPEN_REQUEST_SESSION_FAILED
        )
        if not refused or conn.is_closed():
            raise
        _NO_SFTP.add(conn)
        return None


async def _by_tar(conn: asyncssh.SSHClientConnection, transfer: Awaitable[None]) -> bool:
    """Run a tar-stream transfer; False (and remembered) when the host has no tar."""
    try:
        await transfer
    except tarstream.TarStreamError as exc:
        if not exc.no_tar:
            raise
        _NO_TAR.add(conn)
        return False
    return True


def _sftp_path(path: str) -> str:
    """SFTP starts in the home folder and knows no ``~``."""
    return path[2:] if path.startswith("~/") else path


def generate_key(path: Path, comment: str) -> str:
    """A new ed25519 key pair at ``path`` (private, mode 0600) and ``path.pub``; the public line."""
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    path.parent.mkdir(parents=True, exist_ok=True)
    key.write_private_key(str(path))
    path.chmod(0o600)
    key.write_public_key(str(path) + ".pub")
    return key.export_public_key().decode().strip()


def public_key_line(private_key: Path) -> str:
    """The public half of an existing key (from its .pub file, else derived)."""
    pub = Path(str(private_key) + ".pub")
    if pub.is_file():
        return pub.read_text().strip()
    return asyncssh.read_private_key(str(private_key)).export_public_key().decode().strip()


class SshConnector:
    """Hands out SSH transports that share one pool of connections."""

    def __init__(self, pool: SshPool) -> None:
        self.pool = pool

    def transport(self, worker: Worker) -> SshTransport:
        return SshTransport(worker, self.pool)

    async def reachback(self, worker: Worker) -> str:
        """Our end of the SSH connection: the address the host already reaches us at."""
        assert worker.ssh is not None
        conn = await self.pool.connection(worker.ssh, worker.id)
        sockname = conn.get_extra_info("sockname")
        return str(sockname[0])

    async def close(self) -> None:
        await self.pool.close()


@dataclass(frozen=True)
class Probed:
    """What ``probe`` learns of a host."""

    hostname: str
    address: str  # the address we reached it at
    login_shell: str | None  # what its logins run (sshd's $SHELL); None if it did not say


async def probe(pool: SshPool, target: SshHost, worker: int) -> Probed:
    """Connect to a host: its hostname, the address we reached it at, and its login shell
    (a line every common shell runs the same: bash, sh, zsh, fish, csh)."""
    conn = await pool.connection(target, worker)
    try:
        result = await conn.run(PROBE, check=False, timeout=30)
    except (asyncssh.Error, OSError, TimeoutError) as exc:
        raise _failure(target, worker, f"'hostname' failed: {_reason(exc)}") from exc
    peer = conn.get_extra_info("peername")
    said = [line.strip() for line in str(result.stdout or "").splitlines()]
    said = said[said.index(PROBE_MARK) + 1 :] if PROBE_MARK in said else said  # after a banner
    hostname = said[0] if said and said[0] else target.host
    shell = said[1] if len(said) > 1 and said[1].startswith("/") else None
    return Probed(hostname, str(peer[0]) if peer else target.host, shell)


class SshProcess:
    def __init__(
        self,
        transport: SshTransport,
        session: _CommandSession,
        conn: asyncssh.SSHClientConnection,
        pgid: int | None,
    ) -> None:
        self._transport = transport
        self._session = session
        self._conn = conn
        self.pgid = pgid

    async def lines(self) -> AsyncIterator[OutputLine]:
        session = self._session
        while (line := await session.queue.get()) is not None:
            session.drained()
            yield line

    async def wait(self) -> ExitStatus:
        status = await asyncio.shield(self._session.exited)
        if status is None:
            raise _failure(
                self._transport.target,
                self._transport.worker.id,
                "connection lost while the command ran",
                hint="the host may have gone down; 'tpupod status' checks every worker",
                unreachable=True,
            )
        return status

    async def kill(self, grace: float) -> None:
        """TERM the remote process group, poll until it is empty, then KILL: one extra channel.

        Bounded: a host that does not confirm the TERM within KILL_ANSWER_S, or the
        end within ``grace`` more, is left to the caller (it went silent).
        """
        if self.pgid is None:
            self._session.close()  # no group id: closing the channel is all we can do
            return
        with contextlib.suppress(asyncssh.Error, OSError, TimeoutError):
            async with asyncio.timeout(KILL_ANSWER_S):
                killer = await self._conn.create_process(
                    self._transport.remote(kill_script(self.pgid, grace))
                )
                while (said := await killer.stdout.readline()) and said.strip() != "sent":
                    pass  # a login's banner: TERM is sent when 'sent' comes (or the end)
            async with asyncio.timeout(grace + KILL_ANSWER_S):
                await killer.wait()

    def close(self) -> None:
        self._session.close()


class _CommandSession(asyncssh.SSHClientSession[bytes]):
    """One remote command: its output as lines, its process group, its exit.

    Lines go to a queue as data arrives (reading pauses while the queue is
    full, so a flooding command waits for us); the exit status is taken when
    it arrives, not when the channel closes, which a background child of the
    command (``sleep 30 &``) can delay for its whole life.
    """

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[OutputLine | None] = asyncio.Queue()
        self.exited: asyncio.Future[ExitStatus | None] = loop.create_future()
        self.group: asyncio.Future[int | None] = loop.create_future()
        self._splitters = {Stream.STDOUT: LineSplitter(), Stream.STDERR: LineSplitter()}
        self._chan: asyncssh.SSHClientChannel[bytes] | None = None
        self._paused = False
        self._due: dict[Stream, asyncio.TimerHandle] = {}  # a held-back bar state's show
        # per stream, the lines before its marker (the login's, until the command begins)
        self._before: dict[Stream, list[str] | None] = {Stream.STDOUT: [], Stream.STDERR: []}

    def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:
        self._chan = chan

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        stream = Stream.STDERR if datatype == asyncssh.EXTENDED_DATA_STDERR else Stream.STDOUT
        lines = self._splitters[stream].feed(data)
        if self._before[stream] is not None:
            lines = self._begun(stream, lines)
        self._put(stream, lines)
        self._show_when_due(stream)
        if self.queue.qsize() > QUEUE_HIGH and self._chan is not None and not self._paused:
            self._paused = True
            self._chan.pause_reading()

    def _begun(self, stream: Stream, lines: list[str]) -> list[str]:
        """The command's lines among ``lines``: those after its marker on ``stream``. The
        lines before are the login's (a banner, a shell rc's warning) and are dropped; the
        group id comes with stderr's marker."""
        held = self._before[stream]
        assert held is not None
        marker = PGID_TEXT if stream is Stream.STDERR else BEGIN_MARK
        for i, line in enumerate(lines):
            if line.startswith(marker):
                self._before[stream] = None
                if stream is Stream.STDERR and not self.group.done():
                    self.group.set_result(int(line[len(marker) :]))
                return lines[i + 1 :]
        held.extend(lines)
        del held[:-HELD_LINES]
        return []

    def drained(self) -> None:
        if self._paused and self.queue.qsize() < QUEUE_HIGH // 2 and self._chan is not None:
            self._paused = False
            self._chan.resume_reading()

    def exit_status_received(self, status: int) -> None:
        self._exit(ExitStatus(status))

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        number = getattr(_signal, f"SIG{signal}", None)
        self._exit(ExitStatus(None, int(number)) if number is not None else ExitStatus(255))

    def _show_when_due(self, stream: Stream) -> None:
        """A bar state held back now is shown once due, unless the next data shows it."""
        wait = self._splitters[stream].due_in()
        if wait is not None and stream not in self._due:
            self._due[stream] = asyncio.get_running_loop().call_later(wait, self._show_due, stream)

    def _show_due(self, stream: Stream) -> None:
        del self._due[stream]
        lines = self._splitters[stream].due()
        if self._before[stream] is not None:  # still the login's (a bar in a start-up file)
            lines = self._begun(stream, lines)
        self._put(stream, lines)
        self._show_when_due(stream)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in self._due.values():
            timer.cancel()
        for stream, splitter in self._splitters.items():
            lines = splitter.finish()
            if self._before[stream] is not None:
                lines = self._begun(stream, lines)
            held = self._before[stream]
            if held is not None:  # it never began: what the login said is why
                lines, self._before[stream] = held, None
            self._put(stream, lines)
        self.queue.put_nowait(None)
        if not self.group.done():
            self.group.set_result(None)
        self._exit(None)

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()

    def _put(self, stream: Stream, lines: list[str]) -> None:
        for text in lines:
            self.queue.put_nowait(OutputLine(stream, text))

    def _exit(self, status: ExitStatus | None) -> None:
        if not self.exited.done():
            self.exited.set_result(status)


def wrap_command(script: str, env: Mapping[str, str], workdir: str | None) -> str:
    """The remote command line: report the process group, set the env, run ``script``.

    sshd starts each session's shell as a session and process-group leader, so
    the shell's own pid is the group id and no extra process is needed (an
    extra ``setsid`` and shell cost about 1 ms of a small host's CPU per
    command). On a server that does not, the script re-executes itself under
    ``setsid``. ``script`` is :func:`~tpupod.transport.base.command_script`'s,
    which reports a command killed by a signal as killed by that signal.
    """
    lines = [f"printf '{PGID_MARKER.decode()}%s\\n' \"$$\" >&2; printf '{BEGIN_MARK}\\n'"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    if workdir:
        lines.append(f"cd {shlex.quote(workdir)} || exit 1")
    lines.append(script)
    body = "\n".join(lines)
    return (
        "read -r _ _ _ _ tpupod_pg _ < /proc/$$/stat 2>/dev/null\n"
        f'[ "$tpupod_pg" = "$$" ] || exec setsid /bin/bash -c {shlex.quote(body)}\n'
        f"{body}"
    )


def kill_script(pgid: int, grace: float) -> str:
    """TERM the group and say so at once, poll until it is empty for ``grace`` s, then KILL."""
    polls = math.ceil(grace / KILL_POLL_S) if grace > 0 else 0
    return (
        f"kill -TERM -- -{pgid} 2>/dev/null || exit 0\n"
        "echo sent\n"
        f"i=0; while [ $i -lt {polls} ] && kill -0 -- -{pgid} 2>/dev/null; "
        f"do sleep {KILL_POLL_S}; i=$((i + 1)); done\n"
        f"kill -KILL -- -{pgid} 2>/dev/null; exit 0"
    )


def _preferring(preferred: tuple[str, ...], kind: str) -> list[str]:
    """``preferred`` first, then the rest of asyncssh's defaults for ``kind`` (kex, encryption)."""
    defaults = (
        asyncssh.kex.get_default_kex_algs()
        if kind == "kex"
        else asyncssh.encryption.get_default_encryption_algs()
    )
    rest = [alg.decode() for alg in defaults if alg.decode() not in preferred]
    return [*preferred, *rest]


def _local_user() -> str:
    return getpass.getuser()


def _who(target: SshHost, worker: int | None) -> str:
    return f"w{worker} ({target})" if worker is not None else str(target)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncssh.Error):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def _failure(
    target: SshHost,
    worker: int | None,
    reason: str,
    hint: str | None = None,
    *,
    unreachable: bool = False,
) -> WorkerError:
    return WorkerError(
        f"{_who(target, worker)}: {reason}",
        hint,
        worker=worker,
        reason=reason,
        unreachable=unreachable,
    )


def _unreachable(
    target: SshHost, worker: int | None, exc: BaseException, attempts: int, options: ConnectOptions
) -> WorkerError:
    tries = f" after {attempts} tries" if attempts > 1 else ""
    if isinstance(exc, TimeoutError):
        return _failure(
            target,
            worker,
            f"cannot connect: no answer in {options.timeout_s:g}s",
            hint="the host or its network may be down; a slow network can raise "
            "connect_timeout in the pod spec",
            unreachable=True,
        )
    return _failure(
        target,
        worker,
        f"cannot connect{tries}: {_reason(exc)}",
        hint="check that the host is up and sshd listens on that port",
        unreachable=True,
    )
