"""A PostgreSQL cluster of the tests' own on 127.0.0.1 (Debian's postgresql, trust auth).

One cluster serves the whole session (tests/conftest.py ``postgres_server``), each test in
a fresh database of its own (``new_database``): initdb and a start cost 2-10 s, and five
modules each started one. A test that stops or restarts the server starts its own with
``postgres_cluster()``, so no other test feels it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import require


def _pg_bin() -> Path | None:
    """Where initdb and pg_ctl are: on PATH, else Debian's newest /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
    )
    return debian[-1].parent if debian else None


def _as_postgres(argv: list[str]) -> list[str]:
    """Root may not run PostgreSQL: run it as the postgres user Debian's package made."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.getuid() == 0 else argv


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Postgres:
    """A running cluster: its URL (no database) and the pg_ctl line that controls it."""

    url: str
    pg_ctl: list[str]

    def restart(self) -> None:
        subprocess.run([*self.pg_ctl, "-m", "fast", "restart"], check=True, capture_output=True)

    def stop(self) -> None:
        subprocess.run([*self.pg_ctl, "-m", "fast", "stop"], check=True, capture_output=True)

    def start(self) -> None:
        subprocess.run([*self.pg_ctl, "start"], check=True, capture_output=True)


def new_database(server: Postgres) -> str:
    """A fresh, empty database on ``server``; its URL."""
    import psycopg

    name = f"t{os.getpid()}_{time.monotonic_ns()}"
    with psycopg.connect(f"{server.url}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server.url}/{name}"


@contextlib.contextmanager
def postgres_cluster() -> Iterator[Postgres]:
    """Start a cluster of our own (initdb, pg_ctl start); stop and remove it afterwards."""
    bindir = _pg_bin()
    require(bindir is not None, "PostgreSQL is not installed (apt-get install postgresql)")
    assert bindir is not None
    data = Path(tempfile.mkdtemp(prefix="tpupod-pg-"))
    if os.getuid() == 0:
        shutil.chown(data, "postgres", "postgres")
    port = _free_port()
    initdb = [str(bindir / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "postgres"]
    subprocess.run(_as_postgres(initdb), check=True, capture_output=True)
    options = f"-h 127.0.0.1 -p {port} -k {data} -c fsync=off -c max_connections=100"
    pg_ctl = _as_postgres(
        [
            str(bindir / "pg_ctl"),
            "-D",
            str(data / "db"),
            "-o",
            options,
            "-w",
            "-l",
            str(data / "log"),
        ]
    )
    subprocess.run([*pg_ctl, "start"], check=True, capture_output=True)
    try:
        yield Postgres(f"postgresql://postgres@127.0.0.1:{port}", pg_ctl)
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


class LostCommitAnswer:
    """A TCP proxy in front of a PostgreSQL server that loses the answer to one COMMIT: it
    forwards the first COMMIT of a transaction that added a job, lets the server commit it,
    and closes the client's connection before the answer comes back (the commit happened;
    the client cannot tell). Every other connection and message goes through as is."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = int(self.listener.getsockname()[1])
        self.armed = True
        self.cut = 0  # connections closed after their COMMIT
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database_url: str) -> str:
        """``database_url`` (on the server) through this proxy."""
        return database_url.replace(f":{self.target}/", f":{self.port}/")

    def close(self) -> None:
        self.listener.close()
        for sock in self.open:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.open += [client, server]
            lost = threading.Event()  # the server's answers stop reaching the client
            threading.Thread(target=self._up, args=(client, server, lost), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, lost), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, lost: threading.Event) -> None:
        added = False  # this connection sent the INSERT of a job
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                added = added or b"INSERT INTO tpupod_jobs" in data
                if self.armed and added and b"COMMIT" in data:
                    self.armed = False
                    lost.set()
                    server.sendall(data)
                    time.sleep(0.5)  # the server commits and answers; the answer is dropped
                    self.cut += 1
                    client.shutdown(socket.SHUT_RDWR)
                    server.shutdown(socket.SHUT_RDWR)
                    return
                server.sendall(data)

    def _down(self, server: socket.socket, client: socket.socket, lost: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if lost.is_set():
                    return
                client.sendall(data)
