"""``tpupod image build``: build once and load everywhere, or build on every worker.

Build once (the default): the context goes to worker 0 (the build runs on a worker,
so the image matches the workers' architecture whatever the launcher is), the image
is built there and saved to a tar, which comes back here and goes out again, one
upload per storage over the pod's existing connections, to be loaded. Workers that
share an engine storage (the workers of a local pod, containers on one host) load it
once: each storage carries an id of its own (``tpupod-storage-id`` in its root, or the
Docker daemon's id). ``--on-each`` builds on every worker in parallel instead (no
transfer; podman's builds get ``--timestamp 0`` so that equal inputs give equal ids).
Either way the image id (the digest of its config, kept by save and load) must then
be the same on every worker.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import shlex
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpupod.errors import TpupodError, UsageError
from tpupod.fanout.context import Context, Sinks
from tpupod.fanout.execute import Policy, each_on, execute_async, for_each, run_on
from tpupod.fanout.results import FanoutResult, WorkerResult
from tpupod.image.container_engine import pick_engine, raise_unusable
from tpupod.image.containerize import IMAGE_LINE, check_script
from tpupod.image.containerize import Container as _Container
from tpupod.pod.record import Pod, Worker
from tpupod.pod.state import StateDir
from tpupod.providers import Connector, provider_for
from tpupod.transport import OutputLine, Transport

BUILD_TIMEOUT_S = 3600.0
STEP_TIMEOUT_S = 600.0
STORAGE_LINE = "tpupod-storage:"
# A build step as each builder prints it: podman/buildah, Docker's legacy builder, BuildKit.
STEP = re.compile(
    r"^(?:STEP (\d+/\d+): (.*)|Step (\d+/\d+) : (.*)|#\d+ \[[^\]]*?(\d+/\d+)\] (.*))$"
)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BuildRequest:
    tag: str
    context: Path
    dockerfile: Path | None = None  # default: CONTEXT/Dockerfile
    engine: str | None = None
    on_each: bool = False

    def checked(self) -> BuildRequest:
        if not self.context.is_dir():
            raise UsageError(f"build context {self.context} is not a folder", hint="a folder")
        dockerfile = self.dockerfile or self.context / "Dockerfile"
        if not dockerfile.is_file():
            raise UsageError(f"no Dockerfile at {dockerfile}", hint="name one with -f FILE")
        return BuildRequest(self.tag, self.context, dockerfile, self.engine, self.on_each)


@dataclass(frozen=True)
class WorkerImage:
    """Where one worker's copy of the image came from, and its id."""

    worker: Worker
    how: str  # "built", "loaded", "shares wN's storage"
    image_id: str
    seconds: float


class BuildError(TpupodError):
    """A build failed on a worker (its step and last line named), or the copies differ."""


async def build_image(
    pod: Pod,
    request: BuildRequest,
    connector: Connector,
    *,
    workers: Sequence[Worker] | None = None,
    progress: Progress | None = None,
) -> list[WorkerImage]:
    """Build ``request`` and put it on every worker; one row per worker, in order."""
    request = request.checked()
    selected = list(workers) if workers is not None else list(pod.workers)
    say = progress or (lambda text: None)
    job = _Job(pod, connector, request, f"/tmp/tpupod-image-{secrets.token_hex(4)}", say)
    try:
        # One worker per engine storage builds (--on-each) or loads: the others share it.
        where = await storages(pod, connector, selected, request.engine)
        firsts: dict[str, Worker] = {}
        for worker in selected:
            firsts.setdefault(where[worker.id], worker)
        rows = {
            w.id: (f"shares {firsts[where[w.id]].label}'s storage", 0.0)
            for w in selected
            if firsts[where[w.id]] is not w
        }
        builders = list(firsts.values()) if request.on_each else selected[:1]
        await _upload_context(job, builders)
        rows.update(await _build(job, builders))
        if not request.on_each:
            rows.update(await _distribute(job, builders[0], list(firsts.values())[1:]))
        ids = await image_ids(pod, connector, selected, request.tag, request.engine)
    finally:
        await execute_async(pod, f"rm -rf {job.stage}", workers=selected, connector=connector)
    return _checked_rows(selected, rows, ids, request.tag)


