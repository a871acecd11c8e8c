"""``serve status`` as typed records: one :class:`ServerStatus` per server (a replica across
workers is one, led by its rank-0 worker), gathered into a :class:`FleetStatus`.

The agents and the router answer JSON; this module turns their answers and the fleet's
record into rows a table, the dashboard or a script reads (``Fleet.status()`` returns them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpupod.serve.agent.ctl import DOWN
from tpupod.serve.fleet.record import FleetRecord, ServerRecord

# An agent's /admin/status body, or why it gave none (the worker's error, one line). The
# router's view is a dict either way: why it gave none is its ``error`` (``down``: nothing
# runs the router or starts it again), its restarts are ``restarts``.
AgentAnswer = dict[str, Any] | str


def router_failed(router: AgentAnswer) -> bool:
    """Whether the router gave no view of its backends."""
    return isinstance(router, str) or "error" in router


@dataclass(frozen=True)
class ServerStatus:
    """One server (or replica) of the fleet, as its agent and the router see it."""

    worker: int  # the worker it runs on (a replica's leader)
    address: str  # host:port the router sends requests to
    backend: str
    state: str  # ready, starting, restarting, stopped, ...; or why the agent did not answer
    pid: int | None
    restarts: int | None  # after a crash, of any of its processes (``restarted``: which)
    requests: int | None  # the router's counts (None: the router does not know it)
    tokens_per_s: float | None
    followers: tuple[int, ...] = ()  # a replica's other members' workers
    follower_restarts: tuple[int | None, ...] = ()
    user_restarts: int | None = None  # restarts asked for (``restarts``: after a crash)
    # the restarts by process, those not 0: ``server`` (the agent started it again), and
    # those its own keeper made (the builtin server's ``engine`` and ``front end``)
    restarted: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class FleetStatus:
    """The fleet as a whole: its record, a row per server, and the router's view."""

    record: FleetRecord
    servers: list[ServerStatus]
    healthy: int  # backends the router routes to
    router_error: str | None = None  # why the router did not answer (None: it did)
    router_health: str | None = None  # sgl-router's own /health answer
    circuits: tuple[str, ...] = ()  # sgl-router: backends whose circuit is not closed
    router_at: float | None = None  # when the router read its counts (its host's clock)
    starting: str | None = None  # the fleet's serve up has not finished: whether it runs
    router_down: bool = False  # nothing runs the router, nothing starts it again
    router_restarts: int | None = None  # since serve up started it (after it died)
    # why the router that serves has no record of its own (a full disk), None: it has one
    router_record: str | None = None
    # each worker's agent: how often its keeper started it again after it died (None: no
    # answer), in worker order
    agent_restarts: tuple[int | None, ...] = ()
    # the workers whose agent is down: nothing runs it, nothing starts it again
    agents_down: tuple[int, ...] = ()
    # what runs with no keeper (killed): nothing starts it again when it dies ("w0's agent",
    # "the router")
    unkept: tuple[str, ...] = ()

    @property
    def router_kind(self) -> str:
        return "sgl-router" if self.record.router == "sgl" else "builtin"

    @property
    def replicated(self) -> bool:
        """Replicas across workers: a row per group (leader and followers)."""
        return any(s.followers for s in self.servers)


def fleet_status(
    record: FleetRecord,
    agents: list[AgentAnswer],
    router: AgentAnswer,
    starting: str | None = None,
) -> FleetStatus:
    """The fleet's status from every agent's answer (in worker order) and the router's;
    ``starting``: what its unfinished serve up is doing, in words."""
    health = router.get("health", {}) if isinstance(router, dict) else {}
    servers = [_server(record, s, agents, health.get(s.address, {})) for s in record.servers]
    unkept = [
        f"w{w}'s agent"
        for w, a in enumerate(agents)
        if isinstance(a, dict) and not a.get("kept", True)
    ]
    if isinstance(router, dict) and not router.get("kept", True):
        unkept.append("the router")
    agents_said: dict[str, Any] = {
        "agent_restarts": tuple(a.get("restarts") if isinstance(a, dict) else None for a in agents),
        "agents_down": agents_down(agents),
        "unkept": tuple(unkept),
    }
    if isinstance(router, str):
        return FleetStatus(record, servers, 0, router, starting=starting, **agents_said)
    restarts = router.get("restarts")
    if "error" in router:
        return FleetStatus(
            record, servers, 0, str(router["error"]), starting=starting,
            router_down=bool(router.get("down")), router_restarts=restarts, **agents_said,
        )  # fmt: skip
    circuits = tuple(
        f"{a}: {h['circuit']}" for a, h in health.items() if h.get("circuit", "closed") != "closed"
    )
    healthy = len(router.get("backends", []))
    at = router.get("at")
    return FleetStatus(
        record, servers, healthy, None, router.get("router_health"), circuits,
        float(at) if isinstance(at, int | float) else None, starting, router_restarts=restarts,
        router_record=router.get("record"), **agents_said,
    )  # fmt: skip


