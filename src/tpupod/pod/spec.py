"""The pod spec: what a pod is, as written in ``tpupod.yaml`` or given by flags.

pydantic validates it; every way a file can be wrong becomes one
:class:`~tpupod.errors.SpecError` whose message names the file, the field and
the problem, with a hint. Only the first problem is reported (with a count of
the rest): one clear line beats a wall of them.
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tpupod.base.envargs import parse_env, parse_pairs
from tpupod.base.jsontext import lone_surrogate
from tpupod.base.reasons import plain_reason
from tpupod.errors import SpecError, TpupodError
from tpupod.pod.choices import DEFAULT_SPEC_FILE, Capacity, HostKeyPolicy, TpuApiKind
from tpupod.pod.names import ENV_NAME_RE, POD_NAME_RE

if TYPE_CHECKING:
    from tpupod.pod.accelerators import AcceleratorType

RESERVED_ENV_PREFIX = "TPUPOD_"
MAX_LOCAL_WORKERS = 256


def _refuse_bool(value: Any) -> Any:
    """YAML reads ``yes`` and ``true`` as booleans, which pydantic would take as 1."""
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer, not true or false")
    return value


Int = Annotated[int, BeforeValidator(_refuse_bool)]
Float = Annotated[float, BeforeValidator(_refuse_bool)]


def check_slices(slices: int, workers: int | None) -> int:
    """Slices hold the same number of workers each: ``slices`` must divide ``workers``
    (None: the workers were invalid, and their own error is the one to show)."""
    if workers is not None and workers % slices:
        fits = [n for n in range(1, workers + 1) if workers % n == 0]
        raise ValueError(
            f"{workers} workers do not divide into {slices} slices of the same size "
            f"(they divide into {', '.join(map(str, fits))})"
        )
    return slices


def check_pod_name(name: str) -> str:
    """Pod names follow Google Cloud's resource-name rule, so a name works on every provider."""
    if not POD_NAME_RE.match(name):
        raise ValueError(
            "must be 1-63 lowercase letters, digits or hyphens, "
            "starting with a letter and not ending with a hyphen"
        )
    return name


class _SpecBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment for every worker"
    )

    _check_name = field_validator("name")(check_pod_name)

    hang_timeout: float | None = Field(
        default=None,
        description="a run with no progress this long is hung (seconds, or 20s, 10m): "
        "run --hang-timeout's default",
    )

    @field_validator("hang_timeout", mode="before")
    @classmethod
    def _check_hang_timeout(cls, value: Any) -> float | None:
        if value is None:
            return None
        from tpupod.base.durations import parse_duration  # a spec that sets it only
        from tpupod.hang.watchdog import check_timeout  # a spec that sets it only

        try:
            return check_timeout(parse_duration(value, "hang_timeout"), "hang_timeout")
        except TpupodError as exc:
            said = str(exc).removeprefix("hang_timeout: ")  # without the value: shown after
            raise ValueError(
                said.split(" ", 1)[1] if said.startswith(("'", "True", "False")) else said
            ) from None

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        for key, value in env.items():
            if (problem := lone_surrogate(value)) is not None:  # the record is JSON: UTF-8
                raise ValueError(f"{key}'s value: {problem}")
            if not ENV_NAME_RE.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if key.startswith(RESERVED_ENV_PREFIX):
                raise ValueError(
                    f"{key!r}: names starting with {RESERVED_ENV_PREFIX} are set by tpupod"
                )
        return env