@dataclass(frozen=True)
class _Job:
    pod: Pod
    connector: Connector
    request: BuildRequest
    stage: str  # the folder on the workers
    say: Progress


async def _upload_context(job: _Job, workers: Sequence[Worker]) -> None:
    dockerfile = job.request.dockerfile
    assert dockerfile is not None

    async def upload(worker: Worker, transport: Transport) -> str:
        job.say(f"{worker.label} ({worker.hostname}): sending the build context")
        await transport.put(job.request.context, f"{job.stage}/context")
        await transport.put(dockerfile, f"{job.stage}/Dockerfile")
        return "sent"

    sent = await for_each(job.pod, upload, workers=workers, connector=job.connector)
    _raise_for(sent, "send the context")


def build_script(request: BuildRequest, stage: str) -> str:
    reproducible = '[ "${tpupod_engine##* }" = podman ] && tpupod_more=(--timestamp 0)'
    return "\n".join(
        [
            pick_engine(request.engine),
            "tpupod_more=()",
            *([reproducible] if request.on_each else []),
            f'$tpupod_engine build --network=host "${{tpupod_more[@]}}" -f {stage}/Dockerfile '
            f"-t {shlex.quote(request.tag)} {stage}/context",
        ]
    )


async def _build(job: _Job, workers: Sequence[Worker]) -> dict[int, tuple[str, float]]:
    request, say = job.request, job.say
    steps: dict[int, str] = {}

    def on_line(worker: Worker, line: OutputLine) -> None:
        match = STEP.match(line.text)
        if match:
            number, text = next((g, t) for g, t in _pairs(match.groups()) if g)
            steps[worker.id] = f"at step {number} ({text.strip()})"

    for worker in workers:
        say(f"{worker.label} ({worker.hostname}): building {request.tag}")
    result = await run_on(
        Context(job.pod, Sinks(on_line), connector=job.connector),
        build_script(request, job.stage),
        workers=workers,
        policy=Policy(timeout=BUILD_TIMEOUT_S),
        guard=True,
    )
    failed = [r for r in result.workers if not r.ok]
    if failed:
        raise_unusable(failed)
        first = failed[0]
        where = steps.get(first.worker.id, "before its first step")
        raise BuildError(
            f"build of {request.tag} failed on {first.worker.label} ({first.worker.hostname}) "
            f"{where}: {_error_line(first)}",
            hint="fix the Dockerfile or the context and build again",
        )
    for r in result.workers:
        say(f"{r.worker.label}: built in {r.duration:.1f}s")
    return {r.worker.id: ("built", r.duration) for r in result.workers}


def _pairs(groups: tuple[str | None, ...]) -> list[tuple[str | None, str]]:
    return [(groups[i], groups[i + 1] or "") for i in range(0, len(groups), 2)]


def _error_line(result: WorkerResult) -> str:
    marked = [t for t in result.tail if t.lower().startswith(("error", "failed"))]
    return (marked[-1] if marked else result.last_line) or result.outcome_text()


def storage_script(engine: str | None) -> str:
    """Print an id of the engine's storage that is the same for workers that share it."""
    mark = '"$tpupod_root/tpupod-storage-id"'
    return "\n".join(
        [
            pick_engine(engine),
            'if [ "${tpupod_engine##* }" = docker ]; then',
            "  tpupod_id=$($tpupod_engine info --format '{{.ID}}') || { tpupod_daemon; exit 1; }",
            f'  echo "{STORAGE_LINE} docker-$tpupod_id"',
            "  exit",
            "fi",
            "tpupod_root=$($tpupod_engine info --format '{{.Store.GraphRoot}}') || exit 1",
            f"if [ ! -s {mark} ]; then",
            "  tpupod_new=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \\n')",
            f'  echo "$tpupod_new" > {mark}.$$ && mv -n {mark}.$$ {mark}; rm -f {mark}.$$',
            "fi",
            f'echo "{STORAGE_LINE} $(cat {mark})"',
        ]
    )


async def storages(
    pod: Pod, connector: Connector, workers: Sequence[Worker], engine: str | None
) -> dict[int, str]:
    """Each worker's storage id (workers of a local pod share one)."""
    result = await execute_async(
        pod, storage_script(engine), workers=workers, connector=connector, timeout=STEP_TIMEOUT_S
    )
    raise_unusable(result.workers)
    _raise_for(result, "find the engine's storage")
    found = {}
    for r in result.workers:
        line = next((t for t in reversed(r.tail) if t.startswith(STORAGE_LINE)), "")
        found[r.worker.id] = line.removeprefix(STORAGE_LINE).strip()
    return found


