"""The serving fleet's record (``pods/NAME/serve.json``, mode 0600) and ``serve up``'s options.

The launcher keeps the fleet's record (model, servers, router address and
token) in the pod's state folder; a second ``serve up`` compares its options
with the recorded ones (``settings_of``, ``differences``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tpupod.base.files import write_atomic
from tpupod.errors import ServeError, UsageError
from tpupod.pod.state import StateDir
from tpupod.serve import defaults
from tpupod.serve.backends import Backend

RECORD_FILE = "serve.json"


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
    router: str = defaults.ROUTER  # builtin or sgl (sgl-router)
    # the pid of the 'serve up' that is starting this fleet (None once it serves): written
    # before anything starts, so status, logs and down see a fleet that is not up yet
    starting: int | None = None

    @property
    def options(self) -> dict[str, Any] | None:
        """The recorded settings; an option added since they were written reads as its
        default (a fleet started before ``--router`` existed ran the builtin router)."""
        if self.settings is None:
            return None
        return {**settings_of(UpOptions(model=self.model)), **self.settings}

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
    router: str = defaults.ROUTER  # builtin, or sgl: sgl-router (tpupod[sgl]) on worker 0
    health_interval: float = defaults.HEALTH_INTERVAL_S
    restart_backoff: float = defaults.RESTART_BACKOFF_S
    hold: float = defaults.ROUTER_HOLD_S  # the builtin router's --hold
    hosts_per_replica: int = 1  # >1: each run of K workers serves one replica in lockstep
    mesh: str | None = None  # model=M across a replica's devices


def up_options(
    backend: str, policy: str | None, router: str = defaults.ROUTER, **given: Any
) -> UpOptions:
    """``serve up``'s options from flag values: the backend, router and policy named as
    strings (no policy: the router's default)."""
    # serve up's options only: serve status reads the record without the routers
    from tpupod.serve.router.server import Policy
    from tpupod.serve.router.sgl import POLICIES  # serve up only, as above

    policies = {"builtin": [p.value for p in Policy], "sgl": list(POLICIES)}
    if router not in policies:
        raise UsageError(f"no router {router!r}", hint="--router builtin or --router sgl")
    policy = policy or (defaults.POLICY if router == "builtin" else defaults.SGL_POLICY)
    if policy not in policies[router]:
        raise UsageError(
            f"the {router} router has no policy {policy!r}",
            hint=f"--policy {' or '.join(policies[router])}",
        )
    try:
        chosen = Backend(backend)
    except ValueError as exc:
        raise UsageError(str(exc), hint="see 'tpupod serve up --help'") from None
    hold = given.pop("hold", None)  # None: not given (sgl-router holds nothing)
    if hold is not None and (not 0 <= hold <= 3600 or router == "sgl"):
        raise UsageError(
            f"--hold {hold:g}" + (" is the builtin router's" if router == "sgl" else ""),
            hint="seconds from 0 (503 at once) to 3600, with --router builtin",
        )
    if hold is not None:
        given["hold"] = hold
    options = UpOptions(backend=chosen, policy=policy, router=router, **given)
    _check_ports(options)
    return options


def _check_ports(options: UpOptions) -> None:
    """Refuse a port no socket can have before anything starts (a server on :65536 sat
    'starting' until --startup-timeout, and a local pod ignores --agent-port)."""
    servers = options.servers_per_worker
    if servers < 1:
        raise UsageError(
            f"--servers-per-worker {servers}: a worker runs at least 1 server",
            hint="leave it out for 1 a worker, or give how many each worker runs",
        )
    last = options.base_port + servers - 1
    given = [("--base-port", options.base_port, last), ("--agent-port", options.agent_port, 0)]
    given += [("--router-port", options.router_port, 0)] if options.router_port is not None else []
    for flag, port, end in given:
        if not (1 <= port <= 65535 and end <= 65535):
            reach = f": with {servers} servers per worker the last port would be {end}"
            raise UsageError(
                f"{flag} {port}{reach if 1 <= port <= 65535 else ''}",
                hint="ports are 1 to 65535",
            )


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


def record_path(state: StateDir, pod: str) -> Path:
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
