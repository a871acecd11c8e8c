"""A local stand-in of the Cloud TPU REST API, for tests: nodes, queued resources, operations.

It answers the v2 and v2alpha1 paths the ``google-cloud-tpu`` client uses over
REST, keeps resources in memory, and moves them through the states the real
API reports, one step every ``steps`` reads. New nodes take their workers'
addresses from ``endpoints`` (for example the hosts of a simulated pod), and
the ``ssh-keys`` metadata is handed to ``on_ssh_keys``, as the guest agent of a
real TPU VM would install it. ``fail(...)`` makes the next matching call fail
with an API error; ``preempt(name)`` preempts what the API would preempt (a slice of a
multislice queued resource: the whole resource). ``provision_s``: no new TPU is ready
sooner (a busy zone's provisioning).

It refuses what the real API refuses, so that a test cannot pass on a body
Google would reject:

- every body is parsed with the installed client's own types for the URL's
  version (``google.cloud.tpu_v2`` or ``tpu_v2alpha1``), unknown fields refused
  (v2alpha1 has ``bestEffort`` and ``multiNodeParams``; v2 has neither, and
  names multislice ``multisliceParams``);
- a queued resource has at most one tier: ``spot``, ``guaranteed``,
  ``bestEffort``, ``reservationName``, or a flag of a node's
  ``schedulingConfig`` (gcloud never sends the last on a queued resource);
- a reservation name has the documented form
  ``projects/P/locations/ZONE/reservations/NAME`` (``-``: any that fits), in
  the URL's zone; a node spec names the URL's parent and exactly one of
  ``nodeId`` and the multislice parameters;
- a TPU VM's ``schedulingConfig`` sets at most one of preemptible, spot, reserved.

States per tier. A node: CREATING, READY. A queued resource: CREATING,
ACCEPTED, WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, except a reserved one,
whose capacity is held for it and so never waits for resources. Only
preemptible and spot TPU VMs are preempted (PREEMPTED), and only spot and
best-effort queued resources (SUSPENDING, SUSPENDED; their nodes are deleted);
``preempt`` of anything else is a ValueError, as the API never does it.

Preemption follows GCE's notice: the hosts' metadata answers ``instance/preempted``
TRUE at once (``/computeMetadata/v1/...``, served here to whoever asks from a host's
address), ``on_notice(addresses)`` is told at once (a test sends TERM to the hosts'
processes, as the guest's shutdown does), and ``notice_s`` later ``on_reclaim(addresses)``
(KILL, the hosts taken away). ``on_provision(addresses)`` is told when hosts are handed
out to a new node (a test boots them fresh: nothing from before). ``unavailable(s)`` makes
every API call answer 503 for ``s`` seconds; ``unanswered(s)`` drops every API request
unanswered for ``s`` seconds (a cut network, a proxy that resets: the client gets no
status at all).
Resources are answered in the shape of the version asked (a best-effort queued
resource read through v2 shows no tier, and ``multisliceParams``).
"""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from google.protobuf.json_format import ParseError  # type: ignore[import-untyped]

from tpupod.pod.accelerators import all_names, lookup
from tpupod.sim import SimPod

NODE_TYPE = "type.googleapis.com/google.cloud.tpu.{version}.Node"
QR_TYPE = "type.googleapis.com/google.cloud.tpu.{version}.QueuedResource"
EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"
PATH_RE = re.compile(
    r"^/(?P<version>v2|v2alpha1)/projects/(?P<project>[^/]+)/locations/(?P<zone>[^/]+)"
    r"/(?P<kind>nodes|queuedResources|operations|acceleratorTypes)(?:/(?P<name>[^/:?]+))?$"
)
RESERVATION_RE = re.compile(
    r"^projects/[a-z][-a-z0-9]*/locations/(?P<zone>[^/]+)/reservations/(-|[a-z]([-a-z0-9]*[a-z0-9])?)$"
)
STATUS_CODES = {
    "INVALID_ARGUMENT": 400,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
}
QUEUED_TIERS = {"spot": "spot", "bestEffort": "best-effort", "reservationName": "reserved"}
MULTISLICE = {"v2": "multisliceParams", "v2alpha1": "multiNodeParams"}
NODE_STATES = ("CREATING", "READY")
READY_STATES = ("READY", "ACTIVE")
QR_STATES = ("ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE")
RESERVED_QR_STATES = ("ACCEPTED", "PROVISIONING", "ACTIVE")
PREEMPTIBLE = {"preemptible", "spot", "best-effort"}


