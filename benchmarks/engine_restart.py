"""How long a builtin server's engine takes to serve again after ``kill -9``, without and
with JAX's persistent compilation cache (what a fleet's agent gives the builtin engine).

    .venv/bin/python benchmarks/engine_restart.py              # 3 kills per case, ~2 min
    .venv/bin/python benchmarks/engine_restart.py --kills 5 --model PATH
    .venv/bin/python benchmarks/engine_restart.py --busy 2   # 2 processes spinning beside

One server (``python -m tpupod.serve.builtin``, split: keeper, engine, front end) on one
port, options as the chaos harness serves (``--max-batch 4 --max-length 128``). Per case,
the time from its start to the first ``/health`` 200, then ``--kills`` times: the engine
process killed with -9, timed until ``/health`` answers 200 again (its keeper starts a new
engine, which loads the model and warms up). The cases, in one run:

* *no cache*: the anchor (JAX's cache variables removed from the environment);
* *cache, cold*: an empty cache folder, the variables a fleet's agent sets
  (``tpupod.serve.backends.compile_cache_env``): the first start fills it, the restarts
  read it;
* *cache, warm*: the same folder from the start (a fleet served again, ``serve restart``).

``--busy N`` keeps N processes spinning on the CPU throughout (as training and jobs beside a
fleet do in the chaos harness): compiling is CPU work, loading it is not.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from tpupod import settings  # noqa: E402 (after the path above)
from tpupod.serve.backends import Backend, ServerSpec, compile_cache_env  # noqa: E402

TINY = REPO / "tests" / "fixtures" / "qwen2-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def until(check: bool, url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while healthy(url) is not check:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"error: {url} still {'not ' if check else ''}healthy after {timeout}s"
            )
        time.sleep(0.02)


def engine_of(server: subprocess.Popen[bytes]) -> psutil.Process:
    for child in psutil.Process(server.pid).children():
        argv = child.cmdline()
        if "--role" in argv and argv[argv.index("--role") + 1] == "engine":
            return child
    raise SystemExit("error: the server has no engine process (not split?)")


def case(model: Path, kills: int, cache: Path | None) -> tuple[float, list[float]]:
    """The first start's seconds and each restart's, on a server of its own."""
    env = {k: v for k, v in os.environ.items() if k not in settings.JAX_CACHE_VARIABLES}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="")
    if cache is not None:
        spec = ServerSpec(name="b", backend=Backend.BUILTIN, host="h", ports=(1,), model="m")
        env.update(compile_cache_env(spec, cache, {}))
    port = free_port()
    argv = [sys.executable, "-m", "tpupod.serve.builtin", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--ports", str(port), "--max-batch", "4"]
    argv += ["--max-length", "128"]
    url = f"http://127.0.0.1:{port}/health"
    began = time.monotonic()
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until(True, url)
        first = time.monotonic() - began
        restarts = []
        for _ in range(kills):
            engine = engine_of(server)
            began = time.monotonic()
            engine.kill()
            until(False, url, timeout=30)
            until(True, url)
            restarts.append(time.monotonic() - began)
        return first, restarts
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--model", type=Path, default=TINY)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning beside")
    args = parser.parse_args()
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(args.busy)]
    try:
        measure(args)
    finally:
        for proc in busy:
            proc.kill()


def measure(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="tpupod-engine-restart-"))
    rows = []
    for name, cache in (
        ("no cache (anchor)", None),
        ("cache, cold", folder / "cache"),
        ("cache, warm", folder / "cache"),
    ):
        first, restarts = case(args.model, args.kills, cache)
        rows.append((name, first, restarts))
        print(f"{name}: first start {first:.1f} s, restarts {[round(r, 1) for r in restarts]}",
              flush=True)  # fmt: skip
    anchor = statistics.median(rows[0][2])
    print("\n| case | first start (s) | restart after kill -9, median (s) | vs anchor |")
    print("|---|---:|---:|---:|")
    for name, first, restarts in rows:
        median = statistics.median(restarts)
        print(f"| {name} | {first:.1f} | {median:.1f} | {median / anchor:.2f}x |")


if __name__ == "__main__":
    main()
