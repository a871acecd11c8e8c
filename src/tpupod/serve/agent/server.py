"""The worker agent (``tpupod agent``): runs a worker's model servers and keeps them running.

FastAPI + uvicorn, one per worker, started detached by ``tpupod serve up``
(see ``ctl.py``). Every endpoint but ``/health`` needs the bearer token from
``agent.token`` in the state folder::

    GET  /health          {"ok": true, "servers": N}
    GET  /admin/status    every managed server: name, backend, ports, pid, state, restarts, ...
    POST /admin/start     a ServerSpec (JSON); replaces a server of the same name; a new log
    POST /admin/stop      {"name": NAME} or {} for all: TERM, then KILL
    POST /admin/restart   {"name": NAME} or {} for all; the log goes on
    GET  /admin/logs      ?name=NAME&lines=N: the last lines of a server's log

SIGTERM stops every server, then the agent. The servers are recorded in
``servers.json`` (each one's spec, process group, start and restarts), so ``serve down``
can still kill them when the agent itself was killed with -9, and the agent its keeper
(``respawn``) starts again takes over those that still run and starts again those that
ended meanwhile (``Agent.take_over``): the servers serve on through an agent's kill.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel

from tpupod.base import files, procfs
from tpupod.base.files import write_atomic
from tpupod.serve import defaults, services
from tpupod.serve.agent.supervisor import ManagedServer, tail
from tpupod.serve.backends import ServerSpec


class NameRequest(BaseModel):
    name: str | None = None


class Agent:
    """The servers of one worker, by name."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.servers: dict[str, ManagedServer] = {}
        self.base_env = dict(os.environ)

    def record_groups(self) -> None:
        """``servers.json``: the live groups (for ctl's stop), and what the next agent
        needs to take each server over (``take_over``)."""

        def write() -> None:  # what is current when it fits (a full disk: later)
            now = list(self.servers.values())
            groups = [s.pid for s in now if s.pid is not None]
            record = {"groups": groups, "servers": [_recorded(s) for s in now]}
            write_atomic(self.state / "servers.json", json.dumps(record) + "\n")

        services.when_room(write, "servers.json")

    def take_over(self) -> None:
        """The servers the agent before this one left (killed: its keeper started this one):
        each that still runs is supervised again as it is, each that ended meanwhile is
        started again (one more restart); a group on file with no spec (an older agent's)
        is killed, as nothing could restart it."""
        try:
            recorded = json.loads((self.state / "servers.json").read_text())
        except (OSError, ValueError):
            return
        kept: set[int] = set()
        for entry in recorded.get("servers", []):
            server = ManagedServer(
                ServerSpec.model_validate(entry["spec"]), self.state / "logs", self.base_env,
                self.record_groups,
            )  # fmt: skip
            server.restarts, server.user_restarts = entry["restarts"], entry["user_restarts"]
            self.servers[server.spec.name] = server
            pid = entry.get("pid")
            st = procfs.stat(pid) if pid else None
            if st is not None and st.alive and st.pgrp == pid and st.started == entry["ticks"]:
                kept.add(pid)
                server.take_over(pid, entry["started_at"], entry.get("state") == "ready")
            else:
                server.start_lost()
        for pgid in set(recorded.get("groups", [])) - kept:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self.record_groups()

    async def start(self, spec: ServerSpec, fresh: bool = True) -> ManagedServer:
        """Start (or replace) a server; ``fresh``: a new log, as a new fleet's server has."""
        old = self.servers.pop(spec.name, None)
        if old is not None:
            await old.stop()
        server = ManagedServer(spec, self.state / "logs", self.base_env, self.record_groups)
        self.servers[spec.name] = server
        server.start(fresh)
        return server

    def pick(self, name: str | None) -> list[ManagedServer]:
        if name is None:
            return list(self.servers.values())
        if name not in self.servers:
            raise HTTPException(404, f"no server named {name!r}")
        return [self.servers[name]]

    async def stop(self, name: str | None) -> list[str]:
        chosen = self.pick(name)
        await asyncio.gather(*(s.stop() for s in chosen))
        for s in chosen:
            self.servers.pop(s.spec.name, None)
        self.record_groups()
        return [s.spec.name for s in chosen]

    async def restart(self, name: str | None) -> list[str]:
        chosen = self.pick(name)
        for s in chosen:
            restarted = await self.start(s.spec, fresh=False)
            # a restart asked for is no crash: ``restarts`` counts the agent's own, after exits
            restarted.restarts = s.restarts
            restarted.user_restarts = s.user_restarts + 1
        self.record_groups()
        return [s.spec.name for s in chosen]