class Refused(Exception):
    """A request the real API answers with an error: (status, message)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Resource:
    data: dict[str, Any]
    states: tuple[str, ...]
    tier: str
    reads: int = 0
    children: list[str] = field(default_factory=list)  # a queued resource's nodes
    made: float = field(default_factory=time.monotonic)


class TpuApiStandIn:
    def __init__(
        self,
        endpoints: list[tuple[str, str]],
        steps: int = 2,
        on_ssh_keys: Callable[[str], None] | None = None,
        offered: dict[str, list[str]] | None = None,
    ) -> None:
        self.endpoints = list(endpoints)  # (internal, external) for each new worker, in order
        self.steps = steps
        self.on_ssh_keys = on_ssh_keys or (lambda keys: None)
        self.offered = offered or {}  # zone -> types it offers (a zone not named offers all)
        self.notice_s = 0.0  # from a preemption's notice to its hosts taken away
        self.on_notice: Callable[[list[str]], None] = lambda addresses: None
        self.on_reclaim: Callable[[list[str]], None] = lambda addresses: None
        self.on_provision: Callable[[list[str]], None] = lambda addresses: None
        self.preempted: set[str] = set()  # internal addresses whose metadata says TRUE
        self.generation: dict[str, int] = {}  # address -> how many times it was handed out
        self.preemptions = 0
        self.unavailable_until = 0.0
        self.unavailable_answers = 0  # calls answered 503 by ``unavailable``
        self.unanswered_until = 0.0
        self.dropped = 0  # requests dropped unanswered by ``unanswered``
        self.no_capacity = 0  # polls a new queued resource stays WAITING_FOR_RESOURCES
        self.provision_s = 0.0  # a new TPU is not ready before this many seconds
        self.tpu_env_override: dict[str, str] = {}  # tpu-env values a test makes wrong
        self.resources: dict[str, _Resource] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.failures: list[tuple[str, str, str, str]] = []  # (method, kind, status, message)
        self.calls: list[tuple[str, str]] = []
        self.invalid: list[str] = []  # the messages of requests refused as invalid, in order
        self._ids = itertools.count(1)
        self._timers: list[threading.Timer] = []  # reclaims still to come
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # -- control, for tests -----------------------------------------------------------

    def start(self, host: str = "127.0.0.1") -> str:
        """Serve on a free port (of ``host``: "0.0.0.0" lets simulated hosts ask their
        metadata); returns the endpoint URL for the client."""
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = ThreadingHTTPServer((host, 0), handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def unavailable(self, seconds: float) -> None:
        """Answer every API call with 503 UNAVAILABLE for ``seconds`` from now."""
        self.unavailable_until = time.monotonic() + seconds

    def unanswered(self, seconds: float) -> None:
        """Drop every API request unanswered (the connection closed) for ``seconds``."""
        self.unanswered_until = time.monotonic() + seconds

    def alive(self) -> list[str]:
        """The names of the TPUs that exist (queued resources and nodes)."""
        return [key.rsplit("/", 1)[-1] for key in self.resources]

    def stop(self) -> None:
        for timer in self._timers:
            timer.cancel()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def fail(self, method: str, kind: str, status: str, message: str) -> None:
        """Make the next ``method`` on ``kind`` (nodes, queuedResources) fail with ``status``."""
        self.failures.append((method, kind, status, message))

    def tier(self, name: str) -> str:
        """The capacity the API understood for a TPU: on-demand, spot, reserved, ..."""
        return self._find(name)[1].tier

    def preempt(self, name: str) -> None:
        """Preempt a TPU as the API would; a tier the API never preempts is a ValueError."""
        with self._lock:
            _, resource = self._whole(name)
            if resource.tier not in PREEMPTIBLE:
                raise ValueError(f"{name} is {resource.tier}: the API never preempts it")
            if "tpu" not in resource.data:
                resource.data["state"] = "PREEMPTED"
                resource.states = ("PREEMPTED",)
                return
            resource.states, resource.reads = ("SUSPENDING", "SUSPENDED"), 0
            for child in resource.children:
                self._free(self.resources.pop(child, None))
            resource.children = []

    def preempt_with_notice(self, name: str) -> list[str]:
        """Preempt as GCE does (see the module's text): metadata TRUE, notice, then after
        ``notice_s`` the hosts killed and taken away. Returns the hosts' addresses."""
        with self._lock:
            _, resource = self._whole(name)
            nodes = [self.resources[c] for c in resource.children] or [resource]
            addresses = [
                e["ipAddress"] for node in nodes for e in node.data.get("networkEndpoints", [])
            ]
            self.preempted.update(addresses)
            self.preemptions += 1
        self.preempt(name)
        self.on_notice(addresses)
        handed = {address: self.generation.get(address, 0) for address in addresses}
        timer = threading.Timer(self.notice_s, self._reclaim, (handed,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return addresses

    def _reclaim(self, handed: dict[str, int]) -> None:
        """The notice is over: the hosts go, unless a new TPU got them meanwhile."""
        with self._lock:
            gone = [a for a, n in handed.items() if self.generation.get(a, 0) == n]
        self.on_reclaim(gone)

    def metadata(self, path: str, caller: str) -> tuple[int, str]:
        """A host's metadata server: ``instance/preempted`` (TRUE once its TPU is preempted)
        and ``instance/attributes/tpu-env`` (see ``tpu_env``)."""
        if path.rstrip("/").endswith("/instance/preempted"):
            return 200, "TRUE" if caller in self.preempted else "FALSE"
        if path.rstrip("/").endswith("/instance/attributes/tpu-env"):
            with self._lock:
                text = self.tpu_env(caller)
            return (200, text) if text is not None else (404, "not found")
        return 404, "not found"

    def tpu_env(self, address: str) -> str | None:
        """The ``tpu-env`` a TPU VM at ``address`` reads, as GCP writes it (``KEY: 'value'``
        lines): its node and worker, and on a slice of a multislice queued resource the
        ``MEGASCALE_*`` values (slice 0's worker 0 coordinates, port 8080), with
        ``tpu_env_override`` over them."""
        for key, resource in self.resources.items():
            endpoints = [e["ipAddress"] for e in resource.data.get("networkEndpoints", [])]
            if "/nodes/" not in key or address not in endpoints:
                continue
            node_id = key.rsplit("/", 1)[-1]
            values = {
                "ACCELERATOR_TYPE": resource.data["acceleratorType"],
                "NODE_ID": node_id,
                "WORKER_ID": str(endpoints.index(address)),
                "ZONE": key.split("/locations/", 1)[1].split("/", 1)[0],
            }
            owner = self.resources.get(resource.data.get("queuedResource", ""))
            siblings = owner.children if owner is not None else []
            if len(siblings) > 1:
                first = self.resources[siblings[0]].data["networkEndpoints"][0]["ipAddress"]
                values |= {
                    "MEGASCALE_COORDINATOR_ADDRESS": f"{first}:8080",
                    "MEGASCALE_NUM_SLICES": str(len(siblings)),
                    "MEGASCALE_SLICE_ID": str(siblings.index(key)),
                    "MEGASCALE_PORT": "8080",
                }
            values |= self.tpu_env_override
            return "".join(f"{k}: '{v}'\n" for k, v in sorted(values.items()))
        return None

    def _whole(self, name: str) -> tuple[str, _Resource]:
        """What the API preempts for ``name``: a slice of a queued resource preempts the
        whole resource (GCP suspends it whole); a TPU of its own, itself."""
        key, resource = self._find(name)
        owner = resource.data.get("queuedResource")
        return (owner, self.resources[owner]) if owner in self.resources else (key, resource)

    def _find(self, name: str) -> tuple[str, _Resource]:
        """A queued resource by its id, else a node."""
        for kind in ("queuedResources", "nodes"):
            for key, resource in self.resources.items():
                if key.endswith(f"/{kind}/{name}"):
                    return key, resource
        raise KeyError(name)

    # -- the API ----------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        try:
            return self._handle(method, path, query, body)
        except Refused as exc:
            if exc.status == "INVALID_ARGUMENT":
                self.invalid.append(str(exc))
            return _error(exc.status, str(exc))

    def _handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        match = PATH_RE.match(path)
        if match is None:
            raise Refused("NOT_FOUND", f"no such path {path}")
        kind, name, version = match["kind"], match["name"], match["version"]
        parent = f"projects/{match['project']}/locations/{match['zone']}"
        self.calls.append((method, f"{kind}/{name or ''}"))
        if time.monotonic() < self.unavailable_until:
            self.unavailable_answers += 1
            raise Refused("UNAVAILABLE", "The service is currently unavailable.")
        for i, (f_method, f_kind, status, message) in enumerate(self.failures):
            if f_method == method and f_kind == kind:
                del self.failures[i]
                raise Refused(status, message)
        with self._lock:
            if kind == "acceleratorTypes" and method == "GET":
                types = self.offered.get(match["zone"], all_names())
                return 200, {
                    "acceleratorTypes": [
                        {"name": f"{parent}/acceleratorTypes/{t}", "type": t} for t in types
                    ]
                }
            if kind == "operations" and name:
                op = self.operations.get(f"{parent}/operations/{name}")
                if op is None:
                    raise Refused("NOT_FOUND", f"operation {name} not found")
                return 200, op
            full = f"{parent}/{kind}/{name}" if name else None
            if method == "GET" and full:
                return 200, self._read(self._get(full), version)
            if method == "GET":
                keys = [k for k in self.resources if k.startswith(f"{parent}/{kind}/")]
                return 200, {kind: [self._read(k, version) for k in keys]}
            if method == "POST" and not name:
                new_id = query.get("nodeId") or query.get("queuedResourceId") or ""
                return 200, self._create(parent, kind, new_id, body, version)
            if method == "DELETE" and full:
                return 200, self._delete(parent, self._get(full))
        raise Refused("INVALID_ARGUMENT", f"unsupported {method} {path}")

    def _get(self, full: str) -> str:
        if full not in self.resources:
            raise Refused("NOT_FOUND", f"Resource '{full}' was not found")
        return full

    def _read(self, full: str, version: str) -> dict[str, Any]:
        """Each read moves a resource one step closer to its final state."""
        resource = self.resources[full]
        resource.reads += 1
        step = min(len(resource.states) - 1, resource.reads // self.steps)
        provisioning = time.monotonic() - resource.made < self.provision_s
        if provisioning and len(resource.states) > 1 and resource.states[-1] in READY_STATES:
            step = min(step, len(resource.states) - 2)
        state = resource.states[step]
        waited = state in QR_STATES[2:] and resource.states == QR_STATES
        if waited and self.no_capacity and not resource.children:
            self.no_capacity -= 1  # held back: no capacity yet
            resource.reads -= 1
            state = "WAITING_FOR_RESOURCES"
        if "/queuedResources/" in full:
            resource.data["state"] = {"state": state}
            if state == "ACTIVE" and not resource.children:
                resource.children = self._make_nodes(resource)
        else:
            resource.data["state"] = state
        return _render(resource.data, version)

    def _create(
        self, parent: str, kind: str, new_id: str, body: Any, version: str
    ) -> dict[str, Any]:
        if not new_id:
            raise Refused("INVALID_ARGUMENT", f"the {kind} id is required")
        _parse(kind, body, version)
        full = f"{parent}/{kind}/{new_id}"
        if full in self.resources:
            raise Refused("ALREADY_EXISTS", f"Resource '{full}' already exists")
        if kind == "nodes":
            tier = _node_tier(body.get("schedulingConfig", {}))
            node = self._node(parent, new_id, body)
            self.resources[full] = _Resource(node, NODE_STATES, tier)
            return self._operation(parent, NODE_TYPE.format(version=version), node, version)
        tier = _check_queued(parent, body, version)
        data = {"name": full, **body, "state": {"state": "CREATING"}}
        states = RESERVED_QR_STATES if tier == "reserved" else QR_STATES
        self.resources[full] = _Resource(data, states, tier)
        return self._operation(parent, QR_TYPE.format(version=version), data, version)

    def _make_nodes(self, qr: _Resource) -> list[str]:
        names = []
        for spec in qr.data["tpu"]["nodeSpec"]:
            params = spec.get("multisliceParams") or spec.get("multiNodeParams")
            ids = (
                [f"{params['nodeIdPrefix']}-{i}" for i in range(int(params["nodeCount"]))]
                if params
                else [spec["nodeId"]]
            )
            for node_id in ids:
                try:
                    node = self._node(spec["parent"], node_id, spec["node"])
                except Refused:
                    continue
                node["state"] = "READY"
                node["queuedResource"] = qr.data["name"]
                full = f"{spec['parent']}/nodes/{node_id}"
                self.resources[full] = _Resource(node, ("READY",), qr.tier)
                names.append(full)
        return names

    def _node(self, parent: str, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        workers = lookup(body["acceleratorType"]).workers
        if len(self.endpoints) < workers:
            raise Refused("RESOURCE_EXHAUSTED", "not enough addresses in the stand-in")
        taken, self.endpoints = self.endpoints[:workers], self.endpoints[workers:]
        self.preempted.difference_update(internal for internal, _ in taken)
        for internal, _ in taken:
            self.generation[internal] = self.generation.get(internal, 0) + 1
        self.on_provision([internal for internal, _ in taken])
        keys = body.get("metadata", {}).get("ssh-keys")
        if keys:
            self.on_ssh_keys(keys)
        endpoints = [
            {"ipAddress": internal, "port": 8470, "accessConfig": {"externalIp": external}}
            for internal, external in taken
        ]
        return {
            **body,
            "name": f"{parent}/nodes/{node_id}",
            "state": "CREATING",
            "networkEndpoints": endpoints,
        }

    def _delete(self, parent: str, full: str) -> dict[str, Any]:
        resource = self.resources.pop(full)
        for child in resource.children:
            self._free(self.resources.pop(child, None))
        self._free(resource)
        return self._operation(parent, EMPTY_TYPE, {}, "")

    def _free(self, resource: _Resource | None) -> None:
        if resource is not None:
            for endpoint in resource.data.get("networkEndpoints", []):
                self.endpoints.append(
                    (endpoint["ipAddress"], endpoint["accessConfig"]["externalIp"])
                )

    def _operation(
        self, parent: str, type_url: str, response: dict[str, Any], version: str
    ) -> dict[str, Any]:
        name = f"{parent}/operations/operation-{next(self._ids)}"
        shown = _render(response, version) if version else response
        operation = {"name": name, "done": True, "response": {"@type": type_url, **shown}}
        self.operations[name] = operation
        return {"name": name, "done": False}


def _parse(kind: str, body: Any, version: str) -> None:
    """Parse a body with the client's own types for ``version``, refusing unknown fields."""
    module = importlib.import_module(f"google.cloud.tpu_{version}")
    message = module.Node if kind == "nodes" else module.QueuedResource
    try:
        message.from_json(json.dumps(body), ignore_unknown_fields=False)
    except (ParseError, TypeError, ValueError) as exc:
        raise Refused("INVALID_ARGUMENT", f"Invalid JSON payload received. {exc}") from None


def _node_tier(scheduling: dict[str, Any]) -> str:
    flags = [flag for flag, on in scheduling.items() if on]
    if len(flags) > 1:
        raise Refused("INVALID_ARGUMENT", f"schedulingConfig sets {' and '.join(flags)}: pick one")
    return flags[0] if flags else "on-demand"


def _check_queued(parent: str, body: dict[str, Any], version: str) -> str:
    """A queued resource's tier, once its node specs and reservation name are checked."""
    specs = body.get("tpu", {}).get("nodeSpec", [])
    if not specs:
        raise Refused("INVALID_ARGUMENT", "tpu.nodeSpec is required")
    tiers = [name for name in (*QUEUED_TIERS, "guaranteed") if name in body]
    for spec in specs:
        if spec.get("parent") != parent:
            raise Refused("INVALID_ARGUMENT", f"nodeSpec.parent must be {parent}")
        if ("nodeId" in spec) == (MULTISLICE[version] in spec):
            raise Refused(
                "INVALID_ARGUMENT", f"a nodeSpec takes one of nodeId and {MULTISLICE[version]}"
            )
        if "acceleratorType" not in spec.get("node", {}):
            raise Refused("INVALID_ARGUMENT", "nodeSpec.node.acceleratorType is required")
        scheduling = spec["node"].get("schedulingConfig", {})
        tiers += [f"node.schedulingConfig.{flag}" for flag, on in scheduling.items() if on]
    if len(tiers) > 1:
        raise Refused(
            "INVALID_ARGUMENT", f"a queued resource has one tier; got {' and '.join(tiers)}"
        )
    reservation = body.get("reservationName")
    if reservation is not None:
        match = RESERVATION_RE.match(reservation)
        if match is None or f"locations/{match['zone']}" not in parent:
            raise Refused(
                "INVALID_ARGUMENT",
                f"reservationName {reservation!r} is not "
                f"projects/PROJECT/locations/{parent.rsplit('/', 1)[-1]}/reservations/NAME",
            )
    if not tiers:
        return "on-demand"
    if tiers[0] == "guaranteed":
        return "reserved" if body["guaranteed"].get("reserved") else "guaranteed"
    return QUEUED_TIERS.get(tiers[0], tiers[0])


def _render(data: dict[str, Any], version: str) -> dict[str, Any]:
    """A resource as the API shows it through ``version`` (checked with that version's types)."""
    shown = copy.deepcopy(data)
    for spec in shown.get("tpu", {}).get("nodeSpec", []):
        params = spec.pop("multisliceParams", None) or spec.pop("multiNodeParams", None)
        if params:
            keep = ("nodeCount", "nodeIdPrefix") if version == "v2" else tuple(params)
            spec[MULTISLICE[version]] = {key: params[key] for key in keep if key in params}
    if version == "v2":
        shown.pop("bestEffort", None)
        shown.get("guaranteed", {}).pop("reserved", None)
    _parse("nodes" if "tpu" not in shown else "queuedResources", shown, version)
    return shown


def _error(status: str, message: str) -> tuple[int, Any]:
    code = STATUS_CODES.get(status, 500)
    return code, {"error": {"code": code, "message": message, "status": status}}


class _Handler(BaseHTTPRequestHandler):
    api: TpuApiStandIn

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        url = urlparse(self.path)
        if url.path.startswith("/computeMetadata/"):
            code, text = self.api.metadata(url.path, self.client_address[0])
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/text")
            self.send_header("Metadata-Flavor", "Google")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if time.monotonic() < self.api.unanswered_until:
            self.api.dropped += 1
            self.close_connection = True  # no status line: the client sees the connection go
            return
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length)) if length else {}
        except ValueError as exc:
            status, payload = _error("INVALID_ARGUMENT", f"Invalid JSON payload received. {exc}")
        else:
            status, payload = self.api.handle(method, url.path, query, body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return None


def on_sim_hosts(sim: SimPod, notice_s: float, steps: int = 2) -> TpuApiStandIn:
    """A stand-in that hands out ``sim``'s hosts as TPU workers and preempts them as GCE
    does: a new TPU's hosts are booted fresh (nothing from before), a notice TERMs every
    process on them (sshd's own aside), and ``notice_s`` later they are taken down."""
    index = {h.address: h.index for h in sim.hosts}
    api = TpuApiStandIn([(h.address, h.address) for h in sim.hosts], steps, sim.authorize)
    api.notice_s = notice_s

    def provision(addresses: list[str]) -> None:
        for address in addresses:
            sim.stop_host(index[address])
            sim.start_host(index[address])
        sim.wait_ready([index[a] for a in addresses])

    def on_notice(addresses: list[str]) -> None:
        for address in addresses:
            pids = " ".join(str(pid) for pid, _ in sim.processes(index[address]))
            if pids:
                sim.run_on(index[address], f"kill -TERM {pids} 2>/dev/null; true")

    def on_reclaim(addresses: list[str]) -> None:
        for address in addresses:
            sim.stop_host(index[address])

    api.on_provision, api.on_notice, api.on_reclaim = provision, on_notice, on_reclaim
    return api
