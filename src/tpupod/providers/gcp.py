"""The GCP provider: Cloud TPU VMs and queued resources, then SSH to their workers.

``up`` makes a key pair for the pod (or takes ``key:``), puts its public half
in the node's ``ssh-keys`` metadata, creates the TPU through whichever API
fits (see ``gcp_api``), follows its states until READY/ACTIVE, and records
every worker's internal and external address, slice by slice. ``down``
deletes it and waits. Workers are then reached over the SSH transport, with
no gcloud anywhere. Credentials are Application Default Credentials; with
``TPUPOD_TPU_API_ENDPOINT`` set (tests), another endpoint is used anonymously.
Credentials and the client are made once per provider (``TpuSession``) and
shared by every call, the state polls included. The client library is the
``gcp`` extra, imported only here and only when a call is made.

Every request has a deadline (``CALL_TIMEOUT_S``), and the provider repeats one that
fails for a passing reason (a 5xx, a timeout, no connection) with backoff, for the
probe budget (``TPUPOD_RECOVERY_PROBE_S``, 120 s): an API outage of a minute costs a
recovery, ``up`` or ``down`` that minute, not the TPU. A TPU the API no longer has is
the state ``GONE``, not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import importlib
import json
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tpupod import settings
from tpupod.errors import GcpError, GcpRefused, UsageError
from tpupod.extras import require
from tpupod.fanout.report import notice
from tpupod.pod.record import Pod, Worker
from tpupod.pod.spec import GcpPodSpec, PodSpec, SshHost
from tpupod.pod.state import StateDir
from tpupod.providers.gcp_api import (
    API_ROOT,
    BROKEN,
    GONE,
    READY,
    check_api_choice,
    create_request,
    parent,
    worst_state,
)
from tpupod.providers.ssh import check_key_file, connect_options
from tpupod.transport.ssh import SshConnector, SshPool, generate_key, probe, public_key_line

KEY_FILE = "id_ed25519"
WAIT_S = 3600.0
MAX_POLL_S = 30.0  # the longest pause between two reads of a TPU's state
CALL_TIMEOUT_S = 60.0  # one request: a hung connection is a failed try, not a hung command
MAX_BACKOFF_S = 10.0
T = TypeVar("T")


class GcpProvider:
    def __init__(
        self, progress: Callable[[str], None] = notice, session: TpuSession | None = None
    ) -> None:
        self.progress = progress
        self.session = session or TpuSession()

    async def create(self, spec: PodSpec, state: StateDir, *, recreate: bool = False) -> Pod:
        assert isinstance(spec, GcpPodSpec)
        check_api_choice(spec)
        if spec.key:
            await asyncio.to_thread(check_key_file, spec.key)
        spec = spec.model_copy(update={"project": self.session.project(spec.project)})
        apis = [TpuApi(tpu, self.session) for tpu in spec.tpus()]
        if not spec.adopted:
            await self._call(apis[0].check_zone_offers)
            made = await self._to_make(apis, spec, state, recreate)
            await self._make(made, _pod_key(spec, state))
            await asyncio.gather(*(self._wait(api, api.spec) for api in apis if api not in made))
        else:
            await self._wait(apis[0], spec)
        nodes = [node for api in apis for node in await self._call(api.nodes)]
        workers = await _workers(spec, state, list(enumerate(nodes)), self.progress)
        return Pod(name=spec.name, spec=spec, workers=tuple(workers))

    async def delete_slices(self, pod: Pod, slices: Sequence[int]) -> None:
        """Delete the TPUs of ``slices`` (a pod of separate slices), the others untouched."""
        apis = self._slice_apis(pod, slices)
        names = ", ".join(api.spec.name for api in apis)
        self.progress(f"deleting {names} (slice {', '.join(map(str, slices))} of {pod.slices})")
        await asyncio.gather(*(self._delete(api) for api in apis))

    async def make_slices(
        self, pod: Pod, state: StateDir, slices: Sequence[int], made_ok: bool = False
    ) -> Pod:
        """The pod with the TPUs of ``slices`` made again (deleted first: ``delete_slices``);
        the other slices' workers keep their ids and addresses, and the pod its uid.
        ``made_ok``: one being made already is waited for, not an error."""
        apis = self._slice_apis(pod, slices)
        assert isinstance(pod.spec, GcpPodSpec)
        names = ", ".join(api.spec.name for api in apis)
        self.progress(f"creating {names} again in {pod.spec.zone}")
        await self._make(apis, _pod_key(pod.spec, state), made_ok)
        nodes = [
            (k, node)
            for k, api in zip(slices, apis, strict=True)
            for node in await self._call(api.nodes)
        ]
        new = await _workers(pod.spec, state, nodes, self.progress)
        kept = [w for w in pod.workers if w.slice not in slices]
        workers = tuple(sorted([*kept, *new], key=lambda w: w.id))
        return pod.model_copy(update={"workers": workers})

    def _slice_apis(self, pod: Pod, slices: Sequence[int]) -> list[TpuApi]:
        assert isinstance(pod.spec, GcpPodSpec) and pod.spec.slices > 1
        tpus = pod.spec.tpus()
        return [TpuApi(tpus[k], self.session) for k in slices]

    async def destroy(self, pod: Pod, state: StateDir) -> None:
        assert isinstance(pod.spec, GcpPodSpec)
        if pod.spec.adopted:
            self.progress(f"{pod.name!r} was adopted: forgetting it, not deleting the TPU")
            return
        what = pod.spec.tpu_type + (f" x {pod.spec.slices}" if pod.spec.slices > 1 else "")
        self.progress(f"deleting {what} {pod.name!r} in {pod.spec.zone}")
        apis = [TpuApi(tpu, self.session) for tpu in pod.spec.tpus()]
        await asyncio.gather(*(self._delete(api) for api in apis))

    async def live_state(self, pod: Pod) -> str | None:
        """The TPU's state (``GONE`` when the API has no such TPU), read once: callers
        that must know retry it themselves, and a watch simply reads again later. A pod of
        separate slices: the state of its worst slice (see ``slice_states``)."""
        return worst_state(await self.slice_states(pod))

    async def slice_states(self, pod: Pod) -> list[str]:
        """Each of the pod's TPUs' state, in slice order (one, unless its slices are
        separate TPUs), read at once."""
        assert isinstance(pod.spec, GcpPodSpec)
        apis = [TpuApi(tpu, self.session) for tpu in pod.spec.tpus()]
        found = await asyncio.gather(*(asyncio.to_thread(api.state_or_none) for api in apis))
        return [GONE if state is None else state for state in found]

    async def _make(self, apis: list[TpuApi], key_line: str, made_ok: bool = False) -> None:
        """Create the TPUs and wait until each is ready. When one of several fails, those
        made by this call are deleted (a pod is never left half made) and its error raised.
        ``made_ok``: a TPU that exists already (a dead launcher's create) is waited for."""

        async def make(api: TpuApi) -> None:
            try:
                await self._call(lambda: api.create(f"{api.spec.user}:{key_line}"), _already_made)
            except GcpError as exc:
                if not (made_ok and _already_made(exc)):
                    raise
            await self._wait(api, api.spec)

        outcomes = await asyncio.gather(*(make(api) for api in apis), return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if not failed:
            return
        if len(apis) > 1:
            names = ", ".join(api.spec.name for api in apis)
            self.progress(f"{failed[0]}; deleting what this call made ({names})")
            await asyncio.gather(*(self._delete(api) for api in apis), return_exceptions=True)
        raise failed[0]

    async def _call(
        self, call: Callable[[], T], went_through: Callable[[GcpError], bool] | None = None
    ) -> T:
        """``call()`` in a thread, again with backoff while it fails for a passing reason (a
        5xx, a timeout, no connection) until the probe budget is spent. ``went_through``:
        after a retry, an error it accepts means an earlier try did the work (then None)."""
        budget = settings.recovery_probe()[0]
        started = time.monotonic()
        tries = 0
        while True:
            try:
                result = await asyncio.to_thread(call)
            except GcpError as exc:
                if tries and went_through is not None and went_through(exc):
                    return None  # type: ignore[return-value]
                spent = time.monotonic() - started
                if not _passing(exc) or spent >= budget:
                    raise _after_retries(exc, spent) if tries else exc  # noqa: B904
                if not tries:
                    self.progress(f"{str(exc).rstrip('.')}; retrying for up to {budget:.0f}s")
                await asyncio.sleep(min(_backoff(tries), budget - spent))
                tries += 1
                continue
            if tries:
                waited = time.monotonic() - started
                self.progress(f"the Cloud TPU API answers again (after {waited:.0f}s)")
            return result

    async def _delete(self, api: TpuApi) -> None:
        """Delete the TPU and wait until its operation is done (a TPU already gone: done)."""
        operation = await self._call(api.delete)
        started = time.monotonic()
        delay = settings.gcp_poll_s()
        while operation is not None and not await self._call(lambda: api.operation_done(operation)):
            if time.monotonic() - started > WAIT_S:
                raise GcpError(
                    f"TPU {api.spec.name!r} not deleted after {WAIT_S:.0f}s",
                    hint=f"'tpupod status --tpu {api.spec.name} --zone {api.spec.zone}' shows it",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, MAX_POLL_S)

    async def _to_make(
        self, apis: list[TpuApi], spec: GcpPodSpec, state: StateDir, recreate: bool
    ) -> list[TpuApi]:
        """The pod's TPUs to create (see ``_make_room``). ``up --recreate`` of a pod of
        separate slices makes only the broken or gone ones again and keeps the others;
        when none is broken, it is refused as for one TPU."""
        if not (recreate and spec.slices > 1 and state.exists(spec.name)):
            for api in apis:
                await self._make_room(api, spec, state, recreate)
            return apis
        states = [await self._call(api.state_or_none) for api in apis]
        lost = [
            api for api, found in zip(apis, states, strict=True) if found is None or found in BROKEN
        ]
        if not lost:
            await self._make_room(apis[0], spec, state, recreate)  # raises: it is healthy
        for api, found in zip(apis, states, strict=True):
            if api in lost:
                await self._make_room(api, spec, state, recreate)
            else:
                self.progress(f"{api.spec.name}: {found}; kept")
        return lost

    async def _make_room(
        self, api: TpuApi, spec: GcpPodSpec, state: StateDir, recreate: bool
    ) -> None:
        """An existing TPU of ``api``'s name (the pod's, or one of its slices'): deleted if
        broken and --recreate, else an error (before anything is changed)."""
        found = await self._call(api.state_or_none)
        tpu = api.spec.name
        if found is None:
            return
        if found in BROKEN and recreate:
            self.progress(f"{tpu}: {found}; deleting it to create it again")
            await self._delete(api)
            return
        if found in BROKEN:
            raise GcpError(
                f"TPU {tpu!r} exists and is {found}",
                hint="'tpupod up --recreate' deletes it and creates it again",
            )
        if recreate and state.exists(spec.name):
            raise GcpError(
                f"TPU {tpu!r} is {found}: --recreate replaces a preempted or failed one",
                hint=f"it is not broken; to replace it anyway: 'tpupod down --pod {spec.name}', "
                f"then '{spec.up_command()}'",
            )
        raise GcpError(
            f"a TPU named {tpu!r} already exists ({found})",
            hint=f"'tpupod up --adopt {tpu}' records it, or pick another --name"
            if tpu == spec.name
            else "pick another --name",
        )

    def connect(self, pod: Pod, state: StateDir) -> SshConnector:
        assert isinstance(pod.spec, GcpPodSpec)
        return SshConnector(SshPool(connect_options(_as_ssh(pod.spec, state), state)))

    def worker_env(self, pod: Pod, worker: Worker) -> dict[str, str]:
        return dict(pod.spec.env)

    async def _wait(self, api: TpuApi, spec: GcpPodSpec) -> None:
        """Follow the TPU's states until it is ready, showing each; while a state lasts (hours
        of WAITING_FOR_RESOURCES, say) the polls back off, up to 8 times apart, 30 s at most."""
        started = time.monotonic()
        last = None
        poll = settings.gcp_poll_s()
        delay = poll
        while time.monotonic() - started < WAIT_S:
            state = await self._call(api.state)
            if state != last:
                self.progress(f"{spec.name}: {state} ({time.monotonic() - started:.0f}s)")
                last, delay = state, poll
            else:
                delay = min(delay * 1.5, max(poll, min(MAX_POLL_S, poll * 8)))
            if state in READY:
                return
            if state in BROKEN:
                raise GcpError(
                    f"TPU {spec.name!r} is {state}",
                    hint="'tpupod up --recreate' deletes it and creates it again",
                )
            await asyncio.sleep(delay)
        raise GcpError(
            f"TPU {spec.name!r} not ready after {WAIT_S:.0f}s (last state {last})",
            hint=f"it still exists: 'tpupod status --tpu {spec.name} --zone {spec.zone}' shows it; "
            "'tpupod up --recreate' with the same flags replaces it",
        )


class TpuSession:
    """Credentials, project and clients, made on first use and then shared by every call."""

    def __init__(self) -> None:
        self._credentials: tuple[Any, str | None] | None = None
        self._clients: dict[str, Any] = {}

    def credentials(self) -> tuple[Any, str | None]:
        """(credentials, Application Default Credentials' project), looked up once."""
        if self._credentials is None:
            self._credentials = _credentials()
        return self._credentials

    def project(self, given: str | None = None) -> str:
        """``given``, else the environment's project, else Application Default Credentials'."""
        project = given or settings.gcp_project() or self.credentials()[1]
        if not project:
            raise UsageError(
                "no Google Cloud project given",
                hint="pass --project P, or run 'gcloud config set project P'",
            )
        return project

    def client(self, version: str = "v2") -> Any:
        """The API's client, made once (v2 for every call; v2alpha1 has no REST one: _post)."""
        if version not in self._clients:
            self._clients[version] = _new_client(version, self.credentials()[0])
        return self._clients[version]


class TpuApi:
    """The calls tpupod makes, through the real client; API errors become one-line GcpErrors."""

    def __init__(self, spec: GcpPodSpec, session: TpuSession | None = None) -> None:
        self.spec = spec
        self.session = session or TpuSession()
        self.parent = parent(self.session.project(spec.project), spec.zone)

    def create(self, ssh_keys: str) -> None:
        request = create_request(self.spec, self.spec.project or "", ssh_keys)
        assert request.body is not None
        module = _module(request.version)
        with _api_errors(self.spec.name):
            client = self.session.client("v2")
            if request.api.startswith("TPU VM"):
                node = module.Node.from_json(_json(request.body))
                client.create_node(
                    parent=self.parent, node_id=self.spec.name, node=node, timeout=CALL_TIMEOUT_S
                )
                return
            queued = module.QueuedResource.from_json(_json(request.body))  # the client's check
            if request.version == "v2":
                client.create_queued_resource(
                    parent=self.parent,
                    queued_resource_id=self.spec.name,
                    queued_resource=queued,
                    timeout=CALL_TIMEOUT_S,
                )
            else:
                _post(self.session, request.path, request.body)

    def state(self) -> str:
        with _api_errors(self.spec.name):
            client = self.session.client()
            if self.spec.queued:
                qr = client.get_queued_resource(
                    name=self._name("queuedResources"), timeout=CALL_TIMEOUT_S
                )
                return str(qr.state.state.name)
            return str(client.get_node(name=self._name("nodes"), timeout=CALL_TIMEOUT_S).state.name)

    def check_zone_offers(self) -> None:
        """Refuse a type the zone does not offer, naming the nearest ones it does."""
        with _api_errors(self.spec.zone):
            client = self.session.client()
            listed = client.list_accelerator_types(parent=self.parent, timeout=CALL_TIMEOUT_S)
            offered = [t.type_ for t in listed]
        if offered and self.spec.tpu_type not in offered:
            close = difflib.get_close_matches(self.spec.tpu_type, offered, n=4, cutoff=0.3)
            raise GcpError(
                f"zone {self.spec.zone} does not offer {self.spec.tpu_type}",
                hint=f"types offered there include {', '.join(close or offered[:4])}; "
                "or pick another --zone",
            )

    def state_or_none(self) -> str | None:
        """The TPU's state, or None when the API has no TPU of that name."""
        try:
            return self.state()
        except GcpError as exc:
            if isinstance(exc.__cause__, _exceptions().NotFound):
                return None
            raise

    def nodes(self) -> list[Any]:
        """The TPU's nodes in slice order (one, or one per slice of a queued resource)."""
        with _api_errors(self.spec.name):
            client = self.session.client()
            if not self.spec.queued:
                return [client.get_node(name=self._name("nodes"), timeout=CALL_TIMEOUT_S)]
            ids = (
                [f"{self.spec.name}-{i}" for i in range(self.spec.node_count)]
                if self.spec.node_count > 1
                else [self.spec.name]
            )
            return [
                client.get_node(name=f"{self.parent}/nodes/{node_id}", timeout=CALL_TIMEOUT_S)
                for node_id in ids
            ]

    def delete(self) -> str | None:
        """Ask for the TPU's deletion: the name of its operation, or None when the TPU is
        already gone (a retried delete whose first try went through finds it so)."""
        exceptions = _exceptions()
        with _api_errors(self.spec.name):
            client = self.session.client()
            try:
                if self.spec.queued:
                    operation = client.delete_queued_resource(
                        request={"name": self._name("queuedResources"), "force": True},
                        timeout=CALL_TIMEOUT_S,
                    )
                else:
                    operation = client.delete_node(name=self._name("nodes"), timeout=CALL_TIMEOUT_S)
            except exceptions.NotFound:
                return None
            return str(operation.operation.name)

    def operation_done(self, name: str) -> bool:
        """Is the operation ``name`` done? (A failed one is a GcpError.)"""
        with _api_errors(self.spec.name):
            found = self.session.client().get_operation(
                request={"name": name}, timeout=CALL_TIMEOUT_S
            )
        if found.done and found.HasField("error"):
            raise GcpError(
                f"Cloud TPU API ({self.spec.name}): {found.error.message}",
                hint="'tpupod status' shows the TPU's state",
            )
        return bool(found.done)

    def _name(self, kind: str) -> str:
        return f"{self.parent}/{kind}/{self.spec.name}"


def find_tpu(
    name: str, zone: str, project: str | None, session: TpuSession | None = None
) -> tuple[str, Any]:
    """An existing TPU by name, as seed 004 looks: queued resources first, then nodes."""
    session = session or TpuSession()
    exceptions = _exceptions()
    where = parent(session.project(project), zone)
    with _api_errors(name):
        client = session.client()
        try:
            return "queued resource", client.get_queued_resource(
                name=f"{where}/queuedResources/{name}", timeout=CALL_TIMEOUT_S
            )
        except exceptions.NotFound:
            return "node", client.get_node(name=f"{where}/nodes/{name}", timeout=CALL_TIMEOUT_S)


def tpu_summary(kind: str, found: Any) -> tuple[str, str]:
    """(type, state) of what find_tpu found."""
    if kind == "node":
        return str(found.accelerator_type), str(found.state.name)
    spec = found.tpu.node_spec[0]
    return str(spec.node.accelerator_type), str(found.state.state.name)


def describe_existing(
    name: str, zone: str, project: str | None, session: TpuSession | None = None
) -> dict[str, Any]:
    """Type, slices and capacity of an existing TPU, for adopting it."""
    kind, found = find_tpu(name, zone, project, session)
    if kind == "node":
        return {"tpu_type": found.accelerator_type}
    spec = found.tpu.node_spec[0]
    count = spec.multislice_params.node_count or 1
    capacity = "spot" if "spot" in found else "reserved" if found.reservation_name else "on-demand"
    return {
        "tpu_type": spec.node.accelerator_type,
        "node_count": count,
        "capacity": capacity,
        "api": "queued-resource",
    }


def list_tpus(
    zone: str, project: str | None, session: TpuSession | None = None
) -> list[tuple[str, str, str, str]]:
    """Every TPU in the zone: (API, name, type, state), queued resources first."""
    session = session or TpuSession()
    where = parent(session.project(project), zone)
    rows = []
    with _api_errors(zone):
        client = session.client()
        for qr in client.list_queued_resources(parent=where, timeout=CALL_TIMEOUT_S):
            spec = qr.tpu.node_spec[0] if qr.tpu.node_spec else None
            kind = spec.node.accelerator_type if spec else "?"
            rows.append(("queued resource", qr.name.rsplit("/", 1)[-1], kind, qr.state.state.name))
        for node in client.list_nodes(parent=where, timeout=CALL_TIMEOUT_S):
            rows.append(
                ("node", node.name.rsplit("/", 1)[-1], node.accelerator_type, node.state.name)
            )
    return rows


def _library(name: str) -> Any:
    """A module of the Cloud TPU client library (the ``gcp`` extra), or a clear error."""
    require("talking to Cloud TPUs", "gcp")
    return importlib.import_module(name)


def _exceptions() -> Any:
    return _library("google.api_core.exceptions")


def _credentials() -> tuple[Any, str | None]:
    if settings.tpu_api_endpoint():
        anonymous = _library("google.auth.credentials").AnonymousCredentials
        return anonymous(), None
    auth = _library("google.auth")
    try:
        credentials, project = auth.default()
    except _library("google.auth.exceptions").DefaultCredentialsError:
        raise GcpError(
            "no Google Cloud credentials (Application Default Credentials)",
            hint="run 'gcloud auth application-default login', or set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file",
        ) from None
    return credentials, project


def _module(version: str) -> Any:
    return _library(f"google.cloud.tpu_{version}")


def _new_client(version: str, credentials: Any) -> Any:
    module = _module(version)
    endpoint = settings.tpu_api_endpoint()
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        transport_type = module.services.tpu.transports.TpuRestTransport
        transport = transport_type(host=host, credentials=credentials, url_scheme=scheme)
        return module.TpuClient(transport=transport)
    return module.TpuClient(credentials=credentials, transport="rest")


SCOPE = "https://www.googleapis.com/auth/cloud-platform"
ROLE_HINT = "the account needs roles/tpu.admin on the project, and the TPU API enabled"
QUOTA_HINT = "ask for TPU quota in this zone, try another zone, or use --capacity spot"
EXISTS_HINT = "pick another --name, or 'tpupod up --adopt NAME' to record that TPU"
ARGUMENT_HINT = "check the type, the zone and the runtime version"
REFUSED = ("PermissionDenied", "Forbidden", "ResourceExhausted", "TooManyRequests")
API_HINTS = {
    "PermissionDenied": ROLE_HINT,
    "Forbidden": ROLE_HINT,
    "ResourceExhausted": QUOTA_HINT,
    "TooManyRequests": QUOTA_HINT,
    "AlreadyExists": EXISTS_HINT,
    "Conflict": EXISTS_HINT,
    "NotFound": "check the name, the zone and the project",
    "InvalidArgument": ARGUMENT_HINT,
    "BadRequest": ARGUMENT_HINT,
}


@contextlib.contextmanager
def _api_errors(name: str) -> Iterator[None]:
    """Translate google-api-core errors (and a request that never got an answer) into
    GcpErrors that say what to do."""
    exceptions = _exceptions()
    requests = _library("requests")
    try:
        yield
    except exceptions.GoogleAPICallError as exc:
        reason = type(exc).__name__
        message = f"Cloud TPU API ({name}): {reason}: {_without_url(exc.message)}"
        hint = API_HINTS.get(reason, "'tpupod status' shows the TPU's state")
        if reason in REFUSED:
            raise GcpRefused(message, hint, quota=hint == QUOTA_HINT) from exc
        raise GcpError(message, hint=hint) from exc
    except requests.RequestException as exc:
        raise GcpError(
            f"Cloud TPU API ({name}): no answer: {exc}", hint="check the network and try again"
        ) from exc


# Worth another try: the service's own passing failures, and a request with no answer.
PASSING = (
    "InternalServerError",
    "BadGateway",
    "ServiceUnavailable",
    "GatewayTimeout",
    "DeadlineExceeded",
)


def _passing(exc: GcpError) -> bool:
    """Did the call fail for a passing reason (worth trying again)?"""
    cause = exc.__cause__
    if isinstance(cause, _library("requests").RequestException):
        return True
    return type(cause).__name__ in PASSING


def _already_made(exc: GcpError) -> bool:
    """A create retried after a failure finds the TPU made: the earlier try went through."""
    return type(exc.__cause__).__name__ in ("AlreadyExists", "Conflict")


def _after_retries(exc: GcpError, spent: float) -> GcpError:
    failed = GcpError(f"{exc.message} (still failing after {spent:.0f}s of retries)", hint=exc.hint)
    failed.__cause__ = exc.__cause__
    return failed


def _backoff(tries: int) -> float:
    """Seconds before try ``tries + 1``: 0.5, 1, 2, 4, 8, then 10."""
    return float(min(0.5 * 2**tries, MAX_BACKOFF_S))


_REQUEST_LINE = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) (https?://\S+?):? ")


def _without_url(message: str) -> str:
    """A REST error's message names its request by the whole URL (``GET https://tpu.
    googleapis.com/v2/projects/P/locations/Z/queuedResources/N: ...``, ~150 characters on
    every retry): the method and the resource (``GET queuedResources/N: ...``) say it."""
    match = _REQUEST_LINE.match(message)
    if match is None:
        return message
    path = match[2].split("?", 1)[0].rstrip(":")
    resource = path.split("/locations/", 1)[-1].split("/", 1)[-1] if "/locations/" in path else path
    return f"{match[1]} {resource}: {message[match.end() :]}"


def _post(session: TpuSession, path: str, body: dict[str, Any]) -> None:
    """POST a v2alpha1 body over REST by hand: the installed client speaks v2alpha1 only
    over gRPC, and tpupod keeps one wire (REST) for both versions and the stand-in."""
    requests = _library("requests")
    auth = _library("google.auth.credentials")
    credentials = auth.with_scopes_if_required(session.credentials()[0], [SCOPE])
    http = _library("google.auth.transport.requests").AuthorizedSession(credentials)
    url = f"{settings.tpu_api_endpoint() or API_ROOT}/v2alpha1/{path}"
    try:
        response = http.post(url, json=body, timeout=60)
    except requests.RequestException as exc:
        raise GcpError(
            f"cannot reach the Cloud TPU API: {exc}", hint="check the network and try again"
        ) from exc
    if response.status_code >= 400:
        raise _exceptions().from_http_response(response)


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body)


def _pod_key(spec: GcpPodSpec, state: StateDir) -> str:
    """The public key the workers will accept: the given key's, else the pod's own (made on
    its first create, then kept: a recreated TPU takes the same key, and a create that
    fails changes nothing another command relies on)."""
    if spec.key:
        return public_key_line(Path(spec.key).expanduser())
    path = state.pod_dir(spec.name) / KEY_FILE
    if path.is_file():
        return public_key_line(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".key-") as staging:
        made = Path(staging) / KEY_FILE  # a 0700 folder: never readable by others
        line = generate_key(made, comment=f"tpupod-{spec.name}")
        Path(f"{made}.pub").replace(f"{path}.pub")
        made.replace(path)
    return line


def _as_ssh(spec: GcpPodSpec, state: StateDir) -> Any:
    """The SSH side of a TPU pod: its user and key, the same connection settings."""
    key = spec.key or str(state.pod_dir(spec.name) / KEY_FILE)
    return spec.model_copy(update={"key": key})


async def _workers(
    spec: GcpPodSpec,
    state: StateDir,
    nodes: list[tuple[int, Any]],
    progress: Callable[[str], None],
) -> list[Worker]:
    """Every worker of ``nodes`` ((slice, node), in order), with the hostname it reports
    over SSH. Ids are global: a slice's workers follow the slices before it."""
    per_slice = spec.accelerator.workers
    sliced = spec.node_count * spec.slices > 1
    targets: list[tuple[int, int, Any, SshHost]] = []
    for slice_id, node in nodes:
        for index, endpoint in enumerate(node.network_endpoints):
            address = (
                endpoint.ip_address
                if spec.internal
                else (endpoint.access_config.external_ip or endpoint.ip_address)
            )
            worker_id = slice_id * per_slice + index
            targets.append((worker_id, slice_id, endpoint, SshHost(host=address, user=spec.user)))
    pool = SshPool(connect_options(_as_ssh(spec, state), state))
    try:
        answers = await asyncio.gather(
            *(probe(pool, target, i) for i, _, _, target in targets),
            return_exceptions=True,
        )
    finally:
        await pool.close()
    workers = []
    for (i, slice_id, endpoint, target), answer in zip(targets, answers, strict=True):
        shell = None  # not known: taken as bash, a TPU VM's
        if isinstance(answer, BaseException):
            progress(f"w{i} ({target.host}) does not answer over SSH yet: {answer}")
            hostname = f"{spec.name}-s{slice_id}-w{i}"
        else:
            hostname, shell = answer.hostname, answer.login_shell
        workers.append(
            Worker(
                id=i,
                hostname=hostname,
                internal_address=endpoint.ip_address,
                external_address=endpoint.access_config.external_ip or None,
                ssh=target,
                slice=slice_id if sliced else None,
                login_shell=shell,
            )
        )
    return workers