def _recorded(server: ManagedServer) -> dict[str, Any]:
    """A server as ``servers.json`` keeps it: its process with its start time (``ticks``:
    a pid reused by another process is not it)."""
    st = procfs.stat(server.pid) if server.pid is not None else None
    return {
        "spec": server.spec.model_dump(mode="json"),
        "pid": server.pid if st is not None else None,
        "ticks": st.started if st is not None else None,
        "started_at": server.started_at,
        "state": server.state.value,
        "restarts": server.restarts,
        "user_restarts": server.user_restarts,
    }


def make_app(state: Path, token: str) -> FastAPI:
    agent = Agent(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        agent.take_over()  # before it records itself: ctl's ensure returns after this
        yield
        await agent.stop(None)

    app = FastAPI(title="tpupod agent", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.agent = agent

    def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "a bearer token is required", {"WWW-Authenticate": "Bearer"})

    auth = [Depends(authorized)]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "servers": len(agent.servers)}

    @app.get("/admin/status", dependencies=auth)
    async def status() -> dict[str, Any]:
        servers = [s.status() for s in agent.servers.values()]
        # started again by its keeper after it died, since serve up started it
        return {
            "pid": os.getpid(),
            "servers": servers,
            "restarts": services.restarts(state, "agent"),
            # its logs and records cannot be written: said here at once (the log cannot
            # say it, and a server that writes nothing would not notice for a while)
            "disk_full": str(state) if files.full(state) else None,
        }

    @app.post("/admin/start", dependencies=auth)
    async def start(spec: ServerSpec) -> dict[str, Any]:
        server = await agent.start(spec)
        return server.status()

    @app.post("/admin/stop", dependencies=auth)
    async def stop(request: NameRequest) -> dict[str, Any]:
        return {"stopped": await agent.stop(request.name)}

    @app.post("/admin/restart", dependencies=auth)
    async def restart(request: NameRequest) -> dict[str, Any]:
        return {"restarted": await agent.restart(request.name)}

    @app.get("/admin/logs", dependencies=auth)
    async def logs(name: str | None = None, lines: int = 100) -> dict[str, Any]:
        return {s.spec.name: tail(s.log_path, lines) for s in agent.pick(name)}

    return app


def serve(state: Path, host: str, port: int) -> None:
    """Listen on ``host:port`` (0: any free port), record it, serve until SIGTERM."""
    token = services.token(state, "agent")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # a line (and a hint) for `serve up` to show, not a traceback
        said = f"the agent cannot listen on {host}:{port}: {e.strerror}"
        if e.errno == errno.EADDRINUSE:
            said += f"\nhint: another process on this worker holds port {port}; stop it"
        raise SystemExit(said) from None
    sock.listen(128)
    config = uvicorn.Config(make_app(state, token), log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    async def run() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        # uvicorn has no "started" event to wait on
        while not server.started and not serving.done():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if server.started:
            record = partial(services.write_info, state, "agent", host, sock.getsockname()[1])
            services.when_room(record, "agent.json")
        await serving

    try:
        asyncio.run(run())
    finally:
        services.remove_info(state, "agent")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tpupod.serve.agent")
    parser.add_argument("--state-dir", default=services.STATE_DIR)
    parser.add_argument("--host", default="127.0.0.1", help="the worker's internal address")
    parser.add_argument("--port", type=int, default=defaults.AGENT_PORT, help="0: any free port")
    args = parser.parse_args(argv)
    serve(Path(args.state_dir).expanduser().absolute(), args.host, args.port)
