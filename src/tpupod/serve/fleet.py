"""``tpupod serve``: a fleet of model servers on a pod, one router in front.

Everything reaches the workers through the pod's transports, by running
``python -m tpupod.serve.ctl`` there (see ``ctl.py``): ensure an agent
(detached), hand it the server specs, stream readiness, then ensure the
router on worker 0, which can reach every worker's internal address. The
launcher keeps the fleet's record (model, servers, router address and token)
in ``pods/NAME/serve.json`` of the state folder, mode 0600.

Where several workers share one address (a local pod: all are 127.0.0.1),
each worker gets its own port range and its agent any free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tpupod.errors import ServeError, WorkerError
from tpupod.files import write_atomic
from tpupod.pod import Pod, Worker
from tpupod.providers import Connector, provider_for, worker_environment
from tpupod.serve import defaults
from tpupod.serve.backends import Backend, ServerSpec, plan, plan_replicas
from tpupod.serve.supervisor import unstamped
from tpupod.state import StateDir

RECORD_FILE = "serve.json"
Progress = Callable[[str], None]


class ServerRecord(BaseModel):
    worker: int
    host: str
    port: int
    name: str
    followers: list[int] = []  # a replica across workers: the other members' worker ids

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class FleetRecord(BaseModel):
    pod: str
    model: str
    backend: Backend
    python: str
    servers: list[ServerRecord]
    router_host: str
    router_port: int
    token: str
    started: float
    settings: dict[str, Any] | None = None  # serve up's options: a second one compares them

    @property
    def base_url(self) -> str:
        return f"http://{self.router_host}:{self.router_port}/v1"


@dataclass(frozen=True)
class UpOptions:
    model: str
    backend: Backend = Backend.BUILTIN
    servers_per_worker: int = 1
    base_port: int = defaults.BASE_PORT
    dtype: str | None = None
    served_model_name: str | None = None
    command: str | None = None
    extra_args: tuple[str, ...] = ()
    startup_timeout: float = 600.0
    python: str = "python3"
    devices_per_worker: int | None = None
    agent_port: int = defaults.AGENT_PORT
    router_port: int | None = None
    policy: str = defaults.POLICY
    health_interval: float = defaults.HEALTH_INTERVAL_S
    restart_backoff: float = defaults.RESTART_BACKOFF_S
    hosts_per_replica: int = 1  # >1: each run of K workers serves one replica in lockstep
    mesh: str | None = None  # model=M across a replica's devices


FLAGS = {"python": "--worker-python", "extra_args": "the arguments after --"}


def settings_of(options: UpOptions) -> dict[str, Any]:
    """What makes two fleets the same: every option but how long serve up may wait."""
    chosen = dataclasses.asdict(options)
    del chosen["startup_timeout"]
    parsed: dict[str, Any] = json.loads(json.dumps(chosen))  # as the record reads back
    return parsed


def differences(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """The options that differ, as serve up's flags: ``--servers-per-worker 2, now 1``."""
    if old is None:
        return "its settings were not recorded"
    changed = [k for k in new if old.get(k) != new[k]]
    return "; ".join(
        f"{FLAGS.get(k, '--' + k.replace('_', '-'))} {_shown(old.get(k))}, now {_shown(new[k])}"
        for k in changed
    )


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return shlex.join(str(v) for v in value) or "(none)"
    return "(default)" if value is None else str(value)


def record_path(state: StateDir, pod: str) -> Any:
    return state.pod_dir(pod) / RECORD_FILE


def load_record(state: StateDir, pod: str) -> FleetRecord:
    path = record_path(state, pod)
    try:
        return FleetRecord.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise ServeError(
            f"no fleet is serving on pod {pod!r}",
            hint=f"start one: tpupod serve up --pod {pod} --model PATH",
        ) from None
    except ValueError as exc:
        raise ServeError(f"the fleet record {path} is unreadable", hint="delete it") from exc


def save_record(state: StateDir, record: FleetRecord) -> None:
    path = record_path(state, record.pod)
    write_atomic(path, record.model_dump_json(indent=2) + "\n")
    os.chmod(path, 0o600)


