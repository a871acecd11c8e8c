"""Launch templates: which command line serves a model on which ports and devices.

A :class:`ServerSpec` is one process the agent runs and restarts. ``builtin``
serves every port of a worker from one process (libtpu lets one process per
host own the TPU, so the engines are threads of it, each on its own slice of
the devices); ``sglang-jax``, ``vllm`` and ``command`` run one process per
port. :func:`plan` turns ``serve up``'s options into the specs of one worker,
:func:`render` a spec into its argv.
"""

from __future__ import annotations

import enum
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tpupod import settings
from tpupod.errors import UsageError
from tpupod.extras import worker_argv
from tpupod.serve import defaults


class Backend(enum.StrEnum):
    BUILTIN = "builtin"
    SGLANG_JAX = "sglang-jax"
    VLLM = "vllm"
    COMMAND = "command"


class GroupSpec(BaseModel):
    """This process's place in a replica served by several workers in lockstep."""

    model_config = ConfigDict(frozen=True)

    size: int = Field(ge=2, description="processes (workers) in the replica")
    rank: int = Field(ge=0, description="0: the leader, which serves the endpoint")
    worker: int
    leader: str = Field(description="HOST:PORT of the leader's side channel")
    http_port: int = Field(description="the leader's OpenAI port")
    coordinator_port: int = Field(description="JAX's coordinator, on the leader's host")
    mesh: str | None = Field(default=None, description="model=M; default: every device")

    @property
    def leader_host(self) -> str:
        """The leader's address (where its side channel, endpoint and coordinator listen)."""
        return self.leader.rpartition(":")[0].strip("[]")

    @property
    def side_port(self) -> int:
        return int(self.leader.rpartition(":")[2])


class ServerSpec(BaseModel):
    """One server process: what it runs, where it listens, which devices it may use."""

    model_config = ConfigDict(frozen=True)

    name: str
    backend: Backend
    host: str
    ports: tuple[int, ...]
    model: str
    device_ids: tuple[tuple[int, ...], ...] = Field(
        default=(), description="per port, the worker's devices its engine uses"
    )
    dtype: str | None = None
    served_model_name: str | None = None
    python: str = "python3"
    command: str | None = Field(default=None, description="the template of a command backend")
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    restart_backoff_s: float = Field(
        default=defaults.RESTART_BACKOFF_S, gt=0, description="first wait before a restart"
    )
    group: GroupSpec | None = Field(default=None, description="a member of a multi-host replica")

    @property
    def bound_ports(self) -> list[int]:
        """The ports this process binds on its host: its own; a replica's leader also its
        side channel and JAX's coordinator; a follower none (it connects to its leader)."""
        group = self.group
        if group is None:
            return list(self.ports)
        if group.rank > 0:
            return []
        return [group.http_port, group.side_port, group.coordinator_port]


# A Hugging Face model id: ``name`` or ``namespace/name`` (letters, digits, - _ .)
HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
MODEL_HINTS = {
    Backend.BUILTIN: "give a checkpoint folder (config.json, *.safetensors) or a gs:// URL",
    Backend.SGLANG_JAX: "give a checkpoint folder (with config.json) or a Hugging Face id "
    "such as Qwen/Qwen2.5-7B-Instruct",
    Backend.VLLM: "give a checkpoint folder (with config.json), a Hugging Face id such as "
    "Qwen/Qwen2.5-7B-Instruct, or an s3:// or gs:// URL",
}


def check_model(backend: Backend, model: str) -> None:
    """Refuse a ``--model`` the backend cannot serve, before anything starts (run on each
    worker by ``ctl preflight``: a path names a folder there).

    builtin: a local checkpoint folder (config.json and *.safetensors) or a remote URL
    (``gs://...``: fetched by the server). sglang-jax, vllm: a folder with config.json, or
    a Hugging Face id (downloaded by the server; vllm also takes s3:// and gs:// URLs).
    command: anything, as its template decides what ``{model}`` means.
    """
    if backend is Backend.COMMAND:
        return
    hint = MODEL_HINTS[backend]
    scheme, sep, rest = model.partition("://")
    if sep and scheme != "file":
        remote = backend is Backend.BUILTIN or (backend is Backend.VLLM and scheme in ("s3", "gs"))
        if not remote:
            raise UsageError(
                f"--model {model}: the {backend.value} backend does not load {scheme}:// URLs",
                hint=hint,
            )
        if not rest.strip("/"):
            raise UsageError(f"--model {model}: no path after {scheme}://", hint=hint)
        return
    folder = Path(model.removeprefix("file://")).expanduser()
    local = backend is Backend.BUILTIN or folder.exists() or not HF_ID.fullmatch(model)
    if local:
        _check_folder(folder, model, backend, hint)


