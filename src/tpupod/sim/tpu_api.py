"""A local stand-in of the Cloud TPU REST API, for tests: nodes, queued resources, operations.

It answers the v2 and v2alpha1 paths the ``google-cloud-tpu`` client uses over
REST, keeps resources in memory, and moves them through the states the real
API reports, one step every ``steps`` reads (nodes: CREATING, READY; queued
resources: WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE). New nodes take their
workers' addresses from ``endpoints`` (for example the hosts of a simulated
pod), and the ``ssh-keys`` metadata is handed to ``on_ssh_keys``, as the
guest agent of a real TPU VM would install it. ``fail(...)`` makes the next
matching call fail with an API error; ``preempt(name)`` preempts a node.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from tpupod.accelerators import all_names, lookup

NODE_TYPE = "type.googleapis.com/google.cloud.tpu.{version}.Node"
QR_TYPE = "type.googleapis.com/google.cloud.tpu.{version}.QueuedResource"
EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"
PATH_RE = re.compile(
    r"^/(?P<version>v2|v2alpha1)/projects/(?P<project>[^/]+)/locations/(?P<zone>[^/]+)"
    r"/(?P<kind>nodes|queuedResources|operations|acceleratorTypes)(?:/(?P<name>[^/:?]+))?$"
)
STATUS_CODES = {
    "INVALID_ARGUMENT": 400,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
}


@dataclass
class _Resource:
    data: dict[str, Any]
    states: tuple[str, ...]
    reads: int = 0
    children: list[str] = field(default_factory=list)  # a queued resource's nodes


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
        self.resources: dict[str, _Resource] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.failures: list[tuple[str, str, str, str]] = []  # (method, kind, status, message)
        self.calls: list[tuple[str, str]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # -- control, for tests -----------------------------------------------------------

    def start(self) -> str:
        """Serve on a free loopback port; returns the endpoint URL for the client."""
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def fail(self, method: str, kind: str, status: str, message: str) -> None:
        """Make the next ``method`` on ``kind`` (nodes, queuedResources) fail with ``status``."""
        self.failures.append((method, kind, status, message))

    def preempt(self, node_name: str) -> None:
        with self._lock:
            for key, resource in self.resources.items():
                if key.endswith(f"/nodes/{node_name}"):
                    resource.data["state"] = "PREEMPTED"
                    resource.states = ("PREEMPTED",)

    # -- the API ----------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        match = PATH_RE.match(path)
        if match is None:
            return _error("NOT_FOUND", f"no such path {path}")
        kind, name = match["kind"], match["name"]
        parent = f"projects/{match['project']}/locations/{match['zone']}"
        self.calls.append((method, f"{kind}/{name or ''}"))
        for i, (f_method, f_kind, status, message) in enumerate(self.failures):
            if f_method == method and f_kind == kind:
                del self.failures[i]
                return _error(status, message)
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
                return (200, op) if op else _error("NOT_FOUND", f"operation {name} not found")
            full = f"{parent}/{kind}/{name}" if name else None
            if method == "GET" and full:
                return self._get(full)
            if method == "GET":
                items = [self._read(k) for k in self.resources if k.startswith(f"{parent}/{kind}/")]
                return 200, {kind: items}
            if method == "POST" and not name:
                new_id = query.get("nodeId") or query.get("queuedResourceId") or ""
                return self._create(parent, kind, new_id, body, match["version"])
            if method == "DELETE" and full:
                return self._delete(parent, full)
        return _error("INVALID_ARGUMENT", f"unsupported {method} {path}")

    def _get(self, full: str) -> tuple[int, Any]:
        if full not in self.resources:
            return _error("NOT_FOUND", f"Resource '{full}' was not found")
        return 200, self._read(full)

    def _read(self, full: str) -> dict[str, Any]:
        """Each read moves a resource one step closer to its final state."""
        resource = self.resources[full]
        resource.reads += 1
        state = resource.states[min(len(resource.states) - 1, resource.reads // self.steps)]
        if "/queuedResources/" in full:
            resource.data["state"] = {"state": state}
            if state == "ACTIVE" and not resource.children:
                resource.children = self._make_nodes(resource.data)
        else:
            resource.data["state"] = state
        return resource.data

    def _create(
        self, parent: str, kind: str, new_id: str, body: dict[str, Any], version: str
    ) -> tuple[int, Any]:
        full = f"{parent}/{kind}/{new_id}"
        if full in self.resources:
            return _error("ALREADY_EXISTS", f"Resource '{full}' already exists")
        if kind == "nodes":
            node = self._node(parent, new_id, body)
            if node is None:
                return _error("RESOURCE_EXHAUSTED", "not enough addresses in the stand-in")
            self.resources[full] = _Resource(node, ("CREATING", "READY"))
            return 200, self._operation(parent, NODE_TYPE.format(version=version), node)
        data = {"name": full, **body, "state": {"state": "CREATING"}}
        self.resources[full] = _Resource(data, ("WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"))
        return 200, self._operation(parent, QR_TYPE.format(version=version), data)

    def _make_nodes(self, qr: dict[str, Any]) -> list[str]:
        names = []
        for spec in qr["tpu"]["nodeSpec"]:
            multislice = spec.get("multisliceParams")
            ids = (
                [f"{multislice['nodeIdPrefix']}-{i}" for i in range(int(multislice["nodeCount"]))]
                if multislice
                else [spec["nodeId"]]
            )
            for node_id in ids:
                node = self._node(spec["parent"], node_id, spec["node"])
                if node is not None:
                    node["state"] = "READY"
                    node["queuedResource"] = qr["name"]
                    full = f"{spec['parent']}/nodes/{node_id}"
                    self.resources[full] = _Resource(node, ("READY",))
                    names.append(full)
        return names

    def _node(self, parent: str, node_id: str, body: dict[str, Any]) -> dict[str, Any] | None:
        workers = lookup(body["acceleratorType"]).workers
        if len(self.endpoints) < workers:
            return None
        taken, self.endpoints = self.endpoints[:workers], self.endpoints[workers:]
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

    def _delete(self, parent: str, full: str) -> tuple[int, Any]:
        resource = self.resources.pop(full, None)
        if resource is None:
            return _error("NOT_FOUND", f"Resource '{full}' was not found")
        for child in resource.children:
            self._free(self.resources.pop(child, None))
        self._free(resource)
        return 200, self._operation(parent, EMPTY_TYPE, {})

    def _free(self, resource: _Resource | None) -> None:
        if resource is not None:
            for endpoint in resource.data.get("networkEndpoints", []):
                self.endpoints.append(
                    (endpoint["ipAddress"], endpoint["accessConfig"]["externalIp"])
                )

    def _operation(self, parent: str, type_url: str, response: dict[str, Any]) -> dict[str, Any]:
        name = f"{parent}/operations/operation-{next(self._ids)}"
        operation = {"name": name, "done": True, "response": {"@type": type_url, **response}}
        self.operations[name] = operation
        return {"name": name, "done": False}


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
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        status, payload = self.api.handle(method, url.path, query, body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return None
