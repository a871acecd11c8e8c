"""``tpupod image ls``: which workers have which tags, and whether the copies agree."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from tpupod.errors import TpupodError
from tpupod.fanout.execute import execute_async
from tpupod.fanout.report import columns
from tpupod.image.container_engine import pick_engine, raise_unusable
from tpupod.pod.record import Pod, Worker
from tpupod.pod.state import StateDir
from tpupod.providers import Connector, provider_for
from tpupod.transport import OutputLine

LIST_TIMEOUT_S = 60.0
LINE = "tpupod-images:"


@dataclass(frozen=True)
class ImageRow:
    """One tag at one image id, and the workers that have it so."""

    tag: str
    image_id: str
    workers: tuple[int, ...]


def list_script(engine: str | None) -> str:
    return "\n".join(
        [
            pick_engine(engine),
            "tpupod_list=$($tpupod_engine images --format '{{.Repository}}:{{.Tag}} {{.ID}}')"
            " || { tpupod_daemon; exit 1; }",
            f"printf '%s\\n' \"$tpupod_list\" | sed '/^$/d; s/^/{LINE} /'",
        ]
    )


async def list_images(
    pod: Pod, connector: Connector, workers: Sequence[Worker], engine: str | None
) -> list[ImageRow]:
    """Every tag on the workers, one row per (tag, id); a tag with two ids has two rows."""
    seen: dict[tuple[str, str], list[int]] = {}

    def on_line(worker: Worker, line: OutputLine) -> None:
        words = line.text.split()
        if len(words) == 3 and words[0] == LINE and not words[1].startswith("<none>"):
            tag = words[1].removeprefix("localhost/")
            seen.setdefault((tag, words[2].removeprefix("sha256:")[:12]), []).append(worker.id)

    result = await execute_async(
        pod,
        list_script(engine),
        workers=workers,
        connector=connector,
        timeout=LIST_TIMEOUT_S,
        on_line=on_line,
    )
    raise_unusable(result.workers)
    for r in result.workers:
        if not r.ok:
            raise TpupodError(
                f"cannot list images on {r.worker.label} ({r.worker.hostname}): "
                f"{r.error or r.last_line}",
                hint="'tpupod status' checks every worker",
            )
    return [ImageRow(tag, iid, tuple(sorted(ws))) for (tag, iid), ws in sorted(seen.items())]


def table(rows: Sequence[ImageRow], workers: Sequence[Worker]) -> str:
    """TAG, IMAGE ID, ON (the workers that have it), MISSING ON."""
    every = [w.id for w in workers]
    header = ("TAG", "IMAGE ID", "ON", "MISSING ON")
    lines = [
        (
            r.tag,
            r.image_id,
            _workers(r.workers),
            _workers(tuple(w for w in every if w not in r.workers)) or "-",
        )
        for r in rows
    ]
    return columns([header, *lines])


def _workers(ids: tuple[int, ...]) -> str:
    """``w0-3,w5``: runs of consecutive workers as ranges."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"w{r[0]}" if len(r) == 1 else f"w{r[0]}-{r[-1]}" for r in runs)


def images_table(pod: Pod, engine: str | None) -> str:
    """Blocking form with its own connections (the CLI's): ``tpupod image ls``'s table."""

    async def go() -> str:
        connector = provider_for(pod.provider).connect(pod, StateDir())
        try:
            rows = await list_images(pod, connector, pod.workers, engine)
        finally:
            await connector.close()
        return table(rows, pod.workers)

    return asyncio.run(go())
