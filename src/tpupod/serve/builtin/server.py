"""The ``builtin`` backend: tpupod's own OpenAI-compatible server, one process per worker.

    python -m tpupod.serve.builtin --model PATH --host HOST --ports 31000,31001 \\
        [--dtype bfloat16|float32] [--served-model-name NAME] [--max-batch 16] [--max-length 1024]
        [--decode-steps N] [--prefill-tokens N]

One engine per port, each on its own slice of ``jax.local_devices()`` (libtpu
lets one process own a host's TPU, so the engines share a process, as seed
000's ``run_multi_openai_servers`` does with threads): N ports split the
devices into N equal slices, a slice of several devices runs its model
tensor-parallel. Every engine compiles its programs before its port opens;
the port is bound first (a port in use fails before the model loads) and
listens only once warm. ``ready port=P`` is printed per engine once it
answers ``/health``.

``--decode-steps N`` runs N decode steps per device call, the tokens fed back
on the device: on an accelerator a step takes about a millisecond, less than
the host's work a step (dispatch, reading tokens back, text), so the host
looks once per N steps; a stopped request then computes on, in its own slot,
to the end of the call, and a newcomer waits for it.

SIGTERM (or SIGINT): every request in flight or waiting gets an error at once
(a stream ends with an ``error`` event), the ports close, the engines' threads
end, the process exits 0. With ``--no-split``, an engine that owes requests
and finishes no turn for ``--stall-timeout`` s (a hung device call) fails
them with the reason and the process exits 4, for its agent to restart it.

Deferred imports: the keeper (``split.py``) imports this module to read its arguments and
bind the ports, and runs no model: JAX, the model and the engine are imported by the engine
process (``build_engines``), the HTTP app and uvicorn by the front end, httpx (the serve
extra) for the readiness check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpupod import settings
from tpupod.errors import CheckpointError, UsageError
from tpupod.serve import defaults, eventloop
from tpupod.serve.builtin.events import stalled_message

if TYPE_CHECKING:
    from tpupod.serve.builtin.engine import Engine

SHUTDOWN_MESSAGE = "the server is shutting down"
STALLED_EXIT = 4  # --no-split: an engine made no progress with work owed (its agent restarts it)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tpupod.serve.builtin",
        description="tpupod's OpenAI-compatible server: one engine per port, one process.",
    )
    parser.add_argument("--model", required=True, help="checkpoint folder (local or gs://)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--ports", required=True, help="comma-separated, one engine per port")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="weights and compute (default: float32 on a CPU, else bfloat16)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients ask for (default: the model folder's name)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="KV-cache slots per engine: requests decoded together",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=1024,
        help="positions per slot: prompt and answer of one request",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=None,
        help="tokens of newcomers' prompts prefilled together (default: 512; least: --max-length)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="decode steps per device call (default: 1 on a CPU, else 8)",
    )
    parser.add_argument(
        "--smallest-span",
        type=int,
        default=defaults.SMALLEST_SPAN,
        metavar="N",
        help="decode attends over the smallest of N, 2N, 4N ... positions that holds its "
        "rows, one program each compiled at start (at least --max-length: the whole slot, "
        "one program)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=defaults.STALL_TIMEOUT_S,
        metavar="S",
        help="restart the engine process when requests are in flight and it has sent "
        "nothing for S seconds (they end with the reason), and the front end when its "
        "/health has not answered for S seconds (--no-split: the process exits 4 and its "
        "agent restarts it; 0: never)",
    )
    parser.add_argument(
        "--no-split",
        action="store_true",
        help="HTTP and engines in one process (the engine's thread shares the interpreter)",
    )
    # the roles of the split server's processes (split.py starts them)
    parser.add_argument("--role", choices=["engine", "frontend"], help=argparse.SUPPRESS)
    parser.add_argument("--ipc", help=argparse.SUPPRESS)
    parser.add_argument("--fds", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def parse_ports(text: str) -> list[int]:
    try:
        ports = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(
            f"--ports {text!r} is not a list of port numbers", hint="e.g. --ports 31000,31001"
        ) from None
    if not ports or any(not 0 < p < 65536 for p in ports) or len(set(ports)) != len(ports):
        raise UsageError(
            f"--ports {text!r}: give distinct ports in 1..65535", hint="e.g. --ports 31000,31001"
        )
    return ports


def model_name(path: str) -> str:
    return Path(path.rstrip("/")).name or path


def device_slices(devices: Sequence[object], engines: int) -> list[list[object]]:
    """The devices of each engine: equal, contiguous slices."""
    if len(devices) < engines:
        raise UsageError(
            f"{engines} ports need at least {engines} devices; this host has {len(devices)}",
            hint="give fewer ports (one engine per port, each on its own devices)",
        )
    if len(devices) % engines:
        raise UsageError(
            f"{engines} ports do not divide this host's {len(devices)} devices",
            hint=f"give a number of ports that divides {len(devices)}",
        )
    per = len(devices) // engines
    return [list(devices[i * per : (i + 1) * per]) for i in range(engines)]


def bind(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) socket: clients are refused until the engine is warm."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        # run by an agent (it sets TPUPOD_SERVE_PORTS), the ports came from 'serve up'
        by_agent = settings.named("TPUPOD_SERVE_PORTS") is not None
        where = "--base-port of 'tpupod serve up'" if by_agent else "--ports"
        raise UsageError(
            f"cannot bind {host}:{port}: {exc.strerror}",
            hint=f"another process holds the port: choose other ports ({where})",
        ) from exc
    sock.set_inheritable(True)
    return sock


def check_args(args: argparse.Namespace) -> list[int]:
    """The options' values checked before anything starts; the ports."""
    ports = parse_ports(args.ports)
    if args.max_batch < 1 or args.max_length < 2 or (args.decode_steps or 1) < 1:
        raise UsageError("--max-batch and --decode-steps must be >= 1, --max-length >= 2")
    if args.smallest_span < 1:
        raise UsageError(
            f"--smallest-span {args.smallest_span}: give a number of positions >= 1",
            hint=f"the default is {defaults.SMALLEST_SPAN}; at least --max-length: one span",
        )
    check_stall_timeout(args.stall_timeout)
    return ports


