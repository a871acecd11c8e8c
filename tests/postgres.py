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