def agents_down(agents: list[AgentAnswer]) -> tuple[int, ...]:
    """The workers whose agent is down: nothing runs it, nothing starts it again (ctl's
    words for it end the worker's answer)."""
    down = DOWN.format(service="agent")
    return tuple(w for w, a in enumerate(agents) if isinstance(a, str) and a.endswith(down))


def _server(
    record: FleetRecord, s: ServerRecord, agents: list[AgentAnswer], seen: dict[str, Any]
) -> ServerStatus:
    agent = agents[s.worker] if s.worker < len(agents) else "no agent"
    managed = None
    if isinstance(agent, dict):
        managed = next((m for m in agent["servers"] if s.port in m["ports"]), None)
    state = managed["state"] if managed else (agent if isinstance(agent, str) else "gone")
    if managed and managed.get("restarting") and state == "ready":  # its keeper restarts a part
        state = f"restarting ({', '.join(managed['restarting'])})"
    members = [member_state(agents, f, s.name) for f in s.followers]
    pairs = zip(s.followers, members, strict=True)
    state = ", ".join([state, *(f"w{f}: {m}" for f, m in pairs if m != "ready")])
    if managed and seen.get("state") == "down":
        state = f"{state}, router: down"
    if isinstance(agent, dict) and (agent.get("disk_full") or (managed or {}).get("disk_full")):
        lost = ((managed or {}).get("disk_full") or {}).get("lines_lost")
        state = f"{state}, disk full" + (f": {lost} log lines lost" if lost else "")
    restarted = by_process(managed) if managed else ()
    return ServerStatus(
        worker=s.worker,
        address=s.address,
        backend=record.backend.value,
        state=state,
        pid=managed["pid"] if managed else None,
        restarts=sum(n for _, n in restarted) if managed else None,
        requests=seen.get("requests"),
        tokens_per_s=seen.get("tokens_per_s"),
        followers=tuple(s.followers),
        follower_restarts=tuple(member_restarts(agents, f, s.name) for f in s.followers),
        user_restarts=managed.get("user_restarts") if managed else None,
        restarted=restarted,
    )


def by_process(managed: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """A server's restarts by process, those not 0: the agent's of the whole server
    (``server``), then its own keeper's of its processes (by name)."""
    found = [("server", int(managed["restarts"]))]
    found += sorted((str(k), int(v)) for k, v in managed.get("child_restarts", {}).items())
    return tuple((process, n) for process, n in found if n)


def member(agents: list[AgentAnswer], worker: int, name: str) -> AgentAnswer:
    """What ``worker``'s agent says of the server ``name``: its entry, or why there is none."""
    agent = agents[worker] if worker < len(agents) else "no agent"
    if isinstance(agent, str):
        return agent
    found = next((m for m in agent["servers"] if m["name"] == name), None)
    return found if found is not None else "gone"


def member_state(agents: list[AgentAnswer], worker: int, name: str) -> str:
    """The state of a replica's member on ``worker`` (as its agent reports it)."""
    found = member(agents, worker, name)
    return found if isinstance(found, str) else str(found["state"])


def member_restarts(agents: list[AgentAnswer], worker: int, name: str) -> int | None:
    found = member(agents, worker, name)
    return None if isinstance(found, str) else sum(n for _, n in by_process(found))