def check_stall_timeout(seconds: float) -> None:
    """``--stall-timeout``, of a builtin server or a replica's member, checked."""
    if seconds < 0:
        raise UsageError(
            f"--stall-timeout {seconds:g}: give seconds >= 0",
            hint=f"the default is {defaults.STALL_TIMEOUT_S:g}; 0: a silent engine or front end "
            "is never restarted",
        )


def serve_here(args: argparse.Namespace, sockets: list[socket.socket], ports: list[int]) -> int:
    """Every engine in this process (``--no-split``): load, warm, serve until stopped."""
    engines = build_engines(args, len(ports))
    warm(engines)
    eventloop.use_uvloop()
    name = served_name(args)
    serving = serve_engines(engines, sockets, ports, args.host, name, stall_s=args.stall_timeout)
    code = asyncio.run(serving)
    if code == STALLED_EXIT:  # a hung device call would hold the interpreter's exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def check_model_folder(model: str) -> None:
    """Before JAX loads (seconds on a busy host): a wrong path fails at once."""
    if "://" not in model and not Path(model).expanduser().is_dir():
        raise CheckpointError(
            f"--model {model}: no such folder",
            hint="give a checkpoint folder (config.json, *.safetensors) or a gs:// URL",
        )


def served_name(args: argparse.Namespace) -> str:
    return str(args.served_model_name or model_name(args.model))


def build_engines(args: argparse.Namespace, count: int) -> list[Engine]:
    """One engine per port, each on its own slice of this host's devices (not yet warm)."""
    import jax

    from tpupod.model import load_model, make_mesh
    from tpupod.serve.builtin.engine import Engine

    slices = device_slices(jax.local_devices(), count)
    cpu = jax.default_backend() == "cpu"
    dtype = args.dtype or ("float32" if cpu else "bfloat16")
    # a step on a CPU takes long enough that a host round trip a step costs little
    decode_steps = args.decode_steps or (1 if cpu else 8)
    engines = []
    for devices in slices:
        model = load_model(args.model, dtype=dtype, mesh=make_mesh(1, len(devices), devices))
        engines.append(
            Engine(
                model,
                max_batch=args.max_batch,
                max_length=args.max_length,
                decode_steps=decode_steps,
                prefill_tokens=args.prefill_tokens,
                smallest_span=args.smallest_span,
            )
        )
    return engines