class LocalPodSpec(_SpecBase):
    """A pod of simulated hosts on this machine (the default provider)."""

    provider: Literal["local"] = "local"
    workers: Int = Field(ge=1, le=MAX_LOCAL_WORKERS, description="number of simulated hosts")
    devices_per_worker: Int = Field(
        default=1, ge=1, le=64, description="CPU devices JAX sees on each worker"
    )
    slices: Int = Field(
        default=1, ge=1, le=MAX_LOCAL_WORKERS, description="slices, each of workers/slices"
    )

    @field_validator("slices")
    @classmethod
    def _check_slices(cls, slices: int, info: ValidationInfo) -> int:
        return check_slices(slices, info.data.get("workers"))

    def summary(self) -> str:
        workers = "s" if self.workers != 1 else ""
        devices = "s" if self.devices_per_worker != 1 else ""
        return (
            f"{self.workers} local worker{workers}{slices_text(self.slices)}, "
            f"{self.devices_per_worker} device{devices} each"
        )


def slices_text(slices: int) -> str:
    """`` in 2 slices`` for a spec's summary (nothing for one slice)."""
    return f" in {slices} slices" if slices > 1 else ""


class SshHost(BaseModel):
    """One host of an SSH pod: ``{host, port, user}``, or written ``user@host:port``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(min_length=1)
    port: Int = Field(default=22, ge=1, le=65535)
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        return parse_host(value) if isinstance(value, str) else value

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port != 22 else ""
        return f"{user}{self.host}{port}"


class _SshOptions(BaseModel):
    """How tpupod reaches hosts over SSH (SSH pods, and the workers of a TPU pod)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host_keys: HostKeyPolicy = HostKeyPolicy.TOFU
    connect_concurrency: Int = Field(default=64, ge=1, le=1024)
    connect_stagger_ms: Float = Field(default=2.0, ge=0, le=10_000)
    # seconds to connect, and for a host to start a command
    connect_timeout: Float = Field(default=5.0, gt=0, le=600)
    connect_retries: Int = Field(default=3, ge=0, le=100)
    # a connection that answers no keepalive for interval * count seconds is dropped (0: none)
    keepalive_interval: Float = Field(default=5.0, ge=0, le=3600)
    keepalive_count: Int = Field(default=3, ge=1, le=100)


class SshPodSpec(_SpecBase, _SshOptions):
    """A pod of existing hosts reached over SSH; worker ids follow the order of ``hosts``."""

    provider: Literal["ssh"]
    hosts: list[SshHost] = Field(min_length=1, max_length=4096)
    user: str | None = Field(default=None, description="login user for hosts that name none")
    key: str | None = Field(
        default=None, description="private key file (default: ssh-agent, ~/.ssh)"
    )
    slices: Int = Field(default=1, ge=1, le=4096, description="slices: the hosts in order")

    @field_validator("slices")
    @classmethod
    def _check_slices(cls, slices: int, info: ValidationInfo) -> int:
        hosts = info.data.get("hosts")
        return check_slices(slices, None if hosts is None else len(hosts))

    @property
    def workers(self) -> int:
        return len(self.hosts)

    def summary(self) -> str:
        hosts = f"{len(self.hosts)} host{'s' if len(self.hosts) != 1 else ''}"
        return f"{hosts}{slices_text(self.slices)} over SSH, host keys {self.host_keys.value}"

    def repeated_hosts(self) -> list[str]:
        """A line for each host named more than once (same address and port)."""
        workers: dict[tuple[str, int], list[int]] = {}
        for i, host in enumerate(self.hosts):
            workers.setdefault((host.host, host.port), []).append(i)
        return [
            f"{SshHost(host=host, port=port)} is given {_times(len(ids))} "
            f"(workers {', '.join(map(str, ids[:-1]))} and {ids[-1]})"
            for (host, port), ids in workers.items()
            if len(ids) > 1
        ]


def _times(count: int) -> str:
    return "twice" if count == 2 else f"{count} times"


