"""Cost of turning a worker's output bytes into lines (``tpupod.transport.lines``).

Every byte a worker prints goes through ``LineSplitter.feed`` on the launcher, for
every worker, so its cost per 64 KiB chunk bounds how much output one launcher core
can label. Three kinds of output, each fed in 64 KiB chunks:

* ``lines``: 80-byte lines (a training log);
* ``bar``: a progress bar redrawn with ``\\r`` 819 times a chunk (tqdm at full speed);
* ``endless``: one line with no newline at all (cut every 64 KiB).

The anchor is ``bytes.splitlines`` on the same chunk (C, no decoding: the floor).
``--before FILE`` times another version of ``lines.py`` in the same run, rounds
interleaved::

    git show 0ff6ec6~1:src/tpupod/transport/lines.py > /tmp/lines_before.py
    .venv/bin/python benchmarks/line_split.py --before /tmp/lines_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import tpupod.transport.lines as current

CHUNK = 64 * 1024
INPUTS = {
    "lines": (b"x" * 79 + b"\n") * (CHUNK // 80),
    "bar": b"".join(b"\r%3d%%|%-20s| %d/819" % (i * 100 // 819, b"#" * (i // 41), i)
                    for i in range(819))[:CHUNK],
    "endless": b"y" * CHUNK,
}  # fmt: skip


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("lines_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_chunk_us(feed: Callable[[bytes], object], chunk: bytes, chunks: int) -> float:
    started = time.perf_counter()
    for _ in range(chunks):
        feed(chunk)
    return (time.perf_counter() - started) / chunks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="another lines.py, timed in the same run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=200, help="chunks fed per round")
    args = parser.parse_args()
    versions: dict[str, ModuleType] = {"tpupod": current}
    if args.before:
        versions["before"] = load(args.before)
    print(f"# {platform.node()}, Python {platform.python_version()}, {args.rounds} rounds "
          f"of {args.chunks} chunks of 64 KiB, medians in microseconds per chunk")  # fmt: skip
    print("| output | splitlines (anchor) | " + " | ".join(versions) + " |")
    print("| --- | ---: |" + " ---: |" * len(versions))
    for name, chunk in INPUTS.items():
        times: dict[str, list[float]] = {"anchor": [], **{v: [] for v in versions}}
        for _ in range(args.rounds):
            times["anchor"].append(per_chunk_us(bytes.splitlines, chunk, args.chunks))
            for version, module in versions.items():
                splitter = module.LineSplitter()
                times[version].append(per_chunk_us(splitter.feed, chunk, args.chunks))
        anchor = statistics.median(times["anchor"])
        cells = [f"{anchor:,.0f}"]
        for version in versions:
            median = statistics.median(times[version])
            cells.append(f"{median:,.0f} ({median / anchor:.1f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