def _check_folder(folder: Path, model: str, backend: Backend, hint: str) -> None:
    if not folder.exists():
        id_too = "" if backend is Backend.BUILTIN else ", and not a Hugging Face id"
        raise UsageError(f"--model {model}: no such folder{id_too}", hint=hint)
    if not folder.is_dir():
        raise UsageError(f"--model {model}: not a folder", hint=hint)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--model {model}: no config.json in that folder", hint=hint)
    if backend is Backend.BUILTIN and not any(folder.glob("*.safetensors")):
        raise UsageError(f"--model {model}: no *.safetensors weights in that folder", hint=hint)


def device_slices(devices: int, servers: int) -> tuple[tuple[int, ...], ...]:
    """Split a worker's ``devices`` evenly among ``servers`` engines (one each when fewer)."""
    if servers < 1:
        raise UsageError(
            f"--servers-per-worker {servers}: a worker runs at least 1 server",
            hint="leave it out for 1 a worker, or give how many each worker runs",
        )
    if devices >= servers:
        if devices % servers:
            raise UsageError(
                f"{devices} devices per worker do not split evenly among {servers} servers",
                hint="pick a --servers-per-worker that divides the worker's device count",
            )
        per = devices // servers
        return tuple(tuple(range(k * per, (k + 1) * per)) for k in range(servers))
    return tuple((k % max(devices, 1),) for k in range(servers))


def plan(
    backend: Backend,
    *,
    host: str,
    ports: list[int],
    model: str,
    devices: int,
    dtype: str | None = None,
    served_model_name: str | None = None,
    python: str = "python3",
    command: str | None = None,
    extra_args: tuple[str, ...] = (),
    restart_backoff_s: float = defaults.RESTART_BACKOFF_S,
) -> list[ServerSpec]:
    """The server processes of one worker serving ``ports``."""
    if backend is Backend.COMMAND and not command:
        raise UsageError(
            "the command backend needs --command",
            hint="for example --command 'python -m my.server --host {host} --port {port}'",
        )
    slices = device_slices(devices, len(ports))
    common = {
        "backend": backend,
        "host": host,
        "model": model,
        "dtype": dtype,
        "served_model_name": served_model_name,
        "python": python,
        "command": command,
        "extra_args": extra_args,
        "restart_backoff_s": restart_backoff_s,
    }
    if backend is Backend.BUILTIN:
        name = f"builtin-{ports[0]}"
        return [ServerSpec(name=name, ports=tuple(ports), device_ids=slices, **common)]  # type: ignore[arg-type]
    return [
        ServerSpec(name=f"{backend.value}-{port}", ports=(port,), device_ids=(ids,), **common)  # type: ignore[arg-type]
        for port, ids in zip(ports, slices, strict=True)
    ]


def render(spec: ServerSpec) -> list[str]:
    """The argv of a server process."""
    if spec.group is not None:
        return render_member(spec, spec.group)
    ids = ",".join(str(i) for group in spec.device_ids for i in group)
    port = spec.ports[0]
    name_args = ["--served-model-name", spec.served_model_name] if spec.served_model_name else []
    if spec.backend is Backend.BUILTIN:
        module = "tpupod.serve.builtin"
        argv = worker_argv(spec.python, "serve,model", module, "--model", spec.model)
        argv += ["--host", spec.host, "--ports", ",".join(str(p) for p in spec.ports)]
        argv += ["--dtype", spec.dtype] if spec.dtype else []
        return [*argv, *name_args, *spec.extra_args]
    if spec.backend is Backend.SGLANG_JAX:
        # seed 000's flags; --device-indexes pins the engine to its slice of the worker's chips
        argv = [spec.python, "-m", "sgl_jax.launch_server", "--model-path", spec.model]
        argv += ["--host", spec.host, "--port", str(port), "--device-indexes", ids]
        argv += ["--tp-size", str(max(1, len(spec.device_ids[0]) if spec.device_ids else 1))]
        argv += ["--dtype", spec.dtype] if spec.dtype else []
        return [*argv, *name_args, *spec.extra_args]
    if spec.backend is Backend.VLLM:
        argv = ["vllm", "serve", spec.model, "--host", spec.host, "--port", str(port)]
        argv += ["--tensor-parallel-size", str(len(spec.device_ids[0]) if spec.device_ids else 1)]
        argv += ["--dtype", spec.dtype] if spec.dtype else []
        return [*argv, *name_args, *spec.extra_args]
    assert spec.command is not None
    values = {
        "host": spec.host,
        "port": str(port),
        "device_ids": ids,
        "model": spec.model,
        "python": spec.python,
    }
    try:
        line = spec.command.format(**{k: shlex.quote(v) for k, v in values.items()})
    except (KeyError, IndexError, ValueError) as exc:
        raise UsageError(
            f"the command template {spec.command!r} is not valid: {exc}",
            hint="it may use {host} {port} {device_ids} {model} {python}; double other braces",
        ) from exc
    return ["/bin/bash", "-c", f"exec {line}" if "\n" not in line else line]