class GcpPodSpec(_SpecBase, _SshOptions):
    """A Cloud TPU (one slice, or several through a queued resource), reached over SSH."""

    provider: Literal["gcp"]
    tpu_type: str
    zone: str = Field(pattern=r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
    project: str | None = None
    runtime_version: str | None = None
    capacity: Capacity = Capacity.ON_DEMAND
    node_count: Int = Field(
        default=1, ge=1, le=64, description="slices of one multislice queued resource"
    )
    slices: Int = Field(
        default=1,
        ge=1,
        le=64,
        description="separate TPUs NAME-0..NAME-N-1, one per slice",
    )
    api: TpuApiKind | None = Field(default=None, description="unset: from capacity and slices")
    network: str | None = None
    subnetwork: str | None = None
    tags: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    internal: bool = Field(default=False, description="reach workers at internal addresses")
    user: str = Field(default="tpupod", description="the login user put in ssh-keys metadata")
    key: str | None = Field(
        default=None, description="an existing private key (default: one per pod)"
    )
    adopted: bool = Field(default=False, description="made elsewhere: recorded, never deleted")

    @field_validator("tpu_type")
    @classmethod
    def _check_type(cls, value: str) -> str:
        # the accelerator table: a spec that names a type only, not --help
        from tpupod.pod.accelerators import lookup

        try:
            return lookup(value).name
        except TpupodError as exc:
            raise ValueError(f"unknown TPU type: {exc.hint}") from None

    @field_validator("node_count")
    @classmethod
    def _node_names_fit(cls, count: int, info: ValidationInfo) -> int:
        _check_tpu_names(info.data.get("name") or "", count)
        return count

    @field_validator("slices")
    @classmethod
    def _one_form_of_slices(cls, slices: int, info: ValidationInfo) -> int:
        count = info.data.get("node_count") or 1
        _check_tpu_names(info.data.get("name") or "", slices)
        if slices > 1 and count > 1:
            raise ValueError(
                f"{slices} separate slices and a multislice queued resource of {count}: "
                "pick one form (separate TPUs are replaced one at a time; a queued resource "
                "is preempted and replaced whole)"
            )
        return slices

    def tpus(self) -> list[GcpPodSpec]:
        """The TPUs the pod is made of, in slice order: itself, or one per slice when its
        slices are separate TPUs (``NAME-0``, ``NAME-1``, ...: the node ids a multislice
        queued resource gives its slices too)."""
        if self.slices == 1:
            return [self]
        return [
            self.model_copy(update={"name": f"{self.name}-{k}", "slices": 1})
            for k in range(self.slices)
        ]

    def up_command(self) -> str:
        """The ``tpupod up`` command that makes this pod (its flags, as a user types them),
        for a hint to run after a ``down``, which forgets the pod's record."""
        words = ["--gcp", "--name", self.name, "--tpu-type", self.tpu_type, "--zone", self.zone]
        options = {
            "--project": self.project,
            "--runtime-version": self.runtime_version,
            "--capacity": None if self.capacity is Capacity.ON_DEMAND else self.capacity.value,
            "--node-count": str(self.node_count) if self.node_count > 1 else None,
            "--slices": str(self.slices) if self.slices > 1 else None,
            "--api": self.api.value if self.api is not None else None,
            "--network": self.network,
            "--subnetwork": self.subnetwork,
            "--user": None if self.user == "tpupod" else self.user,
            "--key": self.key,
            "--host-keys": None if self.host_keys is HostKeyPolicy.TOFU else self.host_keys.value,
        }
        words += [word for flag, value in options.items() if value for word in (flag, value)]
        words += [word for tag in self.tags for word in ("--tag", tag)]
        words += [word for k, v in self.labels.items() for word in ("--label", f"{k}={v}")]
        words += [word for k, v in self.env.items() for word in ("--env", f"{k}={v}")]
        words += ["--internal"] if self.internal else []
        return "tpupod up " + shlex.join(words)

    @property
    def accelerator(self) -> AcceleratorType:
        # the accelerator table: a spec that names a type only, not --help
        from tpupod.pod.accelerators import lookup

        return lookup(self.tpu_type)

    @property
    def workers(self) -> int:
        return self.accelerator.workers * self.node_count * self.slices

    @property
    def queued(self) -> bool:
        """Multislice, spot, best-effort and reserved capacity go through Queued Resources
        (unless ``api`` says which)."""
        if self.api is not None:
            return self.api is TpuApiKind.QUEUED_RESOURCE
        return self.node_count > 1 or self.capacity in (
            Capacity.SPOT,
            Capacity.BEST_EFFORT,
            Capacity.RESERVED,
        )

    def summary(self) -> str:
        slices = f" x {self.node_count} slices" if self.node_count > 1 else ""
        slices += f" x {self.slices} separate slices" if self.slices > 1 else ""
        workers = f"{self.workers} worker{'' if self.workers == 1 else 's'}"
        return f"{self.tpu_type}{slices} in {self.zone}, {workers} ({self.capacity})"


def _check_tpu_names(name: str, slices: int) -> None:
    """A pod of slices names them NAME-0..NAME-N-1 (separate TPUs, or a queued resource's
    nodes): each within the API's 63 characters."""
    if slices > 1 and len(f"{name}-{slices - 1}") > 63:
        raise ValueError(
            f"its slices would be named {name}-0..{name}-{slices - 1}: "
            "longer than the API's 63 characters; pick a shorter name"
        )


def parse_host(text: str) -> dict[str, Any]:
    """``user@host:port`` (user and port optional; ``[v6]:port`` for IPv6) -> fields."""
    user, _, rest = text.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail.removeprefix(":") or None
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    data: dict[str, Any] = {"host": host}
    if user:
        data["user"] = user
    if port is not None:
        data["port"] = port
    return data


PodSpec = Annotated[LocalPodSpec | SshPodSpec | GcpPodSpec, Field(discriminator="provider")]
PROVIDERS = ("local", "ssh", "gcp")
MODELS: dict[str, type[_SpecBase]] = {"local": LocalPodSpec, "ssh": SshPodSpec, "gcp": GcpPodSpec}
_ADAPTER: TypeAdapter[LocalPodSpec | SshPodSpec | GcpPodSpec] = TypeAdapter(PodSpec)
FIELD_HINTS = {
    "name": "a pod name like 'dev' or 'qwen-pod-2'",
    "provider": f"supported providers: {', '.join(PROVIDERS)}",
    "workers": f"the number of workers, 1 to {MAX_LOCAL_WORKERS}",
    "devices_per_worker": "the number of CPU devices per worker, 1 to 64",
    "env": "a mapping of NAME: value",
    "hang_timeout": "seconds, or a duration such as 20s, 10m or 1h",
    "hosts": "a list of hosts: 'user@host:port' strings or {host, port, user} items",
    "host_keys": "one of tofu (default), strict, insecure",
    "tpu_type": "a Cloud TPU type such as v4-16, v5litepod-64 or v6e-16",
    "zone": "a zone such as us-central2-b",
    "capacity": "one of on-demand (default), spot, preemptible, reserved, best-effort",
    "node_count": "the slices of one multislice queued resource, 1 to 64",
    "slices": "slices of the same size: --local 4 --slices 2 makes 2 of 2; with --gcp, "
    "--slices N makes N separate TPUs",
    "api": "tpu-vm or queued-resource",
    "key": "the path of a private key file, e.g. ~/.ssh/id_ed25519",
    "user": "a login user name, e.g. root",
    "labels": "a mapping of KEY: value",
    "tags": "a list of network tags",
}
OTHER_HINT = "fix that value ('tpupod up --help' describes each field's flag)"
# where a mapping field came from its flag, the flag's form (a trial: '--env K=...' got
# 'a mapping of NAME: value')
FLAG_HINTS = {
    "env": "write --env NAME=VALUE as UTF-8 text, e.g. --env XLA_FLAGS=--foo",
    "labels": "write --label KEY=VALUE, e.g. --label team=ml",
}


def load_spec_file(path: Path, overrides: Mapping[str, Any] | None = None) -> PodSpec:
    """Read and validate a spec file; ``overrides`` (from flags) win over the file's values."""
    data = read_spec_file(path)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return spec_from_mapping(data, str(path))


def read_spec_file(path: Path) -> dict[str, Any]:
    """A spec file's fields, not yet validated."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            f"{path}: no such file", hint=f"write a {DEFAULT_SPEC_FILE} or pass the pod as flags"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(
            f"{path}: cannot read: {exc}", hint="check the path and its permissions"
        ) from exc
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """Parse a YAML document that must be a mapping."""
    import yaml  # only when a file is read: not on every CLI call

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(
            f"{source}{where}: not valid YAML: {problem}",
            hint="check the indentation and quoting near that line",
        ) from exc
    if data is None:
        raise SpecError(
            f"{source}: the file is empty", hint="a pod needs at least 'name' and 'workers'"
        )
    if not isinstance(data, dict):
        raise SpecError(
            f"{source}: expected a mapping of fields, got {type(data).__name__}",
            hint="write 'name: dev' and 'workers: 2' on lines of their own",
        )
    return data


def spec_from_mapping(
    data: Mapping[str, Any], source: str, labels: Mapping[str, str] | None = None
) -> PodSpec:
    """Validate a mapping into a spec, translating pydantic's errors into one SpecError.

    ``source`` names where the data came from (a file); ``labels`` renames
    fields in messages (``workers`` -> ``--local`` when the spec came from flags).
    """
    data = {"provider": "local", **data}
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise _spec_error(exc, source, labels or {}) from exc


def _spec_error(exc: ValidationError, source: str, labels: Mapping[str, str]) -> SpecError:
    # An unknown field is usually a misspelt known one: report it before the "missing" it causes.
    errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    parts = _parts(first)
    field = parts[0] if parts else ""
    if field in labels:  # it came from a flag: name the flag, not the file
        loc = labels[field] + (f" ({'.'.join(parts[1:])})" if parts[1:] else "")
    else:
        loc = ".".join(parts) or "(top level)"
        loc = f"{source}: {loc}" if source else loc
    others = [_where(error, labels) for error in errors[1:]]
    more = (
        f" (and {len(others)} more problem{'s' if len(others) > 1 else ''}: "
        f"{', '.join(dict.fromkeys(others))})"
        if others
        else ""
    )
    kind = first["type"]
    if kind == "extra_forbidden":
        known = list(MODELS[data_provider(first)].model_fields)
        close = difflib.get_close_matches(field, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known fields: {', '.join(known)}"
        return SpecError(f"{loc}: unknown field{more}", hint=hint)
    if kind == "missing":
        return SpecError(
            f"{loc}: required field is missing{more}", hint=FIELD_HINTS.get(field, OTHER_HINT)
        )
    if kind == "union_tag_invalid":
        tag = first.get("ctx", {}).get("tag")
        where = f"{source}: " if source else ""
        return SpecError(
            f"{where}provider: unknown provider {tag!r}{more}", hint=FIELD_HINTS["provider"]
        )
    message = plain_reason(first).removeprefix("Value error, ")
    got = first.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    said = FLAG_HINTS.get(field) if field in labels else None
    return SpecError(
        f"{loc}: {message}{shown}{more}", hint=said or FIELD_HINTS.get(field, OTHER_HINT)
    )


def _where(error: Any, labels: Mapping[str, str]) -> str:
    """The field of a pydantic error as a person wrote it (a flag, when it came from one)."""
    parts = _parts(error)
    if parts and parts[0] in labels:
        return labels[parts[0]]
    return ".".join(parts) or "(top level)"


def _parts(error: Any) -> list[str]:
    parts = [str(p) for p in error["loc"]]
    return parts[1:] if parts and parts[0] in PROVIDERS else parts  # the union member first


def data_provider(error: Any) -> str:
    loc = error.get("loc") or ()
    return str(loc[0]) if loc and str(loc[0]) in PROVIDERS else "local"


# -- `tpupod up`'s flags -> PodSpec ------------------------------------------------------------


@dataclass(frozen=True)
class UpFlags:
    """``tpupod up``'s flags as typed; None, False or empty where a flag was not given."""

    name: str | None = None
    local: int | None = None
    devices_per_worker: int | None = None
    slices: int | None = None
    ssh: tuple[str, ...] = ()
    port: int | None = None
    user: str | None = None
    key: str | None = None
    host_keys: HostKeyPolicy | None = None
    gcp: bool = False
    tpu_type: str | None = None
    adopt: str | None = None
    zone: str | None = None
    project: str | None = None
    runtime_version: str | None = None
    capacity: Capacity | None = None
    spot: bool = False
    preemptible: bool = False
    reserved: bool = False
    best_effort: bool = False
    node_count: int | None = None
    api: TpuApiKind | None = None
    network: str | None = None
    subnetwork: str | None = None
    tags: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    internal: bool = False
    env: tuple[str, ...] = ()
    file: Path | None = None

    def given(self) -> list[str]:
        """The flags given (as attribute names), in the order above."""
        return [f.name for f in fields(self) if _given(getattr(self, f.name))]


def _given(value: object) -> bool:
    return value is not None and value is not False and value != ()


def flag(attribute: str) -> str:
    """An UpFlags attribute as the user types it: ``tpu_type`` -> ``--tpu-type``."""
    return "--" + {"tags": "tag", "labels": "label"}.get(attribute, attribute).replace("_", "-")


# The flags that say which kind of pod to make, and the kinds the other flags belong to.
CHOOSERS = {"local": "local", "ssh": "ssh", "gcp": "gcp", "tpu_type": "gcp", "adopt": "gcp"}
SSH_LOGIN_FLAGS = ("user", "key", "host_keys")
KIND_FLAGS = {
    "local": ("local", "devices_per_worker", "slices"),
    "ssh": ("ssh", "port", "slices", *SSH_LOGIN_FLAGS),
    "gcp": (
        *("gcp", "tpu_type", "adopt", "zone", "project", "runtime_version", "capacity"),
        *("spot", "preemptible", "reserved", "best_effort", "node_count", "slices", "api"),
        "network",
        *("subnetwork", "tags", "labels", "internal", *SSH_LOGIN_FLAGS),
    ),
}
KIND_TEXT = {
    "local": "local pods (--local)",
    "ssh": "pods over SSH (--ssh)",
    "gcp": "Cloud TPUs (--gcp)",
}
KINDS_HINT = (
    "a pod is local (--local N), existing hosts (--ssh HOSTS) "
    "or a Cloud TPU (--gcp --tpu-type T --zone Z): keep one"
)
CAPACITY_FLAGS = ("capacity", "spot", "preemptible", "reserved", "best_effort")
# Spec fields set by a flag, so that an error about the field names the flag.
FIELD_FLAGS = {
    "workers": "local",
    "hosts": "ssh",
    **{name: name for name in ("name", "devices_per_worker", "slices", "env", *SSH_LOGIN_FLAGS)},
    **{name: name for name in KIND_FLAGS["gcp"] if name not in (*CAPACITY_FLAGS, "gcp", "adopt")},
}


def chosen_kind(flags: UpFlags) -> str | None:
    """The kind of pod the flags ask for (None: they do not say); two kinds is an error."""
    by_kind: dict[str, str] = {}
    for attribute in flags.given():
        if attribute in CHOOSERS:
            by_kind.setdefault(CHOOSERS[attribute], attribute)
    if len(by_kind) > 1:
        first, second = list(by_kind.values())[:2]
        raise SpecError(
            f"{flag(first)} and {flag(second)} ask for different kinds of pod", hint=KINDS_HINT
        )
    return next(iter(by_kind), None)


def adoption(flags: UpFlags) -> tuple[str, str, str | None] | None:
    """(TPU, zone, project) when the flags adopt a TPU made elsewhere; checked before any call."""
    if flags.adopt is None:
        return None
    chosen_kind(flags)
    _check_flags_fit(flags, "gcp", None)
    if not flags.zone or not flags.key:
        raise SpecError(
            "--adopt needs --zone and --key (and --user if not tpupod)",
            hint="e.g. --adopt my-tpu --zone us-central2-b --key ~/.ssh/google_compute_engine "
            "--user root",
        )
    return flags.adopt, flags.zone, flags.project


def spec_from_flags(flags: UpFlags, adopted: Mapping[str, Any] | None = None) -> PodSpec:
    """The pod ``tpupod up`` is asked for: its flags, over the fields of ``--file`` (or of
    ``./tpupod.yaml`` when no flag says which kind of pod). ``adopted``: what the Cloud TPU
    API says of the TPU named by ``--adopt``. Errors name the flag where a flag set the field."""
    kind = chosen_kind(flags)
    file = flags.file
    if file is None and kind is None and Path(DEFAULT_SPEC_FILE).is_file():
        file = Path(DEFAULT_SPEC_FILE)
    data = read_spec_file(file) if file is not None else {}
    kind = _settle_kind(flags, kind, file, data)
    _check_flags_fit(flags, kind, file)
    data.update(_flag_fields(flags, kind, adopted))
    if file is None and "name" not in data:
        raise SpecError("the pod needs a name", hint="add --name NAME, e.g. --name dev")
    return spec_from_mapping(data, str(file or ""), labels=_flag_labels(flags, file is None))


def _settle_kind(flags: UpFlags, kind: str | None, file: Path | None, data: dict[str, Any]) -> str:
    if file is None:
        if kind is None:
            raise SpecError(
                "nothing to create: no --local N, no --ssh HOSTS, no --gcp and no tpupod.yaml here",
                hint="try 'tpupod up --name dev --local 2', or pass a spec with -f FILE",
            )
        return kind
    described = str(data.get("provider", "local"))
    if kind is not None and kind != described and described in PROVIDERS:
        chooser = next(a for a in flags.given() if a in CHOOSERS)
        raise SpecError(
            f"{flag(chooser)} asks for another kind of pod than {file} ({described})",
            hint=f"leave out {flag(chooser)}, or pass a file of that kind",
        )
    return kind or described


def _check_flags_fit(flags: UpFlags, kind: str, file: Path | None) -> None:
    """Refuse a flag that belongs to another kind of pod, naming it and what it goes with."""
    if kind not in KIND_FLAGS:
        return  # an unknown provider in the file: validation says so
    given = flags.given()
    chooser = next((a for a in given if a in CHOOSERS), None)
    for attribute in given:
        kinds = [k for k, names in KIND_FLAGS.items() if attribute in names]
        if kinds and kind not in kinds:
            against = flag(chooser) if chooser else f"{file} (a {kind} pod)"
            raise SpecError(
                f"{flag(attribute)} does not go with {against}: it is for "
                + " and ".join(KIND_TEXT[k] for k in kinds),
                hint=f"leave out {flag(attribute)}",
            )


def _flag_fields(flags: UpFlags, kind: str, adopted: Mapping[str, Any] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"name": flags.name, "env": parse_env(flags.env) or None}
    fields |= {name: getattr(flags, name) for name in SSH_LOGIN_FLAGS}
    if kind == "local":
        fields |= {"workers": flags.local, "devices_per_worker": flags.devices_per_worker}
        fields |= {"slices": flags.slices}
    elif kind == "ssh":
        fields |= {"provider": "ssh", "hosts": _ssh_hosts(flags), "slices": _ssh_slices(flags)}
    elif kind == "gcp":
        fields |= _gcp_fields(flags)
    if adopted is not None:
        assert flags.adopt is not None
        fields |= {"name": flags.adopt, "adopted": True, "user": flags.user or "tpupod"}
        fields |= adopted
    return {key: value for key, value in fields.items() if value is not None}


def _gcp_fields(flags: UpFlags) -> dict[str, Any]:
    return {
        "provider": "gcp",
        **{name: getattr(flags, name) for name in ("tpu_type", "zone", "project")},
        **{name: getattr(flags, name) for name in ("runtime_version", "node_count", "api")},
        "slices": flags.slices,
        **{name: getattr(flags, name) for name in ("network", "subnetwork")},
        "capacity": _capacity(flags),
        "tags": list(flags.tags) or None,
        "labels": _labels(flags.labels),
        "internal": flags.internal or None,
    }


def _ssh_hosts(flags: UpFlags) -> list[dict[str, Any]] | None:
    """``--ssh`` (and ``--port`` for hosts that name none) as host fields: every ``--ssh``
    in order (each one slice, when it is given more than once)."""
    if not flags.ssh:
        if flags.port is not None:
            raise SpecError("--port goes with --ssh", hint="in a spec file, write host:port")
        return None
    if flags.port is not None and not 1 <= flags.port <= 65535:
        raise SpecError(f"--port: {flags.port} is not a port", hint="a port is 1 to 65535")
    hosts = [host for group in _ssh_groups(flags) for host in group]
    for host in hosts:
        if flags.port is not None:
            host.setdefault("port", flags.port)
    return hosts


def _ssh_groups(flags: UpFlags) -> list[list[dict[str, Any]]]:
    return [[parse_host(item.strip()) for item in g.split(",") if item.strip()] for g in flags.ssh]


def _ssh_slices(flags: UpFlags) -> int | None:
    """The slices of an SSH pod: ``--slices N``, or one a ``--ssh`` when it is repeated
    (each with as many hosts as the first; both given: they must agree)."""
    groups = _ssh_groups(flags)
    if len(groups) < 2:
        return flags.slices
    sizes = [len(group) for group in groups]
    odd = next((i for i, size in enumerate(sizes) if size != sizes[0]), None)
    if odd is not None:
        raise SpecError(
            f"--ssh: slice {odd} has {sizes[odd]} host{'s' if sizes[odd] != 1 else ''}, "
            f"slice 0 has {sizes[0]}",
            hint="every slice has the same number of hosts: give each --ssh as many",
        )
    if flags.slices is not None and flags.slices != len(groups):
        raise SpecError(
            f"--slices {flags.slices} but --ssh is given {len(groups)} times (one slice each)",
            hint="leave out --slices, or give --ssh once with every host",
        )
    return len(groups)


def _capacity(flags: UpFlags) -> Capacity | None:
    """--capacity, or one of its shorthands (--spot, --preemptible, --reserved, --best-effort)."""
    chosen = [
        Capacity(name.replace("_", "-")) for name in CAPACITY_FLAGS[1:] if getattr(flags, name)
    ]
    if flags.capacity is not None:
        chosen.append(flags.capacity)
    if len(set(chosen)) > 1:
        names = " and ".join(sorted({c.value for c in chosen}))
        raise SpecError(f"{names} contradict each other", hint="pick one kind of capacity")
    return chosen[0] if chosen else None


def _labels(items: tuple[str, ...]) -> dict[str, str] | None:
    return parse_pairs(items, option="--label", example="team=ml", error=SpecError) or None


def _flag_labels(flags: UpFlags, every: bool) -> dict[str, str]:
    """Spec field -> the flag that set it (``every``: or would set it), for error messages."""
    given = flags.given()
    labels = {field: flag(name) for field, name in FIELD_FLAGS.items() if every or name in given}
    capacity = next((name for name in CAPACITY_FLAGS if name in given), None)
    if capacity is not None:
        labels["capacity"] = flag(capacity)
    if flags.adopt is not None:
        labels["name"] = "--adopt"
    return labels
