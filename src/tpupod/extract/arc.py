"""ARC tasks (train/test grids) to JSONL prompts, with one stable rendering.

Accepted input: one JSON file mapping task ids to tasks (what seed 002's
``transform_hf_to_arc`` writes), one task file (its name is the id), or a
folder of task files. A task is ``{"train": [{"input": G, "output": G}, ...],
"test": [{"input": G, "output": G?}, ...]}`` with grids as lists of rows of
integers 0-9. Each test input becomes one sample, id ``TASK`` (``TASK-K``
when a task has several tests); its expected output, when given, goes in
``answer``. The rendering (``render``) is part of the format: changing it
changes every prompt, so it is versioned as ``ARC_RENDERING``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tpupod.base.files import write_atomic
from tpupod.errors import DataError

ARC_RENDERING = 1
INTRO = (
    "Find the rule that turns each input grid into its output grid, "
    "then apply it to the test input. Cells are digits 0-9, one row per line."
)

Grid = list[list[int]]


def grid_text(grid: Grid) -> str:
    return "\n".join(" ".join(str(cell) for cell in row) for row in grid)


def render(train: list[dict[str, Grid]], test_input: Grid) -> str:
    """The prompt of one test input: the intro, each example, then the test input."""
    parts = [INTRO]
    for n, pair in enumerate(train, start=1):
        parts.append(
            f"Example {n}\nInput:\n{grid_text(pair['input'])}\nOutput:\n{grid_text(pair['output'])}"
        )
    parts.append(f"Test input:\n{grid_text(test_input)}\nTest output:\n")
    return "\n\n".join(parts)


def convert(src: Path, out: Path) -> int:
    """Write ``out`` (JSONL, staged then renamed); return the number of samples."""
    lines = []
    for task_id, task in _tasks(src):
        train, tests = _checked(task_id, task)
        for k, test in enumerate(tests):
            record: dict[str, Any] = {
                "id": task_id if len(tests) == 1 else f"{task_id}-{k}",
                "text": render(train, test["input"]),
            }
            if "output" in test:
                record["answer"] = grid_text(test["output"])
            lines.append(json.dumps(record, ensure_ascii=False))
    write_atomic(out, "".join(line + "\n" for line in lines), mode=0o644)
    return len(lines)


def _tasks(src: Path) -> list[tuple[str, Any]]:
    if src.is_dir():
        files = sorted(src.glob("*.json"))
        if not files:
            raise DataError(
                f"no *.json task files in {src}", hint="give an ARC task file or folder"
            )
        return [(f.stem, _load(f)) for f in files]
    if not src.is_file():
        raise DataError(f"no ARC file {src}", hint="give an ARC task file or folder")
    loaded = _load(src)
    if isinstance(loaded, dict) and "train" in loaded:
        return [(src.stem, loaded)]
    if isinstance(loaded, dict):
        return sorted(loaded.items())
    raise DataError(
        f"{src}: not ARC tasks", hint='expected {"TASK_ID": {"train": ..., "test": ...}}'
    )


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not readable JSON ({exc})", hint="check the file") from exc


def _checked(task_id: str, task: Any) -> tuple[list[dict[str, Grid]], list[dict[str, Grid]]]:
    hint = 'a task is {"train": [{"input": GRID, "output": GRID}], "test": [{"input": GRID}]}'
    if not isinstance(task, dict):
        raise DataError(f"task {task_id!r} is not an object", hint=hint)
    train, tests = task.get("train"), task.get("test")
    if not isinstance(train, list) or not isinstance(tests, list) or not tests:
        raise DataError(f"task {task_id!r} lacks its train or test pairs", hint=hint)
    pairs = [(p, ("input", "output")) for p in train] + [(p, ("input",)) for p in tests]
    for pair, keys in pairs:
        if not isinstance(pair, dict) or not all(_is_grid(pair.get(k)) for k in keys):
            raise DataError(f"task {task_id!r} has a pair that is not grids of digits", hint=hint)
    return train, tests


def _is_grid(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(r, list) and all(isinstance(c, int) and 0 <= c <= 9 for c in r)
            for r in value
        )
    )