def warm(engines: list[Engine]) -> None:
    """Compile every engine's programs, the engines side by side."""
    errors: list[BaseException] = []

    def warm(engine: Engine) -> None:
        try:
            engine.warmup()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=warm, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


async def serve_engines(
    engines: list[Engine],
    sockets: list[socket.socket],
    ports: list[int],
    host: str,
    name: str,
    *,
    stall_s: float = 0.0,
) -> int:
    """Serve ``engines`` in this process (``--no-split``, and a multi-host replica's leader).
    With ``stall_s``, an engine that owes requests and makes no progress for that long
    fails them with the reason and the server stops, returning :data:`STALLED_EXIT` (its
    agent restarts it), as the split server restarts its engine."""
    from tpupod.serve.builtin.openai_api import create_app, loop_dispatch

    loop = asyncio.get_running_loop()
    for engine, port in zip(engines, ports, strict=True):
        engine.dispatch = loop_dispatch(loop)
        engine.start(f"engine-{port}")

    def stop() -> None:
        for engine in engines:
            engine.shutdown(SHUTDOWN_MESSAGE, timeout=0)

    stalled = asyncio.Event()
    watch = asyncio.create_task(watch_progress(engines, stall_s, stalled)) if stall_s else None
    apps = [create_app(engine, name) for engine in engines]
    try:
        await serve_apps(apps, sockets, ports, host, stop, stop_on=stalled)
    finally:
        if watch is not None:
            watch.cancel()
    if stalled.is_set():
        return STALLED_EXIT  # the stalled engine's thread will not end: no join
    for engine in engines:
        engine.shutdown(SHUTDOWN_MESSAGE, timeout=10)
    return 0


async def watch_progress(engines: list[Engine], stall_s: float, stalled: asyncio.Event) -> None:
    """Fail an engine's requests and set ``stalled`` once it owes some and has finished no
    turn for ``stall_s`` (a hung device call, a deadlock: its thread cannot be stopped)."""
    while True:
        await asyncio.sleep(min(1.0, stall_s / 4))
        for engine in engines:
            if engine.stalled(stall_s):
                reason = stalled_message(stall_s, engine.running + engine.waiting)
                print(f"error: {reason}", file=sys.stderr, flush=True)
                engine.shutdown(reason, timeout=0)
                stalled.set()
                return


async def serve_apps(
    apps: Sequence[Any],
    sockets: list[socket.socket],
    ports: list[int],
    host: str,
    on_stop: Callable[[], None],
    *,
    stop_on: asyncio.Event | None = None,
) -> None:
    """Serve each app on its socket until SIGTERM/SIGINT or ``stop_on`` is set (``on_stop``
    first fails what is in flight); print ``ready port=P`` once each answers /health."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # one handler for all, below
            yield

    servers = []
    for app in apps:
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=3,
            timeout_keep_alive=30,
        )
        servers.append(Server(config))

    def stop() -> None:
        on_stop()
        for server in servers:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)

    async def stop_when_set() -> None:
        await (stop_on or asyncio.Event()).wait()
        stop()

    stop_on_set = asyncio.create_task(stop_when_set())
    pairs = zip(servers, sockets, strict=True)
    tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, sock in pairs]
    probe = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    try:
        await asyncio.gather(*(_announce(t, probe, p) for t, p in zip(tasks, ports, strict=True)))
        await asyncio.gather(*tasks)
    finally:
        stop_on_set.cancel()


async def _announce(task: asyncio.Task[Any], host: str, port: int) -> None:
    """Print ``ready port=P`` once the engine's server answers /health."""
    import httpx

    url = f"http://{host}:{port}/health" if ":" not in host else f"http://[{host}]:{port}/health"
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        while not task.done():
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    print(f"ready port={port}", flush=True)
                    return
            await asyncio.sleep(0.05)
