"""One member of a multi-host replica: ``python -m tpupod.serve.replica``.

    python -m tpupod.serve.replica --model PATH --host HOST --port P \\
        --rank R --size K --leader HOST:SIDE_PORT --coordinator-port C --worker W \\
        [--dtype D] [--mesh model=M] [--max-batch N] [--max-length L] [--decode-steps N]
        [--smallest-span N]
        [--served-model-name NAME] [--lockstep-timeout S] [--rendezvous-timeout S]
        [--stall-timeout S]

K processes, one per worker of a group, serve one model sharded over all the
group's devices. The agent of each worker runs its member; the members meet as
``tpupod run``'s workers do, before JAX starts:

1. the leader (rank 0) binds its HTTP port (not yet listening) and the side
   channel (``lockstep.py``); every follower connects to it and says who it is
   and the digests of its code and config;
2. the leader compares them with its own and either refuses the group (naming
   the odd worker; every member exits 2, nothing is compiled) or hands out a
   new launch id and JAX's coordinator address (the leader's host,
   ``--coordinator-port``);
3. every member starts JAX's distributed runtime (gloo on a CPU), loads the
   model on the ``(data, model)`` mesh over all the group's devices, and
   compiles the engine's programs (each the same programs in the same order);
4. the leader serves the OpenAI endpoint and runs the continuous-batching
   engine; before every device call it broadcasts the call's inputs, and the
   followers (no endpoint, no decisions) run the same jitted program on them.

A member that dies or stops takes the replica down: the others see it within
``--lockstep-timeout`` s (at once for a death), the leader fails every request
in flight or waiting (a stream ends with an ``error`` event) and every member
exits 3; each worker's agent restarts its member, and the group forms again
under a new launch id. A device call that hangs on every member while their
processes and heartbeats go on is not seen by the side channel: the leader's
engine then finishes no turn, and after ``--stall-timeout`` s with requests
owed the leader fails them with the reason and exits 4 (the followers see it
go at once).

Deferred imports: JAX, the model and the engines are imported once the members have met
(``start_jax``), so a member binds its ports and joins the rendezvous at once, and what
reads its arguments (``model_axis``, the tests) imports no JAX; the builtin server's modules
when this member leads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tpupod
from tpupod import settings
from tpupod.errors import TpupodError, UsageError
from tpupod.pod.names import new_launch_id
from tpupod.serve import defaults, eventloop
from tpupod.serve.replica.lockstep import (
    DEFAULT_TIMEOUT_S,
    Follower,
    Hello,
    Leader,
    LockstepError,
    exit_soon,
)

LOST_EXIT = 3  # a member of the replica went away
REFUSED_EXIT = 2  # the group did not form (a refusal, a member missing)
DOWN_MESSAGE = "the replica lost a member ({reason}); it is restarting"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tpupod.serve.replica",
        description="one member of a replica served by several hosts in lockstep",
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="this worker's address")
    parser.add_argument("--port", type=int, required=True, help="the leader's HTTP port")
    parser.add_argument("--rank", type=int, required=True, help="0: the leader")
    parser.add_argument("--size", type=int, required=True, help="processes in the replica")
    parser.add_argument("--leader", required=True, help="HOST:PORT of the leader's side channel")
    parser.add_argument("--coordinator-port", type=int, required=True)
    parser.add_argument("--worker", type=int, default=0, help="this worker's id (for messages)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    parser.add_argument("--mesh", default=None, help="model=M (default: every device)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--smallest-span", type=int, default=defaults.SMALLEST_SPAN, metavar="N")
    parser.add_argument("--lockstep-timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=defaults.STALL_TIMEOUT_S,
        metavar="S",
        help="the leader ends the replica (exit 4; the agents restart it) when requests are "
        "in flight and its engine has made no progress for S seconds: a device call that "
        "hangs on every member, which the side channel cannot see (0: never)",
    )
    parser.add_argument("--rendezvous-timeout", type=float, default=120.0)
    return parser.parse_args(argv)


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--leader {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def code_digest() -> str:
    """tpupod's own source files, JAX's version, and ``tpupod run``'s commit and config."""
    import jax

    digest = hashlib.sha256(jax.__version__.encode())
    root = Path(tpupod.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    for part in settings.program_identity():
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def config_digest(args: argparse.Namespace) -> str:
    """What every member must agree on: the checkpoint's config and the serving options."""
    from tpupod.model import loading

    folder = loading.localize(args.model)
    chosen = {
        "config": json.loads((folder / "config.json").read_text()),
        "options": [args.size, args.dtype, args.mesh, args.max_batch, args.max_length],
        "decode_steps": args.decode_steps,
        "smallest_span": args.smallest_span,  # the same decode programs on every member
    }
    return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]


def model_axis(mesh: str | None, devices: int) -> int:
    if mesh is None:
        return devices
    key, _, value = mesh.partition("=")
    if key.strip() != "model" or not value.strip().isdigit():
        raise UsageError(f"--mesh {mesh!r}: give model=M", hint="e.g. --mesh model=4")
    width = int(value)
    if width < 1 or devices % width:
        raise UsageError(f"--mesh model={width} does not divide the replica's {devices} devices")
    return width


