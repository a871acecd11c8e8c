"""``tpupod serve``'s remote side: a fleet of model servers on a pod, one router in front.

Everything reaches the workers through the fan-out (``fanout.execute_async``, so its
bounds on a silent host hold), by running ``python -m tpupod.serve.agent.ctl`` there (see
``ctl.py``): ensure an agent (detached), hand it the server specs, stream readiness, then
ensure the router on worker 0, which can reach every worker's internal address. The
fleet's record is ``record.py``'s; ``fleet.py`` is the blocking face the CLI drives.

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
from typing import Any

from tpupod.errors import MissingExtra, PreflightError, ServeError, UsageError, WorkerError
from tpupod.extras import worker_argv
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import Outcome, WorkerResult
from tpupod.pod import users as podusers
from tpupod.pod.record import Pod, Worker
from tpupod.pod.state import StateDir
from tpupod.providers import Connector, provider_for
from tpupod.serve import defaults
from tpupod.serve.backends import Backend, ServerSpec, plan, plan_replicas
from tpupod.serve.fleet.record import (
    FleetRecord,
    ServerRecord,
    UpOptions,
    differences,
    load_record,
    record_path,
    save_record,
    settings_of,
)
from tpupod.serve.fleet.status import AgentAnswer, agents_down, member, router_failed
from tpupod.serve.router.sgl import MISSING
from tpupod.serve.services import unstamped
from tpupod.transport import OutputLine

Progress = Callable[[str], None]
# The longest a ctl call but wait-ready may take: ``ensure`` waits up to ctl's
# READY_TIMEOUT_S for a service to listen, ``stop`` up to its STOP_GRACE_S.
CTL_TIMEOUT_S = 60.0
# wait-ready's own --timeout is the servers'; the call gets this much more.
WAIT_MARGIN_S = 30.0
# How a starting 'serve up' names itself among the pod's users (podusers): 'tpupod down'
# waits for it, 'serve down' stops it first, status tells whether it still runs.
SERVE_UP = "tpupod serve up"
# after a repair, serve up waits until the router routes to the servers started again: the
# health checks it takes (RISE, and one begun before they listened), and some slack
ROUTED_CHECKS = defaults.RISE + 2
ROUTED_SLACK_S = 5.0
# preflight suggests a --base-port this many ports on (or a multiple, up to SHIFTS of them)
SHIFT_STEP = 100
SHIFTS = 20


@dataclasses.dataclass(frozen=True)
class Lost:
    """What of a recorded fleet does not run: the workers whose servers (or replica
    members) are gone or stopped, whether the router is, and the two said in words."""

    workers: frozenset[int]
    router: bool
    text: str


class RemoteFleet:
    """The fleet of one pod, asynchronously: ctl calls on its workers through the fan-out."""

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
        timeout: float = CTL_TIMEOUT_S,
    ) -> list[dict[str, Any]]:
        """Run ``python -m tpupod.serve.agent.ctl ARGS`` on the worker; its JSON lines.

        It runs through the fan-out (``fanout.execute_async``), so its bounds hold: a host
        that does not answer a new command within the connect timeout, or goes silent
        mid-call, or a call past ``timeout`` seconds, is given up and named.
        """
        command = shlex.join([self.python, "-m", "tpupod.serve.agent.ctl", *args])
        answers: list[dict[str, Any]] = []
        other: list[str] = []

        def seen(_: Worker, line: OutputLine) -> None:
            try:
                answer = json.loads(line.text)
            except ValueError:
                other.append(line.text)
                return
            if isinstance(answer, dict):
                answers.append(answer)
                if on_line is not None:
                    on_line(line.text)

        done = await execute_async(
            self.pod, command, workers=[worker], env=env, on_line=seen,
            connector=self.connector, timeout=timeout,
        )  # fmt: skip
        result = done.workers[0]
        if result.outcome in (Outcome.UNREACHABLE, Outcome.TIMED_OUT):
            raise unanswered(worker, result, args[0], timeout)
        if not answers:
            last = other[-1] if other else result.outcome_text()
            raise ServeError(
                f"{worker.label}: tpupod.serve.agent.ctl gave no answer ({last})",
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
        return await self.answered(worker, service, f"{method} {path}", args)

    async def answered(self, worker: Worker, service: str, what: str, args: list[str]) -> Any:
        """The body of a ctl call's answer (``call`` or ``view``), or a ServeError."""
        answer = (await self.ctl(worker, *args))[-1]
        why = _failure(worker, service, what, answer)
        if why is not None:
            raise ServeError(why)
        body = answer["body"]
        if isinstance(body, dict) and "kept" in answer:  # whether its keeper runs
            body = {**body, "kept": answer["kept"]}
        return body

    # -- up ------------------------------------------------------------------------------
    def ports(self, worker: Worker, options: UpOptions) -> list[int]:
        n = options.servers_per_worker
        offset = worker.id * n if self.shared_addresses() else 0
        return [options.base_port + offset + k for k in range(n)]

    def devices(self, options: UpOptions) -> int:
        if options.devices_per_worker is not None:
            return options.devices_per_worker
        return int(getattr(self.pod.spec, "devices_per_worker", 0) or 4)

    def agent_port(self, options: UpOptions) -> int:
        """The agents' port; 0 (any free one) on a local pod, whose workers share this
        machine's loopback with every other local pod (a one-worker pod's too)."""
        return 0 if self.shared_addresses() or self.pod.on_this_machine else options.agent_port

    def router_port(self, options: UpOptions) -> int:
        """The router's port on worker 0; 0 (any free one) on a local pod."""
        if options.router_port is not None:
            return options.router_port
        return 0 if self.pod.on_this_machine else defaults.ROUTER_PORT

    async def ensure_agent(self, worker: Worker, options: UpOptions) -> dict[str, Any]:
        port = self.agent_port(options)
        answer = (
            await self.ctl(
                worker,
                "ensure",
                "agent",
                "--",
                *worker_argv(self.python, "serve", "tpupod.serve.agent"),
                *("--host", worker.internal_address, "--port", str(port)),
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

    async def preflight(
        self,
        workers: list[Worker],
        options: UpOptions,
        plans: dict[int, list[ServerSpec]],
        router: bool = True,
    ) -> None:
        """Before anything starts: ask each worker (``ctl preflight``) whether the backend
        can serve the model there and whether the ports the fleet binds there are free;
        a wrong model is a UsageError, a port another process holds a PreflightError
        naming the process and a --base-port free on every worker."""
        if not workers:
            return
        every = [p for specs in plans.values() for spec in specs for p in spec.bound_ports]
        top = max(every, default=options.base_port)
        step = SHIFT_STEP * -(-(top - options.base_port + 1) // SHIFT_STEP)
        shifts = [k * step for k in range(1, SHIFTS + 1) if top + k * step <= 65535]
        fixed = {"--agent-port": self.agent_port(options)}

        def args(w: Worker) -> list[str]:
            ports = ",".join(str(p) for spec in plans[w.id] for p in spec.bound_ports)
            extra = {**fixed, "--router-port": self.router_port(options)} if w.id == 0 else fixed
            wanted = [f"--fixed={flag}={port}" for flag, port in extra.items() if port]
            if w.id == 0 and not router:
                wanted = [f for f in wanted if not f.startswith("--fixed=--router-port")]
            if w.id == 0 and router and options.router == "sgl":
                wanted.append("--router=sgl")
            return [
                "preflight", f"--host={w.internal_address}", f"--backend={options.backend.value}",
                f"--model={options.model}", f"--ports={ports}", *wanted,
                f"--shifts={','.join(map(str, shifts))}",
            ]  # fmt: skip

        answers = await _gather(self.ctl(w, *args(w)) for w in workers)
        found = [(w, a[-1]) for w, a in zip(workers, answers, strict=True)]
        self.refuse_missing_extra(found)
        if any(a.get("router") for _, a in found):
            raise self.sgl_missing()
        self.refuse_model(found)
        self.refuse_taken(found, options.base_port)

    def refuse_missing_extra(self, found: list[tuple[Worker, dict[str, Any]]]) -> None:
        """An extra the workers' Python lacks (the serve extra; the model extra for the
        builtin server), named with the workers that lack it."""
        bad = [(w, a["extra"]) for w, a in found if a.get("extra")]
        if bad:
            first = bad[0][1]
            where = f" on {', '.join(w.label for w, e in bad if e == first)}"
            raise MissingExtra("'tpupod serve up'", first["extra"], first["modules"], where=where)

    def refuse_model(self, found: list[tuple[Worker, dict[str, Any]]]) -> None:
        """The model's problem as the workers said it: one line (the same on every worker of
        a local pod: they share this machine)."""
        bad = [(w, a["model"]) for w, a in found if a.get("model")]
        if not bad:
            return
        first = bad[0][1]
        alike = [w for w, m in bad if m["error"] == first["error"]]
        here = self.pod.on_this_machine and len(alike) == len(found)
        where = "" if here else f"{', '.join(w.label for w in alike)}: "
        raise UsageError(f"{where}{first['error']}", hint=first.get("hint"))

    def refuse_taken(self, found: list[tuple[Worker, dict[str, Any]]], base: int) -> None:
        """Ports other processes hold, each with its holder; the hint a --base-port free on
        every worker (serve up does not move the fleet's ports by itself: docs/serving.md)."""
        taken = [(w, t) for w, a in found for t in a.get("taken", [])]
        if self.shared_addresses():  # one host: a port may be another worker's server's
            ours = {g for _, a in found for g in a.get("groups", [])}
            taken = [(w, t) for w, t in taken if not _ours(t, ours)]
        if not taken:
            return
        said = [
            f"{w.label} :{t['port']} ({t['flag']}) by "
            + (", ".join(h["text"] for h in t["holders"]) or "a connection (nothing listens)")
            for w, t in taken
        ]
        flags = sorted({t["flag"] for _, t in taken})
        free = set.intersection(*(set(a.get("free_shifts", [])) for _, a in found))
        fixes = [
            f"--base-port {base + min(free)}" if flag == "--base-port" and free else
            f"another {flag}"
            for flag in flags
        ]  # fmt: skip
        on_every = " (free on every worker)" if "--base-port" in flags and free else ""
        raise PreflightError(
            f"port{'s' if len(taken) > 1 else ''} in use: {'; '.join(said)}",
            hint=f"stop {'them' if len(taken) > 1 else 'it'}, or give {' and '.join(fixes)}"
            f"{on_every}",
        )

    async def start_servers(self, worker: Worker, plans: dict[int, list[ServerSpec]]) -> None:
        for spec in plans[worker.id]:
            await self.call(worker, "agent", "POST", "/admin/start", spec.model_dump(mode="json"))

    async def wait_ready(
        self, worker: Worker, timeout: float, progress: Progress, labels: dict[str, str]
    ) -> None:
        """Say each of the worker's servers as it becomes ready (``labels``: what each is,
        by name: ``:31000``, or a replica's member); fail at its first exit or the timeout."""
        began = time.monotonic()

        def label(event: dict[str, Any]) -> str:
            ports = ",".join(str(p) for p in event.get("ports", []))
            return labels.get(event.get("name", ""), f":{ports}")

        def seen(text: str) -> None:
            event = json.loads(text)
            took = time.monotonic() - began
            if event["event"] == "ready":
                progress(f"{worker.label} {label(event)} ready ({took:.1f}s)")
            elif event["event"] == "waiting":  # a slow load, or a server that answers wrong
                why = f" ({event['answer']})" if event["answer"] else ""
                progress(f"{worker.label} {label(event)} still starting after {took:.0f}s{why}")

        answers = await self.ctl(
            worker, "wait-ready", "--timeout", str(timeout), on_line=seen,
            timeout=timeout + WAIT_MARGIN_S,
        )  # fmt: skip
        last = answers[-1]
        if last.get("event") == "failing":
            what = label(last)
            what = f"server on {what}" if what.startswith(":") else what
            logs = " | ".join(own_lines(last.get("log", []))[-3:])
            raise ServeError(
                f"{worker.label}: the {what} exited before it answered "
                f"(exit {last.get('last_exit')})",
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
                f"{label(s)} ({s['state']}" + (f": {s['answer']})" if s.get("answer") else ")")
                for s in pending
            )
            logs = " | ".join(own_lines(pending[0].get("log", []))[-3:]) if pending else ""
            raise ServeError(
                f"{worker.label}: not ready after {timeout:g}s: {names}",
                hint=(f"last log lines: {logs}" if logs else "see the agent's logs/ folder")
                + "; serve up stopped what it had started",
            )

    def sgl_missing(self) -> ServeError:
        """Worker 0's Python cannot import sglang_router (its preflight, or the router's
        start: a Python changed in between)."""
        return ServeError(
            f"w0: {MISSING} {self.python}: --router sgl runs sgl-router there",
            hint="pip install 'tpupod[sgl]' on the workers (or --router builtin)",
        )

    async def ensure_router(
        self, options: UpOptions, servers: list[ServerRecord], token: str, again: bool = False
    ) -> int:
        """Start the router on worker 0 (stopping one there first); its port. ``again``: the
        fleet's router was lost, and this start counts as one of its restarts."""
        head = self.pod.workers[0]
        port = self.router_port(options)
        module = "tpupod.serve.router.sgl" if options.router == "sgl" else "tpupod.serve.router"
        argv = [self.python, "-m", module, "--host", head.internal_address, "--port", str(port)]
        # without --served-model-name, the router asks the servers what they call the model
        if options.served_model_name and options.router == "builtin":
            argv += ["--model", options.served_model_name]
        argv += ["--backends", ",".join(s.address for s in servers), "--policy", options.policy]
        argv += ["--health-interval", str(options.health_interval)]
        argv += ["--hold", str(options.hold)] if options.router == "builtin" else []
        args = ["ensure", "--replace", "--token-env", "TPUPOD_SERVE_TOKEN"]
        args += [*(["--again"] if again else []), "router", "--", *argv]
        answer = (await self.ctl(head, *args, env={"TPUPOD_SERVE_TOKEN": token}))[-1]
        if "error" in answer:
            log = answer.get("log", [])
            if any(MISSING in line for line in log):
                raise self.sgl_missing()
            raise ServeError(f"w0: {answer['error']}: {'; '.join(map(unstamped, log))}")
        return int(answer["port"])

    async def up(
        self, options: UpOptions, progress: Progress, replace: bool = False
    ) -> FleetRecord | None:
        """Start the fleet; None when the same one already serves (nothing is touched).

        Another fleet on the pod is refused unless ``replace``; then every server of
        every agent is stopped before the new ones start. The model and the ports are
        checked on every worker before anything starts (``preflight``). When anything
        fails, or the caller is cancelled (Ctrl-C, SIGTERM: ``Fleet.up``), every agent,
        server and router is stopped: a failed ``serve up`` leaves nothing. While it
        starts, this process is one of the pod's users (``SERVE_UP``), and one other
        ``serve up`` of the pod at a time is refused.
        """
        with podusers.using(self.state, self.pod.name, SERVE_UP):
            self.refuse_another_start()
            return await self._up(options, progress, replace)

    def starters(self) -> list[podusers.PodUser]:
        """The live ``serve up`` processes of this pod, the earliest first."""
        found = [u for u in podusers.users(self.state, self.pod.name) if u.what == SERVE_UP]
        return sorted(found, key=lambda u: (u.since, u.pid))

    def refuse_another_start(self) -> None:
        """Two ``serve up`` of one pod at once would stop each other's servers: the later
        one (each sees both) is refused."""
        starters = self.starters()
        if starters and starters[0].pid != os.getpid():
            first = starters[0]
            raise ServeError(
                f"{first.describe()} is starting a fleet on pod {self.pod.name!r}",
                hint=f"wait for it, or stop it (kill {first.pid}: it stops what it started)",
            )

    async def _up(
        self, options: UpOptions, progress: Progress, replace: bool
    ) -> FleetRecord | None:
        wanted = settings_of(options)
        old = self.existing()
        if old is not None and old.starting is not None:  # its serve up is gone (refused above)
            progress(
                f"a serve up before (pid {old.starting}) ended before its fleet was ready: "
                "starting anew"
            )
            old = None
        if old is not None and not replace:
            if old.options != wanted:
                raise ServeError(
                    f"already serving {old.model} on pod {self.pod.name!r} with other "
                    f"settings ({differences(old.options, wanted)})",
                    hint="'tpupod serve down' first, or 'tpupod serve up --replace' to stop "
                    "every server of it and start these",
                )
            lost = await self.missing(old)
            if not lost.text:
                progress(f"already serving {old.model} with these settings at {old.base_url}")
                return None
            progress(f"already serving with these settings, but not {lost.text}: starting it again")
            return await self.repair(old, options, lost, progress)
        plans = {w.id: self.plan_worker(w, options) for w in self.pod.workers}  # may refuse
        if old is not None and options.router_port is None:  # the endpoint stays where it was
            options = dataclasses.replace(options, router_port=old.router_port)
        await self.preflight(list(self.pod.workers), options, plans)
        try:
            return await self.start(options, wanted, plans, old, progress)
        except BaseException:  # a failure, or Ctrl-C (the task is cancelled): stop it all
            with contextlib.suppress(Exception):
                await self.down(lambda _: None)
            raise

    async def wait_all_ready(
        self,
        workers: list[Worker],
        options: UpOptions,
        plans: dict[int, list[ServerSpec]],
        progress: Progress,
    ) -> None:
        """Every server of ``workers`` ready; the first failure (a server's exit, a worker's
        timeout) ends the wait on every worker at once."""
        labels = server_labels(plans)
        await _first_failure(
            self.wait_ready(w, options.startup_timeout, progress, labels[w.id]) for w in workers
        )

    def existing(self) -> FleetRecord | None:
        try:
            return load_record(self.state, self.pod.name)
        except ServeError:
            return None

    async def missing(self, record: FleetRecord) -> Lost:
        """What of the recorded fleet does not run (``text`` empty when all of it does).
        A process that serves several ports (the builtin backend's) is named once, with
        them: it was named once per port."""
        agents, router = await self.status()
        # a worker whose agent is down: the agent is what is lost (its servers may serve on;
        # a new one takes them over, or starts them again)
        agentless = agents_down(agents)
        ports: dict[tuple[int, str], list[int]] = {}  # each lost (worker, server): its ports
        for s in record.servers:
            for w in (s.worker, *s.followers):
                if w in agentless:
                    continue
                if isinstance(m := member(agents, w, s.name), str) or m["state"] == "stopped":
                    ports.setdefault((w, s.name), []).append(s.port)
        router_lost = router_failed(router)
        named = [f"w{w}'s agent" for w in agentless] + [
            f"w{w}'s {name}" + (f" (serving :{', :'.join(map(str, on))})" if len(on) > 1 else "")
            for (w, name), on in ports.items()
        ] + (["the router"] if router_lost else [])  # fmt: skip
        lost = frozenset(agentless) | {w for w, _ in ports}
        return Lost(lost, router_lost, ", ".join(named))

    async def repair(
        self, old: FleetRecord, options: UpOptions, lost: Lost, progress: Progress
    ) -> FleetRecord:
        """Start again what of the fleet is lost, with its settings: the servers of the
        workers named (a new agent, where the last one is gone, takes over the servers it
        left that still run),
        the router on its port. The rest serves on untouched; a failure stops what this
        started (the lost workers' agents, the router if it was lost) and nothing else."""
        workers = [w for w in self.pod.workers if w.id in lost.workers]
        plans = {w.id: self.plan_worker(w, options) for w in self.pod.workers}
        options = dataclasses.replace(options, router_port=options.router_port or old.router_port)
        checked = workers or ([self.pod.workers[0]] if lost.router else [])
        await self.preflight(checked, options, plans, router=lost.router)
        try:
            await _gather(self.ensure_agent(w, options) for w in workers)
            # a new agent took over the servers the one before left: those still run
            still = (await self.missing(old)).workers
            starting = [w for w in workers if w.id in still]
            await _gather(self.call(w, "agent", "POST", "/admin/stop", {}) for w in starting)
            await _gather(self.start_servers(w, plans) for w in starting)
            await self.wait_all_ready(workers, options, plans, progress)
            if not lost.router:
                await self.wait_routed(old, lost.workers, options, progress)
                return old
            port = await self.ensure_router(options, old.servers, old.token, again=True)
        except BaseException:  # a failure, or Ctrl-C
            stops = [self.ctl(w, "stop", "agent") for w in workers]
            stops += [self.ctl(self.pod.workers[0], "stop", "router")] if lost.router else []
            await asyncio.gather(*stops, return_exceptions=True)
            raise
        record = old.model_copy(update={"router_port": port})
        save_record(self.state, record)
        return record

    async def wait_routed(
        self, record: FleetRecord, workers: frozenset[int], options: UpOptions, progress: Progress
    ) -> None:
        """Until the router routes to the servers started again on ``workers`` (its health
        checks took them out when they went, and bring them back after ``RISE`` checks in a
        row): serve up said they were ready while the router still had them down. Bounded:
        past a few checks' time it says which it does not route to yet, and goes on."""
        addresses = {s.address for s in record.servers if workers & {s.worker, *s.followers}}
        deadline = time.monotonic() + ROUTED_CHECKS * options.health_interval + ROUTED_SLACK_S
        routed: set[str] = set()
        said = False
        while time.monotonic() < deadline:
            view = await self.router_view()
            routed = set(view.get("backends", [])) if not router_failed(view) else set()
            if addresses <= routed:
                return
            if not said:
                said = True
                progress(
                    f"waiting for the router's health checks (each {options.health_interval:g}s) "
                    f"to route to {', '.join(sorted(addresses - routed))} again"
                )
            await asyncio.sleep(min(0.2, options.health_interval / 4))
        progress(
            f"the router does not route to {', '.join(sorted(addresses - routed))} yet: "
            "'tpupod serve status' shows its view"
        )

    async def start(
        self,
        options: UpOptions,
        wanted: dict[str, Any],
        plans: dict[int, list[ServerSpec]],
        old: FleetRecord | None,
        progress: Progress,
    ) -> FleetRecord:
        """Start the fleet: agents, servers, the router; ``wanted``: the settings recorded.
        The record is written first, marked ``starting`` with this process's pid, so that
        status, logs and down see the fleet while (or if this process dies before) it is up."""
        workers = list(self.pod.workers)
        servers = server_records(self.pod, plans)
        record = FleetRecord(
            pod=self.pod.name,
            model=options.served_model_name or options.model,
            backend=options.backend,
            python=self.python,
            servers=servers,
            router_host=self.pod.workers[0].internal_address,
            router_port=options.router_port or 0,
            token=old.token if old is not None else secrets.token_urlsafe(24),
            started=time.time(),
            settings=wanted,
            router=options.router,
            starting=os.getpid(),
        )
        save_record(self.state, record)
        agents = await _gather(self.ensure_agent(w, options) for w in workers)
        for w, a in zip(workers, agents, strict=True):
            state = "started" if a.get("started_now") else "running"
            progress(f"{w.label} agent {state} (pid {a['pid']}, {a['host']}:{a['port']})")
        # any agent may hold servers of a fleet before (one started now takes over those an
        # agent killed hard left): none may stay
        stopped = await _gather(self.call(w, "agent", "POST", "/admin/stop", {}) for w in workers)
        if count := sum(len(answer["stopped"]) for answer in stopped):
            progress(f"stopped {count} servers of the fleet before")
        await _gather(self.start_servers(w, plans) for w in workers)
        if options.hosts_per_replica > 1:
            progress(
                f"starting {len(servers)} replicas of {options.hosts_per_replica} workers each "
                "(lockstep)"
            )
        else:
            many = {"server": len(servers), "worker": len(workers)}
            server, worker = (f"{n} {w}{'s' if n != 1 else ''}" for w, n in many.items())
            progress(f"starting {server} ({options.backend.value}) on {worker}")
        await self.wait_all_ready(workers, options, plans, progress)
        port = await self.ensure_router(options, servers, record.token)
        record = record.model_copy(update={"router_port": port, "starting": None})
        save_record(self.state, record)
        kind = "sgl-router" if options.router == "sgl" else "router"
        progress(f"{kind} on w0 at {record.base_url} over {len(servers)} servers")
        return record

    # -- status, restart, down -----------------------------------------------------------
    async def answer(self, worker: Worker, service: str, args: list[str]) -> AgentAnswer:
        """A service's answer to a ctl call, or why there is none (one line naming the
        worker)."""
        try:
            what = " ".join(args[2:4]) if args[0] == "call" else "its view of the backends"
            body: dict[str, Any] = await self.answered(worker, service, what, args)
        except (ServeError, WorkerError) as exc:
            return exc.message
        return body

    async def status(self) -> tuple[list[AgentAnswer], AgentAnswer]:
        """Every agent's answer and the router's view of its backends, asked at once."""
        status = ["call", "agent", "GET", "/admin/status"]
        asked = [self.answer(w, "agent", status) for w in self.pod.workers]
        *agents, router = await asyncio.gather(*asked, self.router_view())
        return agents, router

    async def running(self) -> list[str]:
        """What of a fleet runs on the workers, recorded or not, each in words (``w0's agent
        (pid 42, 2 servers)``); a worker that does not answer is left out."""
        answers = await asyncio.gather(
            *(self.ctl(w, "running") for w in self.pod.workers), return_exceptions=True
        )
        said: list[str] = []
        for w, answer in zip(self.pod.workers, answers, strict=True):
            if isinstance(answer, (ServeError, WorkerError)):
                continue
            if isinstance(answer, BaseException):
                raise answer
            said += [_running_text(w, found) for found in answer[-1].get("running", [])]
            if orphans := len(answer[-1].get("orphans", [])):
                said.append(f"{orphans} of {w.label}'s servers (their agent was killed)")
        return said

    async def router_view(self) -> dict[str, Any]:
        """The router's view of its backends, with its restarts (``restarts``); where it
        gives none, why (``error``, naming worker 0), and ``down`` when nothing runs the
        router or starts it again."""
        head = self.pod.workers[0]
        try:
            answer = (await self.ctl(head, "view"))[-1]
        except (ServeError, WorkerError) as exc:
            return {"error": exc.message, "down": False, "restarts": None}
        restarts = answer.get("restarts")
        why = _failure(head, "router", "its view of the backends", answer)
        if why is not None:
            return {"error": why, "down": bool(answer.get("down")), "restarts": restarts}
        return {
            **answer["body"],
            "restarts": restarts,
            "record": answer.get("record"),
            "kept": answer.get("kept", True),
        }

    async def restart(self, workers: list[Worker], name: str | None) -> list[str]:
        done = await _gather(
            self.call(w, "agent", "POST", "/admin/restart", {"name": name}) for w in workers
        )
        return [f"w{w.id}:{n}" for w, d in zip(workers, done, strict=True) for n in d["restarted"]]

    async def down(self, progress: Progress) -> None:
        """Stop every agent (and its servers), then the router; the record goes once all
        of it is stopped. A worker that cannot be reached does not keep the others running:
        it is named after the rest stopped, and the record stays for a later down."""

        async def stop_worker(w: Worker) -> None:
            answer = (await self.ctl(w, "stop", "agent"))[-1]
            progress(f"{w.label} agent {_stopped(answer)}")

        async def stop_router() -> None:
            answer = (await self.ctl(self.pod.workers[0], "stop", "router"))[-1]
            progress(f"w0 router {_stopped(answer)}")

        agents = await asyncio.gather(*map(stop_worker, self.pod.workers), return_exceptions=True)
        router = await asyncio.gather(stop_router(), return_exceptions=True)
        _raise_first([*agents, *router])
        record_path(self.state, self.pod.name).unlink(missing_ok=True)


def _stopped(answer: dict[str, Any]) -> str:
    """How ctl's stop of a service went, in words (after its name)."""
    if answer.get("killed"):  # frozen (kill -STOP), or deaf to TERM
        return f"did not stop within its grace ({answer.get('grace', 0):g}s) and was killed"
    return "stopped" if answer.get("stopped") else "was not running"


def server_records(pod: Pod, plans: dict[int, list[ServerSpec]]) -> list[ServerRecord]:
    """The fleet's servers as its record lists them: one a port, or one a replica across
    workers (its leader's, with its followers' workers)."""
    records = []
    for w in pod.workers:
        for spec in plans[w.id]:
            group = spec.group
            if group is None:
                records += [
                    ServerRecord(worker=w.id, host=w.internal_address, port=p, name=spec.name)
                    for p in spec.ports
                ]
            elif group.rank == 0:
                followers = [f for f, specs in plans.items() for o in specs if _follows(o, spec)]
                leader = ServerRecord(
                    worker=w.id, host=w.internal_address, port=group.http_port,
                    name=spec.name, followers=followers,
                )  # fmt: skip
                records.append(leader)
    return records


def _follows(member: ServerSpec, leader: ServerSpec) -> bool:
    g, lead = member.group, leader.group
    return g is not None and lead is not None and g.leader == lead.leader and g.rank > 0


def server_labels(plans: dict[int, list[ServerSpec]]) -> dict[int, dict[str, str]]:
    """What serve up calls each server in its lines, by worker and name: ``:31000``; a
    replica's leader ``:31000 (replica 0)``, its follower ``follower of replica 0 (leader
    w0 :31000)`` (a follower has no port of its own)."""
    leaders = sorted(
        (w, s) for w, specs in plans.items() for s in specs if s.group and not s.group.rank
    )  # by worker: replica g is the g-th group of workers
    replica = {s.group.leader: (g, w) for g, (w, s) in enumerate(leaders) if s.group}
    labels: dict[int, dict[str, str]] = {}
    for w, specs in plans.items():
        for s in specs:
            text = f":{','.join(str(p) for p in s.ports)}"
            if s.group is not None:
                g, head = replica[s.group.leader]
                port = s.group.http_port
                text = (
                    f":{port} (replica {g})"
                    if s.group.rank == 0
                    else f"follower of replica {g} (leader w{head} :{port})"
                )
            labels.setdefault(w, {})[s.name] = text
    return labels


def _failure(worker: Worker, service: str, what: str, answer: dict[str, Any]) -> str | None:
    """Why a ctl call's answer has no body, naming the worker (None: it has one)."""
    if answer.get("status") is None and "error" in answer:  # it does not run or answer
        return f"{worker.label}: {answer['error']}"
    if answer.get("status") != 200:
        why = answer.get("error") or f"HTTP {answer.get('status')}: {answer.get('body')}"
        return f"{worker.label}: the {service} refused {what}: {why}"
    return None


def _running_text(worker: Worker, found: dict[str, Any]) -> str:
    """``w0's agent (pid 42, 2 servers)``: one service ctl's ``running`` found."""
    what = [f"pid {found['pid']}"]
    if not found["answers"]:
        what.append("not answering yet")
    elif "servers" in found:
        n = found["servers"]
        what.append(f"{n} server{'' if n == 1 else 's'}")
    return f"{worker.label}'s {found['service']} ({', '.join(what)})"


def own_lines(log: list[str]) -> list[str]:
    """A server's log lines without their times and the agent's notes about it."""
    lines = [unstamped(line) for line in log]
    return [line for line in lines if not line.startswith("[tpupod agent]")]


async def _gather(awaitables: Any) -> list[Any]:
    """Gather, and raise the first failure only after every worker has answered."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    _raise_first(results)
    return results


def _ours(taken: dict[str, Any], groups: set[int]) -> bool:
    """Whether every process holding a taken port is in one of the fleet's groups."""
    holders = taken["holders"]
    return bool(holders) and all({h["pid"], h["group"]} & groups for h in holders)


async def _first_failure(awaitables: Any) -> list[Any]:
    """Gather; at the first failure, cancel the rest (their remote calls are stopped), wait
    for them to end, and raise it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # our own cancellation (Ctrl-C, SIGTERM) too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    _raise_first([t.exception() for t in tasks if t.done() and not t.cancelled()])
    return [t.result() for t in tasks]


def _raise_first(results: list[Any]) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


def unanswered(worker: Worker, result: WorkerResult, call: str, timeout: float) -> WorkerError:
    """The error of a ctl call the worker did not answer: its host is unreachable or silent."""
    if result.outcome is Outcome.TIMED_OUT:
        reason = f"tpupod.serve.agent.ctl {call} gave no answer in {timeout:g}s"
    else:
        reason = f"unreachable: {result.error}"
    return WorkerError(
        f"{worker.label} ({worker.internal_address}): {reason}",
        hint=result.hint or "the host or its network may be down",
        worker=worker.id,
        reason=reason,
        unreachable=True,
    )