def plan_replicas(
    workers: list[tuple[int, str]],
    hosts_per_replica: int,
    *,
    model: str,
    base_port: int,
    shared_addresses: bool,
    dtype: str | None = None,
    served_model_name: str | None = None,
    python: str = "python3",
    mesh: str | None = None,
    extra_args: tuple[str, ...] = (),
    restart_backoff_s: float = defaults.RESTART_BACKOFF_S,
) -> dict[int, list[ServerSpec]]:
    """The member processes of replicas of ``hosts_per_replica`` workers each, by worker id.

    ``workers`` are (id, internal address) in order; each run of K consecutive workers
    is one replica. Its leader (the first) serves ``P`` (the base port, or base + 3g on
    a pod whose workers share one address), its side channel listens on ``P+1`` and
    JAX's coordinator on ``P+2``, both on the leader's address. Every member of a
    replica has the same server name, ``replica-P``.
    """
    k = hosts_per_replica
    if k < 2 or len(workers) % k:
        raise UsageError(
            f"--hosts-per-replica {k} does not divide the pod's {len(workers)} workers",
            hint="give a K >= 2 that divides the worker count (1 serves each worker alone)",
        )
    specs: dict[int, list[ServerSpec]] = {}
    for g in range(len(workers) // k):
        members = workers[g * k : (g + 1) * k]
        leader_host = members[0][1]
        port = base_port + 3 * g if shared_addresses else base_port
        for rank, (worker, host) in enumerate(members):
            group = GroupSpec(
                size=k,
                rank=rank,
                worker=worker,
                leader=f"{leader_host}:{port + 1}",
                http_port=port,
                coordinator_port=port + 2,
                mesh=mesh,
            )
            specs[worker] = [
                ServerSpec(
                    name=f"replica-{port}",
                    backend=Backend.BUILTIN,
                    host=host,
                    ports=(port,) if rank == 0 else (),
                    model=model,
                    dtype=dtype,
                    served_model_name=served_model_name,
                    python=python,
                    extra_args=extra_args,
                    restart_backoff_s=restart_backoff_s,
                    group=group,
                )
            ]
    return specs


def render_member(spec: ServerSpec, group: GroupSpec) -> list[str]:
    """The argv of one member of a multi-host replica (``python -m tpupod.serve.replica``)."""
    argv = worker_argv(spec.python, "serve,model", "tpupod.serve.replica", "--model", spec.model)
    argv += ["--host", spec.host, "--port", str(group.http_port)]
    argv += ["--rank", str(group.rank), "--size", str(group.size), "--leader", group.leader]
    argv += ["--coordinator-port", str(group.coordinator_port), "--worker", str(group.worker)]
    argv += ["--mesh", group.mesh] if group.mesh else []
    argv += ["--dtype", spec.dtype] if spec.dtype else []
    name_args = ["--served-model-name", spec.served_model_name] if spec.served_model_name else []
    return [*argv, *name_args, *spec.extra_args]


# JAX's persistent compilation cache for the builtin engine, beside the agent's state on the
# host: an engine killed (or restarted) loads its programs there instead of compiling them
# again (the tiny model's engine served again 3.9 s after a kill -9, not 8.5 s; BENCHMARKS.md,
# "Serving", "Engine restarts"). Every program it runs is compiled by its warmup, each
# under JAX's default floor of 1 s on a CPU, hence the floor of 0; the size is bounded
# (least recently used out). A user's own setting of any of these wins.
COMPILE_CACHE_MAX_BYTES = 2 * 1024**3


def compile_cache_env(spec: ServerSpec, cache: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The cache variables a server gets where it runs the builtin engine, ``env`` (the
    agent's, and the spec's own) not setting them already."""
    if spec.backend is not Backend.BUILTIN:
        return {}
    # the folder, the floors of compile time and size, the size bound
    values = (str(cache), "0", "0", str(COMPILE_CACHE_MAX_BYTES))
    wanted = dict(zip(settings.JAX_CACHE_VARIABLES, values, strict=True))
    given = {**env, **spec.env}
    return {name: value for name, value in wanted.items() if name not in given}


def render_env(spec: ServerSpec) -> dict[str, str]:
    """Variables a server process gets beyond the agent's: which devices it may use."""
    ids = ",".join(str(i) for group in spec.device_ids for i in group)
    env = {"TPUPOD_SERVE_PORTS": ",".join(str(p) for p in spec.ports), **spec.env}
    if spec.backend is Backend.VLLM:
        env["TPU_VISIBLE_CHIPS"] = ids
    return env