class Fleet:
    """The fleet of one pod: remote ctl calls over the pod's transports."""

    def __init__(self, pod: Pod, python: str, connector: Connector | None = None) -> None:
        self.pod = pod
        self.python = python
        self.provider = provider_for(pod.provider)
        self.state = StateDir()
        self.connector = connector or self.provider.connect(pod, self.state)

    async def close(self) -> None:
        await self.connector.close()

    def shared_addresses(self) -> bool:
        return len({w.internal_address for w in self.pod.workers}) < len(self.pod.workers)

    async def ctl(
        self,
        worker: Worker,
        *args: str,
        env: dict[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Run ``python -m tpupod.serve.ctl ARGS`` on the worker; its JSON lines."""
        command = shlex.join([self.python, "-m", "tpupod.serve.ctl", *args])
        full_env = worker_environment(self.pod, worker, env, self.provider)
        transport = self.connector.transport(worker)
        proc = await transport.start(command, full_env, guard=False)
        answers: list[dict[str, Any]] = []
        other: list[str] = []
        try:
            async for line in proc.lines():
                try:
                    answer = json.loads(line.text)
                except ValueError:
                    other.append(line.text)
                    continue
                if isinstance(answer, dict):
                    answers.append(answer)
                    if on_line is not None:
                        on_line(line.text)
            status = await proc.wait()
        finally:
            proc.close()
        if not answers:
            last = other[-1] if other else status.describe()
            raise ServeError(
                f"{worker.label}: tpupod.serve.ctl gave no answer ({last})",
                hint=f"is tpupod installed for {self.python} on the worker? "
                "(--worker-python names another Python)",
            )
        return answers

    async def call(
        self, worker: Worker, service: str, method: str, path: str, body: Any = None
    ) -> Any:
        args = ["call", service, method, path]
        if body is not None:
            args += ["--body", json.dumps(body)]
        answer = (await self.ctl(worker, *args))[-1]
        if answer.get("status") != 200:
            what = answer.get("error") or f"HTTP {answer.get('status')}: {answer.get('body')}"
            raise ServeError(f"{worker.label}: the {service} refused {method} {path}: {what}")
        return answer["body"]

    # -- up ------------------------------------------------------------------------------
    def ports(self, worker: Worker, options: UpOptions) -> list[int]:
        n = options.servers_per_worker
        offset = worker.id * n if self.shared_addresses() else 0
        return [options.base_port + offset + k for k in range(n)]

    def devices(self, options: UpOptions) -> int:
        if options.devices_per_worker is not None:
            return options.devices_per_worker
        return int(getattr(self.pod.spec, "devices_per_worker", 0) or 4)

    async def ensure_agent(self, worker: Worker, options: UpOptions) -> dict[str, Any]:
        port = 0 if self.shared_addresses() else options.agent_port
        answer = (
            await self.ctl(
                worker,
                "ensure",
                "agent",
                "--",
                self.python,
                "-m",
                "tpupod.serve.agent",
                "--host",
                worker.internal_address,
                "--port",
                str(port),
            )
        )[-1]
        if "error" in answer:
            log = "; ".join(answer.get("log", [])[-3:])
            raise ServeError(f"{worker.label}: {answer['error']}: {log}")
        return answer

    def replica_specs(self, options: UpOptions) -> dict[int, list[ServerSpec]]:
        if options.backend is not Backend.BUILTIN or options.servers_per_worker != 1:
            raise ServeError(
                "--hosts-per-replica serves one builtin replica per group of workers",
                hint="use the builtin backend with --servers-per-worker 1",
            )
        return plan_replicas(
            [(w.id, w.internal_address) for w in self.pod.workers],
            options.hosts_per_replica,
            model=options.model,
            base_port=options.base_port,
            shared_addresses=self.shared_addresses(),
            dtype=options.dtype,
            served_model_name=options.served_model_name,
            python=self.python,
            mesh=options.mesh,
            extra_args=options.extra_args,
            restart_backoff_s=options.restart_backoff,
        )

    def plan_worker(self, worker: Worker, options: UpOptions) -> list[ServerSpec]:
        """The server specs of one worker (raises on options that do not fit)."""
        if options.hosts_per_replica > 1:
            return self.replica_specs(options)[worker.id]
        return plan(
            options.backend,
            host=worker.internal_address,
            ports=self.ports(worker, options),
            model=options.model,
            devices=self.devices(options),
            dtype=options.dtype,
            served_model_name=options.served_model_name,
            python=self.python,
            command=options.command,
            extra_args=options.extra_args,
            restart_backoff_s=options.restart_backoff,
        )

    async def start_servers(
        self, worker: Worker, options: UpOptions, plans: dict[int, list[ServerSpec]]
    ) -> list[ServerRecord]:
        if options.hosts_per_replica > 1:
            return await self.start_members(worker, plans)
        specs = plans[worker.id]
        for spec in specs:
            await self.call(worker, "agent", "POST", "/admin/start", spec.model_dump(mode="json"))
        return [
            ServerRecord(worker=worker.id, host=worker.internal_address, port=p, name=s.name)
            for s in specs
            for p in s.ports
        ]

    async def start_members(
        self, worker: Worker, every: dict[int, list[ServerSpec]]
    ) -> list[ServerRecord]:
        """Start this worker's members of multi-host replicas; a record per replica it leads."""
        records = []
        for spec in every[worker.id]:
            await self.call(worker, "agent", "POST", "/admin/start", spec.model_dump(mode="json"))
            group = spec.group
            if group is not None and group.rank == 0:
                followers = [
                    w
                    for w, specs in every.items()
                    for other in specs
                    if other.group is not None
                    and other.group.leader == group.leader
                    and other.group.rank > 0
                ]
                records.append(
                    ServerRecord(
                        worker=worker.id,
                        host=worker.internal_address,
                        port=group.http_port,
                        name=spec.name,
                        followers=followers,
                    )
                )
        return records

    async def wait_ready(self, worker: Worker, timeout: float, progress: Progress) -> None:
        began = time.monotonic()

        def seen(text: str) -> None:
            event = json.loads(text)
            ports = ",".join(str(p) for p in event.get("ports", []))
            took = time.monotonic() - began
            if event["event"] == "ready":
                progress(f"{worker.label} :{ports} ready ({took:.1f}s)")

        answers = await self.ctl(worker, "wait-ready", "--timeout", str(timeout), on_line=seen)
        last = answers[-1]
        if last.get("event") == "failing":
            ports = ",".join(str(p) for p in last.get("ports", []))
            logs = " | ".join(own_lines(last.get("log", []))[-3:])
            raise ServeError(
                f"{worker.label}: the server {f'on :{ports}' if ports else last['name']} exited "
                f"before it answered (exit {last.get('last_exit')})",
                hint=(f"its last lines: {logs}" if logs else "see its log in the agent's folder")
                + "; serve up stopped what it had started",
            )
        if last.get("event") == "gone":
            raise ServeError(
                f"{worker.label}: the agent went away while its servers started: {last['error']}",
                hint="was 'tpupod serve down' run meanwhile? serve up stopped what it had started",
            )
        if last.get("event") == "timeout":
            pending = last.get("pending", [])
            names = ", ".join(
                f":{','.join(str(p) for p in s['ports'])} ({s['state']})" for s in pending
            )
            logs = " | ".join(own_lines(pending[0].get("log", []))[-3:]) if pending else ""
            raise ServeError(
                f"{worker.label}: not ready after {timeout:g}s: {names}",
                hint=(f"last log lines: {logs}" if logs else "see the agent's logs/ folder")
                + "; serve up stopped what it had started",
            )

    async def ensure_router(
        self, options: UpOptions, servers: list[ServerRecord], token: str
    ) -> int:
        head = self.pod.workers[0]
        port = options.router_port
        if port is None:
            port = 0 if self.pod.on_this_machine else defaults.ROUTER_PORT
        argv = [self.python, "-m", "tpupod.serve.router", "--host", head.internal_address]
        argv += ["--port", str(port)]
        # without --served-model-name, the router asks the servers what they call the model
        argv += ["--model", options.served_model_name] if options.served_model_name else []
        argv += ["--backends", ",".join(s.address for s in servers), "--policy", options.policy]
        argv += ["--health-interval", str(options.health_interval)]
        args = ["ensure", "--replace", "--token-env", "TPUPOD_SERVE_TOKEN", "router", "--", *argv]
        answer = (await self.ctl(head, *args, env={"TPUPOD_SERVE_TOKEN": token}))[-1]
        if "error" in answer:
            raise ServeError(f"w0: {answer['error']}: {'; '.join(answer.get('log', []))}")
        return int(answer["port"])

    async def up(
        self, options: UpOptions, progress: Progress, replace: bool = False
    ) -> FleetRecord | None:
        """Start the fleet; None when the same one already serves (nothing is touched).

        Another fleet on the pod is refused unless ``replace``; then every server of
        every agent is stopped before the new ones start. When anything fails, every
        agent, server and router is stopped: a failed ``serve up`` leaves nothing.
        """
        wanted = settings_of(options)
        old = self.existing()
        if old is not None and not replace:
            if old.settings != wanted:
                raise ServeError(
                    f"already serving {old.model} on pod {self.pod.name!r} with other "
                    f"settings ({differences(old.settings, wanted)})",
                    hint="'tpupod serve down' first, or 'tpupod serve up --replace' to stop "
                    "every server of it and start these",
                )
            lost = await self.missing(old)
            if not lost:
                progress(f"already serving {old.model} with these settings at {old.base_url}")
                return None
            progress(f"already serving with these settings, but not {lost}: starting it again")
        plans = {w.id: self.plan_worker(w, options) for w in self.pod.workers}  # may refuse
        try:
            return await self.start(options, plans, old, progress)
        except BaseException:  # a failure, or Ctrl-C (the task is cancelled): stop it all
            with contextlib.suppress(Exception):
                await self.down(lambda _: None)
            raise

    def existing(self) -> FleetRecord | None:
        try:
            return load_record(self.state, self.pod.name)
        except ServeError:
            return None

    async def missing(self, record: FleetRecord) -> str:
        """What of the recorded fleet does not run ('' when all of it does)."""
        agents, router = await self.status()
        lost = [
            f"w{w}'s {s.name}"
            for s in record.servers
            for w in (s.worker, *s.followers)
            if isinstance(m := _member(agents, w, s.name), str) or m["state"] == "stopped"
        ]
        return ", ".join(lost + (["the router"] if isinstance(router, str) else []))

    async def start(
        self,
        options: UpOptions,
        plans: dict[int, list[ServerSpec]],
        old: FleetRecord | None,
        progress: Progress,
    ) -> FleetRecord:
        workers = list(self.pod.workers)
        agents = await _gather(self.ensure_agent(w, options) for w in workers)
        for w, a in zip(workers, agents, strict=True):
            state = "started" if a.get("started_now") else "running"
            progress(f"{w.label} agent {state} (pid {a['pid']}, {a['host']}:{a['port']})")
        # an agent that ran already may hold servers of a fleet before: none may stay
        running = [w for w, a in zip(workers, agents, strict=True) if not a.get("started_now")]
        stopped = await _gather(self.call(w, "agent", "POST", "/admin/stop", {}) for w in running)
        if count := sum(len(answer["stopped"]) for answer in stopped):
            progress(f"stopped {count} servers of the fleet before")
        per_worker = await _gather(self.start_servers(w, options, plans) for w in workers)
        servers = [s for group in per_worker for s in group]
        if options.hosts_per_replica > 1:
            progress(
                f"starting {len(servers)} replicas of {options.hosts_per_replica} workers each "
                "(lockstep)"
            )
        else:
            progress(
                f"starting {len(servers)} servers ({options.backend.value}) "
                f"on {len(workers)} workers"
            )
        await _gather(self.wait_ready(w, options.startup_timeout, progress) for w in workers)
        wanted = settings_of(options)  # as given: a router port kept below is not a setting
        token = old.token if old is not None else secrets.token_urlsafe(24)
        if old is not None and options.router_port is None:  # the endpoint stays where it was
            options = dataclasses.replace(options, router_port=old.router_port)
        port = await self.ensure_router(options, servers, token)
        record = FleetRecord(
            pod=self.pod.name,
            model=options.served_model_name or options.model,
            backend=options.backend,
            python=self.python,
            servers=servers,
            router_host=self.pod.workers[0].internal_address,
            router_port=port,
            token=token,
            started=time.time(),
            settings=wanted,
        )
        save_record(self.state, record)
        progress(f"router on w0 at {record.base_url} over {len(servers)} servers")
        return record

    # -- status, restart, down -----------------------------------------------------------
    async def agent_status(self, worker: Worker) -> dict[str, Any] | str:
        try:
            body: dict[str, Any] = await self.call(worker, "agent", "GET", "/admin/status")
        except (ServeError, WorkerError) as exc:
            return exc.message
        return body

    async def status(self) -> tuple[list[dict[str, Any] | str], dict[str, Any] | str]:
        agents = await asyncio.gather(*(self.agent_status(w) for w in self.pod.workers))
        try:
            router = await self.call(self.pod.workers[0], "router", "GET", "/backends")
        except (ServeError, WorkerError) as exc:
            router = exc.message
        return list(agents), router

    async def restart(self, workers: list[Worker], name: str | None) -> list[str]:
        done = await _gather(
            self.call(w, "agent", "POST", "/admin/restart", {"name": name}) for w in workers
        )
        return [f"w{w.id}:{n}" for w, d in zip(workers, done, strict=True) for n in d["restarted"]]

    async def down(self, progress: Progress) -> None:
        async def stop_worker(w: Worker) -> None:
            answer = (await self.ctl(w, "stop", "agent"))[-1]
            what = "stopped" if answer.get("stopped") else "was not running"
            progress(f"{w.label} agent {what}")

        await _gather(stop_worker(w) for w in self.pod.workers)
        answer = (await self.ctl(self.pod.workers[0], "stop", "router"))[-1]
        progress(f"w0 router {'stopped' if answer.get('stopped') else 'was not running'}")
        record_path(self.state, self.pod.name).unlink(missing_ok=True)


def own_lines(log: list[str]) -> list[str]:
    """A server's log lines without their times and the agent's notes about it."""
    lines = [unstamped(line) for line in log]
    return [line for line in lines if not line.startswith("[tpupod agent]")]


async def _gather(awaitables: Any) -> list[Any]:
    """Gather, and raise the first failure only after every worker has answered."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return results


def status_rows(
    record: FleetRecord, agents: list[dict[str, Any] | str], router: dict[str, Any] | str
) -> list[dict[str, Any]]:
    """One row per server port: worker, port, backend, state, restarts, requests, tokens/s."""
    health = router.get("health", {}) if isinstance(router, dict) else {}
    rows = []
    for s in record.servers:
        agent = agents[s.worker] if s.worker < len(agents) else "no agent"
        managed = None
        if isinstance(agent, dict):
            managed = next((m for m in agent["servers"] if s.port in m["ports"]), None)
        seen = health.get(s.address, {})
        state = managed["state"] if managed else (agent if isinstance(agent, str) else "gone")
        members = [member_state(agents, f, s.name) for f in s.followers]
        pairs = zip(s.followers, members, strict=True)
        state = ", ".join([state, *(f"w{f}: {m}" for f, m in pairs if m != "ready")])
        if managed and seen.get("state") == "down":
            state = f"{state}, router: down"
        rows.append(
            {
                "worker": s.worker,
                "address": s.address,
                "backend": record.backend.value,
                "state": state,
                "pid": managed["pid"] if managed else None,
                "restarts": managed["restarts"] if managed else None,
                "requests": seen.get("requests"),
                "tokens_per_s": seen.get("tokens_per_s"),
                "followers": s.followers,
                "follower_restarts": [member_restarts(agents, f, s.name) for f in s.followers],
            }
        )
    return rows


def _member(agents: list[dict[str, Any] | str], worker: int, name: str) -> dict[str, Any] | str:
    agent = agents[worker] if worker < len(agents) else "no agent"
    if isinstance(agent, str):
        return agent
    found = next((m for m in agent["servers"] if m["name"] == name), None)
    return found if found is not None else "gone"


def member_state(agents: list[dict[str, Any] | str], worker: int, name: str) -> str:
    """The state of a replica's member on ``worker`` (as its agent reports it)."""
    member = _member(agents, worker, name)
    return member if isinstance(member, str) else str(member["state"])


def member_restarts(agents: list[dict[str, Any] | str], worker: int, name: str) -> int | None:
    member = _member(agents, worker, name)
    return None if isinstance(member, str) else int(member["restarts"])