async def _distribute(
    job: _Job, builder: Worker, targets: Sequence[Worker]
) -> dict[int, tuple[str, float]]:
    """Save on the builder, fetch, then one upload and load per other storage (``targets``)."""
    pod, connector, request, stage, say = job.pod, job.connector, job.request, job.stage, job.say
    rows: dict[int, tuple[str, float]] = {}
    if not targets:
        return rows
    tar = f"{stage}/image.tar"
    save = f"{pick_engine(request.engine)}\n$tpupod_engine save -o {tar} {shlex.quote(request.tag)}"
    ctx, step = Context(pod, connector=connector), Policy(timeout=STEP_TIMEOUT_S)
    saved = await run_on(ctx, save, workers=[builder], policy=step, guard=True)
    _raise_for(saved, "save the image")
    with tempfile.TemporaryDirectory(prefix="tpupod-image-") as folder:
        local = Path(folder) / "image.tar"
        await connector.transport(builder).get(tar, local)
        size = local.stat().st_size / 1e6
        load = f"{pick_engine(request.engine)}\n$tpupod_engine load -q -i {tar}"

        async def send(worker: Worker, transport: Transport) -> str:
            began = time.monotonic()
            say(f"{worker.label} ({worker.hostname}): sending {size:.1f} MB")
            await transport.put(local, tar)
            return f"{time.monotonic() - began:.2f}"

        _raise_for(await each_on(ctx, send, workers=targets), "send the image")
    loaded = await run_on(ctx, load, workers=targets, policy=step, guard=True)
    _raise_for(loaded, "load the image")
    for r in loaded.workers:
        say(f"{r.worker.label}: loaded in {r.duration:.1f}s")
        rows[r.worker.id] = ("loaded", r.duration)
    return rows


async def image_ids(
    pod: Pod, connector: Connector, workers: Sequence[Worker], tag: str, engine: str | None
) -> dict[int, str | None]:
    """The id of ``tag`` on each worker (None where it is missing)."""
    result = await execute_async(
        pod,
        check_script(_Container(tag, engine=engine)),
        workers=workers,
        connector=connector,
        timeout=STEP_TIMEOUT_S,
    )
    ids: dict[int, str | None] = {}
    for r in result.workers:
        line = next((t for t in reversed(r.tail) if t.startswith(IMAGE_LINE)), "")
        words = line.split()
        ids[r.worker.id] = words[1] if r.ok and len(words) > 1 else None
    return ids


def _checked_rows(
    workers: Sequence[Worker],
    rows: dict[int, tuple[str, float]],
    ids: dict[int, str | None],
    tag: str,
) -> list[WorkerImage]:
    if len(set(ids.values())) != 1 or None in ids.values():
        found = ", ".join(f"{w.label}: {(ids[w.id] or 'missing')[:12]}" for w in workers)
        raise BuildError(
            f"{tag} is not the same image on every worker ({found})",
            hint="builds on each worker differ when a step is not reproducible; "
            "build once (without --on-each) to copy one image everywhere",
        )
    return [
        WorkerImage(w, rows.get(w.id, ("", 0.0))[0], ids[w.id] or "", rows.get(w.id, ("", 0.0))[1])
        for w in workers
    ]


def _raise_for(result: FanoutResult, what: str) -> None:
    failed = [r for r in result.workers if not r.ok]
    if failed:
        detail = "; ".join(
            f"{r.worker.label} ({r.worker.hostname}): {r.error or _error_line(r)}" for r in failed
        )
        raise BuildError(f"could not {what}: {detail}", hint="see the engine's message above")


def run_build(pod: Pod, request: BuildRequest, progress: Progress) -> list[WorkerImage]:
    """Blocking form, with its own connections (the CLI's)."""

    async def go() -> list[WorkerImage]:
        connector = provider_for(pod.provider).connect(pod, StateDir())
        try:
            return await build_image(pod, request, connector, progress=progress)
        finally:
            await connector.close()

    return asyncio.run(go())
