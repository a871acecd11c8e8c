"""``tpupod.latest_checkpoint(dir)``: the newest complete Orbax step in a checkpoint folder.

Orbax writes a step into ``STEP.orbax-checkpoint-tmp-N`` and renames it to ``STEP``
when it is complete (on a local disk); on Cloud Storage, where a rename is not
atomic, a complete step holds ``commit_success.txt``. A step a preemption cut short
is therefore a temporary folder, or (on gs://) a folder without that file, and is
skipped. Names may carry a prefix (``step_100``: ``step_prefix`` of the manager).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

STEP_RE = re.compile(r"^(?:.*_)?(\d+)$")
TMP_MARK = ".orbax-checkpoint-tmp"
COMMIT_FILE = "commit_success.txt"


def latest_checkpoint(directory: str | Path) -> int | None:
    """The newest complete step under ``directory`` (a path, or an fsspec URL such as
    ``gs://bucket/ckpt``); None when there is none (a first attempt)."""
    fs, root = _filesystem(str(directory))
    fs.invalidate_cache(root)  # a listing cached before the last attempt wrote is stale
    if not fs.exists(root):
        return None
    steps = []
    for entry in fs.ls(root, detail=True):
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        match = STEP_RE.match(name)
        if entry.get("type") != "directory" or TMP_MARK in name or match is None:
            continue
        if not _local(fs) and not fs.exists(f"{str(entry['name']).rstrip('/')}/{COMMIT_FILE}"):
            continue  # on object storage a step is complete once its commit file is there
        steps.append(int(match.group(1)))
    return max(steps, default=None)


def _filesystem(url: str) -> tuple[Any, str]:
    # an extra's: a remote checkpoint folder only
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    return fs, root


def _local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")