def start_jax(coordinator: str, size: int, rank: int, timeout: float) -> None:
    import jax

    # Always: a worker of an SSH pod may run JAX on its CPU without JAX_PLATFORMS=cpu, and
    # the setting touches only the CPU backend's collectives (none on a TPU or GPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=size,
        process_id=rank,
        initialization_timeout=int(timeout),
    )


def build_engine(args: argparse.Namespace) -> Any:
    """The model on the mesh over every process's devices, and its engine, compiled."""
    import jax

    from tpupod.model import load_model, make_mesh
    from tpupod.serve.replica.stepped import LockstepEngine

    devices = jax.devices()
    width = model_axis(args.mesh, len(devices))
    cpu = jax.default_backend() == "cpu"
    dtype = args.dtype or ("float32" if cpu else "bfloat16")
    data = len(devices) // width
    if args.max_batch % data:
        raise UsageError(
            f"--max-batch {args.max_batch}: the mesh's data axis of {data} splits the slots",
            hint=f"give a --max-batch that {data} divides",
        )
    mesh = make_mesh(data, width, devices)
    model = load_model(args.model, dtype=dtype, mesh=mesh)
    engine = LockstepEngine(
        model,
        max_batch=args.max_batch,
        max_length=args.max_length,
        decode_steps=args.decode_steps or (1 if cpu else 8),
        smallest_span=args.smallest_span,
    )
    engine.warmup()
    return engine


def lead(args: argparse.Namespace, own: Hello) -> int:
    from tpupod.serve.builtin import server as builtin

    http = builtin.bind(args.host, args.port)
    side_host, side_port = split_address(args.leader)
    listener = socket.socket(socket.AF_INET6 if ":" in side_host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((side_host, side_port))
    except OSError as exc:
        raise UsageError(f"cannot bind the side channel {args.leader}: {exc.strerror}") from exc
    listener.listen(64)
    leader = Leader(listener, args.size - 1, args.lockstep_timeout, args.rendezvous_timeout)
    members = leader.gather(own, args.rendezvous_timeout)
    launch_id = new_launch_id()
    coordinator = f"{side_host}:{args.coordinator_port}"
    leader.welcome(launch_id, coordinator)
    names = ", ".join(h.label for h in members)
    print(f"replica launch {launch_id}: leader w{args.worker}, followers {names}", flush=True)

    def lost_early(reason: str) -> None:
        print(f"error: {DOWN_MESSAGE.format(reason=reason)}", file=sys.stderr, flush=True)
        exit_soon(LOST_EXIT, 0)

    leader.watch(lost_early)
    start_jax(coordinator, args.size, 0, args.rendezvous_timeout)
    engine = build_engine(args)

    def lost(reason: str) -> None:
        message = DOWN_MESSAGE.format(reason=reason)
        print(f"error: {message}", file=sys.stderr, flush=True)
        engine.shutdown(message, timeout=0)  # every request in flight or waiting fails now
        exit_soon(LOST_EXIT, 0.5)  # time for the errors to go out

    leader.set_failure_handler(lost)
    engine.channel = leader
    name = args.served_model_name or builtin.model_name(args.model)
    eventloop.use_uvloop()
    serving = builtin.serve_engines(
        [engine], [http], [args.port], args.host, name, stall_s=args.stall_timeout
    )
    code = asyncio.run(serving)  # STALLED_EXIT: main's os._exit leaves the hung engine behind
    leader.close()
    return code


def follow(args: argparse.Namespace, own: Hello) -> int:
    from tpupod.serve.replica.stepped import follow_steps

    follower = Follower(args.lockstep_timeout, args.rendezvous_timeout)
    welcome = follower.join(split_address(args.leader), own, args.rendezvous_timeout)
    print(f"replica launch {welcome['launch_id']}: follower w{args.worker}", flush=True)

    def lost(reason: str) -> None:
        print(f"error: {DOWN_MESSAGE.format(reason=reason)}", file=sys.stderr, flush=True)
        exit_soon(LOST_EXIT, 0)

    follower.watch(lost)
    start_jax(welcome["coordinator"], args.size, args.rank, args.rendezvous_timeout)
    engine = build_engine(args)
    print(f"follower w{args.worker} ready", flush=True)
    # It ends when the leader is gone: ``lost`` has said so, and the exit is a lost member's
    # (the watch thread's own exit races this one, with the same code).
    with contextlib.suppress(LockstepError):
        follow_steps(engine, follower)
    return LOST_EXIT


def run(args: argparse.Namespace) -> int:
    from tpupod.serve.builtin.server import check_stall_timeout

    if args.size < 2 or not 0 <= args.rank < args.size:
        raise UsageError("--size must be >= 2 and --rank in 0..size-1")
    check_stall_timeout(args.stall_timeout)
    own = Hello(args.rank, args.worker, code_digest(), config_digest(args))
    return lead(args, own) if args.rank == 0 else follow(args, own)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except TpupodError as exc:
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr, flush=True)
        return REFUSED_EXIT if isinstance(exc, LockstepError) else exc.exit_code
