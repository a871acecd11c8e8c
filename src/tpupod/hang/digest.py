"""Stacks of many workers, read at a glance: grouped by identical stack, the odd ones first.

    w3 (1 of 8): time.sleep <- next_batch data.py:41 <- train train.py:80
    w0-w2, w4-w7 (7 of 8): _psum jax/_src/... <- train_step train.py:88 <- train train.py:90

A group is the workers whose program's main thread has the same frames (function, file,
line); groups are printed smallest first, so the worker that is not where the others are
leads. A worker whose stacks could not be taken is its own line, with the reason. The
whole dump (every process, every thread, every frame) is saved in the run's folder.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpupod.fanout.report import worker_names
from tpupod.hang.stacks import Frame, WorkerStacks, threads_of

SHOWN_FRAMES = 4  # innermost first: where it is, and the calls that led there
SHOWN_CHILDREN = 3  # a worker's other Python processes shown under its group


Rank = Callable[[int], float]  # how far along a worker is (lower: further behind)


def groups(
    stacks: Sequence[WorkerStacks], rank: Rank | None = None
) -> list[tuple[tuple[Frame, ...], list[WorkerStacks]]]:
    """Workers grouped by their main thread's frames, smallest group first; groups of the
    same size by ``rank`` (the group with the worker furthest behind first: the watchdog
    knows each worker's progress), then by the first worker's id. Workers without stacks
    are left out (see ``lines``)."""
    found: dict[tuple[Frame, ...], list[WorkerStacks]] = {}
    for worker in stacks:
        main = worker.main
        if worker.problem is None and main is not None:
            found.setdefault(main.frames, []).append(worker)

    def order(item: tuple[tuple[Frame, ...], list[WorkerStacks]]) -> tuple[int, float, int]:
        members = item[1]
        behind = min(rank(w.worker.id) for w in members) if rank is not None else 0.0
        return len(members), behind, members[0].worker.id

    return sorted(found.items(), key=order)


def odd_workers(stacks: Sequence[WorkerStacks], rank: Rank | None = None) -> list[int]:
    """The workers not where most are (none when all are in one place; of two groups the
    same size, the one behind). Workers without stacks are not among them: a finished one
    is not the cause, and one without py-spy says nothing."""
    return sorted(w.worker.id for _, members in groups(stacks, rank)[:-1] for w in members)


def lines(stacks: Sequence[WorkerStacks], rank: Rank | None = None) -> list[str]:
    """The digest: one line a group, the odd ones first, then one a worker without stacks."""
    total = len(stacks)
    out = []
    grouped = groups(stacks, rank)
    for i, (frames, members) in enumerate(grouped):
        names = worker_names(members)  # type: ignore[arg-type]
        out.append(f"{names} ({len(members)} of {total}): {shown(frames)}")
        if i == len(grouped) - 1 and len(grouped) > 1:
            continue  # where most are: their children would only repeat it
        for member in members[:SHOWN_CHILDREN]:  # its other Python processes (a loader's)
            for pid, thread in member.children()[:SHOWN_CHILDREN]:
                out.append(f"  {member.worker.label} child {pid}: {shown(thread.frames)}")
    for worker in stacks:
        if worker.problem is not None:
            out.append(f"{worker.worker.label}: no stacks: {worker.problem}")
    return out


def shown(frames: Sequence[Frame]) -> str:
    """Where a stack is, in a line: its innermost frame, then the program's own frames that
    led there (library frames between them left out, as ``...``), up to SHOWN_FRAMES."""
    if not frames:
        return "(no Python frames)"
    rest = frames[1:]
    own = [i for i, f in enumerate(rest) if not f.library] or list(range(len(rest)))
    parts, last = [str(frames[0])], -1
    for i in own[: SHOWN_FRAMES - 1]:
        if i != last + 1:
            parts.append("...")
        parts.append(str(rest[i]))
        last = i
    return " <- ".join(parts)


def hints(stacks: Sequence[WorkerStacks]) -> list[str]:
    """What to do about the workers without stacks, once each."""
    return list(dict.fromkeys(w.hint for w in stacks if w.problem is not None and w.hint))


def full_text(stacks: Sequence[WorkerStacks]) -> str:
    """Every worker's every process and thread, frame by frame: the saved dump."""
    out = []
    for worker in stacks:
        out.append(f"== {worker.worker.label} ({worker.worker.hostname})")
        if worker.problem is not None:
            out.append(f"   no stacks: {worker.problem}")
        for process in worker.processes:
            out.append(f"   process {process['pid']}: {' '.join(process.get('argv', []))}")
            if process.get("error"):
                out.append(f"      py-spy: {process['error']}")
            for thread in threads_of(process):
                state = "active" if thread.active else "idle"
                out.append(f"      thread {thread.name} ({state})")
                out.extend(f"         {frame}" for frame in thread.frames)
    return "\n".join(out) + "\n"


def save(run_dir: Path, stacks: Sequence[WorkerStacks], digest: Sequence[str]) -> Path:
    """The dump in the run's folder (``stacks-TIME.txt``, the digest first; and ``.json``);
    returns the text file's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f"-{int(now % 1 * 1000):03d}"
    path = run_dir / f"stacks-{stamp}.txt"
    while path.exists():  # two takes in one millisecond (the CLI, the dashboard, the watchdog)
        path = path.with_name(f"{path.stem}x.txt")
    path.write_text("\n".join(digest) + "\n\n" + full_text(stacks))
    data = [
        {
            "worker": w.worker.id,
            "hostname": w.worker.hostname,
            "problem": w.problem,
            "processes": w.processes,
        }
        for w in stacks
    ]
    path.with_suffix(".json").write_text(json.dumps({"digest": list(digest), "workers": data}))
    return path


@dataclass(frozen=True)
class Saved:
    """Stacks saved in a run's folder: the text file, its digest, when they were taken."""

    path: Path
    digest: list[str]
    taken: float


def latest(run_dir: Path) -> Saved | None:
    """The newest stacks saved in a run's folder (None: none, or none readable)."""
    for path in sorted(run_dir.glob("stacks-*.json"), reverse=True):
        try:
            data = json.loads(path.read_text())
            digest = [str(line) for line in data["digest"]]
            return Saved(path.with_suffix(".txt"), digest, path.stat().st_mtime)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None
