"""The pod spec: what a pod is, as written in ``tpupod.yaml`` or given by flags.

pydantic validates it; every way a file can be wrong becomes one
:class:`~tpupod.errors.SpecError` whose message names the file, the field and
the problem, with a hint. Only the first problem is reported (with a count of
the rest): one clear line beats a wall of them.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from tpupod.choices import DEFAULT_SPEC_FILE, Capacity, HostKeyPolicy
from tpupod.errors import SpecError, TpupodError
from tpupod.names import ENV_NAME_RE, POD_NAME_RE

if TYPE_CHECKING:
    from tpupod.accelerators import AcceleratorType

RESERVED_ENV_PREFIX = "TPUPOD_"
MAX_LOCAL_WORKERS = 256


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

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
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
    workers: int = Field(ge=1, le=MAX_LOCAL_WORKERS, description="number of simulated hosts")
    devices_per_worker: int = Field(
        default=1, ge=1, le=64, description="CPU devices JAX sees on each worker"
    )

    def summary(self) -> str:
        plural = "s" if self.devices_per_worker != 1 else ""
        return f"{self.workers} local workers, {self.devices_per_worker} device{plural} each"


class SshHost(BaseModel):
    """One host of an SSH pod: ``{host, port, user}``, or written ``user@host:port``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
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
    connect_concurrency: int = Field(default=64, ge=1, le=1024)
    connect_stagger_ms: float = Field(default=2.0, ge=0, le=10_000)
    connect_timeout: float = Field(default=10.0, gt=0, le=600)
    connect_retries: int = Field(default=3, ge=0, le=100)


class SshPodSpec(_SpecBase, _SshOptions):
    """A pod of existing hosts reached over SSH; worker ids follow the order of ``hosts``."""

    provider: Literal["ssh"]
    hosts: list[SshHost] = Field(min_length=1, max_length=4096)
    user: str | None = Field(default=None, description="login user for hosts that name none")
    key: str | None = Field(
        default=None, description="private key file (default: ssh-agent, ~/.ssh)"
    )

    @property
    def workers(self) -> int:
        return len(self.hosts)

    def summary(self) -> str:
        return f"{len(self.hosts)} hosts over SSH, host keys {self.host_keys.value}"


class GcpPodSpec(_SpecBase, _SshOptions):
    """A Cloud TPU (one slice, or several through a queued resource), reached over SSH."""

    provider: Literal["gcp"]
    tpu_type: str
    zone: str = Field(pattern=r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
    project: str | None = None
    runtime_version: str | None = None
    capacity: Capacity = Capacity.ON_DEMAND
    node_count: int = Field(default=1, ge=1, le=64, description="slices (multislice when > 1)")
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
        from tpupod.accelerators import lookup

        try:
            return lookup(value).name
        except TpupodError as exc:
            raise ValueError(f"unknown TPU type: {exc.hint}") from None

    @property
    def accelerator(self) -> AcceleratorType:
        from tpupod.accelerators import lookup

        return lookup(self.tpu_type)

    @property
    def workers(self) -> int:
        return self.accelerator.workers * self.node_count

    @property
    def queued(self) -> bool:
        """Multislice, spot, best-effort and reserved capacity go through Queued Resources."""
        return self.node_count > 1 or self.capacity in (
            Capacity.SPOT,
            Capacity.BEST_EFFORT,
            Capacity.RESERVED,
        )

    def summary(self) -> str:
        slices = f" x {self.node_count} slices" if self.node_count > 1 else ""
        return f"{self.tpu_type}{slices} in {self.zone}, {self.workers} workers ({self.capacity})"


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
_ADAPTER: TypeAdapter[LocalPodSpec | SshPodSpec | GcpPodSpec] = TypeAdapter(PodSpec)
FIELD_HINTS = {
    "name": "a pod name like 'dev' or 'qwen-pod-2'",
    "provider": f"supported providers: {', '.join(PROVIDERS)}",
    "workers": f"the number of workers, 1 to {MAX_LOCAL_WORKERS}",
    "devices_per_worker": "the number of CPU devices per worker, 1 to 64",
    "env": "a mapping of NAME: value",
    "hosts": "a list of hosts: 'user@host:port' strings or {host, port, user} items",
    "host_keys": "one of tofu (default), strict, insecure",
    "tpu_type": "a Cloud TPU type such as v4-16, v5litepod-64 or v6e-16",
    "zone": "a zone such as us-central2-b",
    "capacity": "one of on-demand (default), spot, preemptible, reserved, best-effort",
}


def load_spec_file(path: Path, overrides: Mapping[str, Any] | None = None) -> PodSpec:
    """Read and validate a spec file; ``overrides`` (from flags) win over the file's values."""
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
    data = parse_yaml(text, str(path))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return spec_from_mapping(data, str(path))


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
    parts = [str(p) for p in first["loc"]]
    if parts and parts[0] in PROVIDERS:  # pydantic names the union member first
        parts = parts[1:]
    field = parts[0] if parts else ""
    loc = ".".join([labels.get(field, field), *parts[1:]]) or "(top level)"
    if source:
        loc = f"{source}: {loc}"
    more = (
        f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        if len(errors) > 1
        else ""
    )
    kind = first["type"]
    if kind == "extra_forbidden":
        model = SshPodSpec if data_provider(first) == "ssh" else LocalPodSpec
        known = list(model.model_fields)
        close = difflib.get_close_matches(field, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known fields: {', '.join(known)}"
        return SpecError(f"{loc}: unknown field{more}", hint=hint)
    if kind == "missing":
        return SpecError(f"{loc}: required field is missing{more}", hint=FIELD_HINTS.get(field))
    if kind == "union_tag_invalid":
        tag = first.get("ctx", {}).get("tag")
        where = f"{source}: " if source else ""
        return SpecError(
            f"{where}provider: unknown provider {tag!r}{more}", hint=FIELD_HINTS["provider"]
        )
    message = first["msg"].removeprefix("Value error, ")
    got = first.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    return SpecError(f"{loc}: {message}{shown}{more}", hint=FIELD_HINTS.get(field))


def data_provider(error: Any) -> str:
    loc = error.get("loc") or ()
    return str(loc[0]) if loc and str(loc[0]) in PROVIDERS else "local"
