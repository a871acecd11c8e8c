"""A worker's command in a container: the ``ENGINE run`` line, the checks before, the cleanup after.

Every worker runs ``ENGINE run --rm --init --name tpupod-<launch>-w<N> --network=host
-e ... -v ... [--privileged | --device /dev/accel* /dev/vfio/*] IMAGE sh -c CMD``.
The variables that make a tpupod worker (identity, rendezvous, coordinator: every
``TPUPOD_*``, ``TPU_*``, ``JAX_*``, ``XLA_*``, ``MEGASCALE_*``, ``LIBTPU_*``) and the ones
named by ``--env`` or the pod spec are passed through by name, so ``tpupod.init_jax()``
works inside as outside.

The engine's client is in the command's process group, so a stop's TERM reaches it and
it passes the signal on to the container (catatonit or tini as PID 1 passes it to the
program); but the container itself is the engine's (conmon, containerd), not ours: a
KILL of the client leaves it running. So each worker also starts a reaper in a session
of its own that removes the container once the command's shell is gone, however it
ended (a stop, the orphan guard, a lost connection), and the launcher removes every
container of the launch itself before it returns.

Podman asks for 1,048,576 open files and processes in every container unless
containers.conf says otherwise, and a host whose hard limits are lower refuses
("error setting rlimit type 7: operation not permitted") unless the engine may raise
them (CAP_SYS_RESOURCE). So on podman the worker's shell, the one that runs the engine,
reads its own hard limits and passes ``--ulimit nofile=N:N --ulimit nproc=P:P`` where
they are below that default: nproc is also kept within ``kernel.pid_max``, because
podman lowers its own nproc limit to pid_max as it starts (measured here: hard nproc
96,365, pid_max 32,768, and ``--ulimit nproc=32769`` is refused). Docker's containers
get the daemon's limits, not the client's, so nothing is passed there. Podman drops
every ``default_ulimits`` of containers.conf for a container given any ``--ulimit``, so
where a containers.conf names them, they govern and nothing is passed either.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from tpupod.errors import PreflightError, UsageError
from tpupod.fanout.context import Context
from tpupod.fanout.execute import Policy, execute_async, run_on
from tpupod.fanout.results import FanoutResult
from tpupod.image.container_engine import force_remove, pick_engine, raise_unusable
from tpupod.pod.names import new_launch_id
from tpupod.pod.record import Pod, Worker
from tpupod.providers import Connector

PASSED_PREFIXES = ("TPUPOD_", "TPU_", "JAX_", "XLA_", "MEGASCALE_", "LIBTPU_")
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/*")
CHECK_TIMEOUT_S = 30.0
CLEANUP_TIMEOUT_S = 30.0
IMAGE_LINE = "tpupod-image:"
# How often a worker's reaper looks whether the command's shell is gone.
REAPER_POLL_S = 0.2
# Podman's nofile and nproc for a container when containers.conf names none.
PODMAN_DEFAULT_LIMIT = 1048576
# On podman: --ulimit NAME=L:L, L the lowest of the numbers given, where below the default,
# unless a containers.conf names default_ulimits (podman drops them all for a --ulimit).
# Builtins only (a fork costs up to 10 ms on a loaded host); the files are read only when
# there is a limit to pass (about 4 ms for the limits, 8 for Debian's 24 kB defaults file).
FIT_LIMITS = r"""tpupod_fit() {
  local l=DEFAULT x
  for x in "${@:2}"; do
    case $x in ''|*[!0-9]*) ;; *) if [ "$x" -lt "$l" ]; then l=$x; fi;; esac
  done
  if [ "$l" -lt DEFAULT ]; then tpupod_limits+=(--ulimit "$1=$l:$l"); fi
}
tpupod_named() {
  local files=("$CONTAINERS_CONF") f text re=$'\n[[:space:]]*default_ulimits *= *[[] *("|\n)'
  if [ -z "$CONTAINERS_CONF" ]; then
    files=(/usr/share/containers/containers.conf /etc/containers/containers.conf
      /etc/containers/containers.conf.d/*.conf)
    if [ "$EUID" != 0 ]; then
      files+=("${XDG_CONFIG_HOME:-$HOME/.config}/containers/containers.conf")
    fi
  fi
  for f in "${files[@]}"; do
    [ -r "$f" ] && IFS= read -r -d '' text < "$f"
    if [[ $'\n'$text$'\n' =~ $re ]]; then return 0; fi
  done
  return 1
}
if [ "${tpupod_engine##* }" = podman ]; then
  tpupod_limits=()
  while read -r tpupod_a tpupod_b tpupod_c tpupod_d tpupod_e _; do
    case "$tpupod_a $tpupod_b $tpupod_c" in
      "Max open files") tpupod_n=$tpupod_e;;
      "Max processes "*) tpupod_u=$tpupod_d;;
    esac
  done < /proc/$$/limits
  read -r tpupod_p < /proc/sys/kernel/pid_max
  tpupod_fit nofile "$tpupod_n"
  tpupod_fit nproc "$tpupod_u" "$tpupod_p"
  if [ ${#tpupod_limits[@]} -gt 0 ] && ! tpupod_named; then tpupod_args+=("${tpupod_limits[@]}"); fi
fi""".replace("DEFAULT", str(PODMAN_DEFAULT_LIMIT))


@dataclass(frozen=True)
class Mount:
    source: str  # on the worker; a leading ~/ is the worker's home
    target: str
    mode: str = ""  # "", "ro" or "rw"

    @classmethod
    def parse(cls, text: str) -> Mount:
        """``SRC:DST`` or ``SRC:DST:ro`` (as ``docker run -v``)."""
        parts = text.split(":")
        mode = parts.pop() if len(parts) == 3 and parts[2] in ("ro", "rw") else ""
        if len(parts) != 2 or not all(parts) or not parts[1].startswith("/"):
            raise UsageError(
                f"--mount {text!r}",
                hint="SRC:DST or SRC:DST:ro, DST an absolute path in the container",
            )
        return cls(parts[0], parts[1], mode)

    def volume(self) -> str:
        """The ``-v`` value as a bash word (the source's ~/ expanded on the worker)."""
        target = f":{self.target}" + (f":{self.mode}" if self.mode else "")
        if self.source.startswith("~/"):
            return '"$HOME"/' + shlex.quote(self.source[2:] + target)
        return shlex.quote(self.source + target)


@dataclass(frozen=True)
class Container:
    """How a command runs in a container on every worker."""

    image: str
    engine: str | None = None  # docker, podman, or None: docker where present
    mounts: tuple[Mount, ...] = ()
    env_names: tuple[str, ...] = ()  # passed through by name (their values are the worker's)
    privileged: bool = False
    workdir_mounted: bool = False  # mount the command's directory and start there


def container_name(launch_id: str) -> str:
    """The bash word naming this worker's container of a launch."""
    return f'"tpupod-{launch_id}-w${{TPUPOD_WORKER_ID:-0}}"'


def wrap(command: str, container: Container, launch_id: str) -> str:
    """The bash that runs ``command`` (a shell line) in ``container`` on a worker."""
    name = container_name(launch_id)
    passed = "|".join(f"{prefix}*" for prefix in PASSED_PREFIXES)
    options = [
        "--rm",
        "--init",
        "--name",
        name,
        "--network=host",
        *(f"-e {shlex.quote(env)}" for env in container.env_names),
        *(f"-v {mount.volume()}" for mount in container.mounts),
        *(['-v "$PWD:$PWD"', '-w "$PWD"'] if container.workdir_mounted else []),
        *(["--privileged"] if container.privileged else []),
    ]
    reaper = (
        f'while kill -0 "$1" 2>/dev/null; do sleep {REAPER_POLL_S:g}; done; '
        f"tpupod_engine=$3; {force_remove(chr(34) + '$2' + chr(34))}"
    )
    lines = [
        pick_engine(container.engine),
        "tpupod_args=()",
        "for tpupod_v in $(compgen -e); do",
        f'  case $tpupod_v in {passed}) tpupod_args+=(-e "$tpupod_v");; esac',
        "done",
    ]
    if not container.privileged:
        lines += [
            f"for tpupod_d in {' '.join(ACCELERATOR_DEVICES)}; do",
            '  if [ -e "$tpupod_d" ]; then tpupod_args+=(--device "$tpupod_d"); fi',
            "done",
        ]
    lines += [
        FIT_LIMITS,
        f'setsid bash -c {shlex.quote(reaper)} tpupod-reaper $$ {name} "$tpupod_engine" '
        "</dev/null >/dev/null 2>&1 &",
        "disown $!",
        f'$tpupod_engine run {" ".join(options)} "${{tpupod_args[@]}}" '
        f"{shlex.quote(container.image)} /bin/sh -c {shlex.quote(command)}",
    ]
    return "\n".join(lines)


def check_script(container: Container) -> str:
    """Print the image's id on the worker, or exit: 127 without an engine (or Docker without
    its daemon), 3 without the image."""
    image = shlex.quote(container.image)
    return "\n".join(
        [
            pick_engine(container.engine),
            f"tpupod_id=$($tpupod_engine image inspect --format '{{{{.Id}}}}' {image} 2>/dev/null)"
            f' || {{ tpupod_daemon; echo "{IMAGE_LINE} missing"; exit 3; }}',
            f'echo "{IMAGE_LINE} ${{tpupod_id#sha256:}} ${{tpupod_engine##* }}"',
        ]
    )


async def check_workers(
    pod: Pod, connector: Connector, workers: Sequence[Worker], container: Container
) -> str:
    """Every worker has an engine and the same image; its id, or a PreflightError."""
    # The workers of a local pod are this machine, one engine and storage: one look answers
    # for all (four at once cost a 4-worker launch about 0.1 s of this machine's CPU).
    shared = pod.on_this_machine
    result = await run_on(
        Context(pod, connector=connector),
        check_script(container),
        workers=workers[:1] if shared else workers,
        policy=Policy(timeout=CHECK_TIMEOUT_S),
        guard=True,
    )
    raise_unusable(result.workers)
    ids: dict[int, str] = {}
    for r in result.workers:
        line = next((t for t in reversed(r.tail) if t.startswith(IMAGE_LINE)), "")
        words = line.split()
        if not r.ok or len(words) < 2 or words[1] == "missing":
            missing = (
                [w.label for w in workers]
                if shared
                else [w.worker.label for w in result.workers if not w.ok]
            )
            why = r.outcome_text() if words[1:2] != ["missing"] else "missing"
            raise PreflightError(
                f"image {container.image} is not on {', '.join(missing)} ({why})",
                hint=f"'tpupod image build -t {container.image} ...' builds it on every worker",
            )
        ids[r.worker.id] = words[1]
    if len(set(ids.values())) > 1:
        differing = ", ".join(f"w{w}: {i[:12]}" for w, i in sorted(ids.items()))
        raise PreflightError(
            f"image {container.image} differs between workers ({differing})",
            hint=f"'tpupod image build -t {container.image} ...' gives every worker the same",
        )
    return next(iter(ids.values()), "")


def cleanup_script(engine: str | None, launch_id: str) -> str:
    """Remove this worker's container of the launch, if it is still there."""
    name = container_name(launch_id)
    return "\n".join([pick_engine(engine), f"tpupod_name={name}", force_remove('"$tpupod_name"')])


async def remove_containers(
    pod: Pod,
    connector: Connector,
    workers: Sequence[Worker],
    engine: str | None,
    launch_id: str,
) -> FanoutResult:
    """Remove what is left of the launch's containers on every worker (stop, then kill)."""
    return await execute_async(
        pod,
        cleanup_script(engine, launch_id),
        workers=workers,
        connector=connector,
        timeout=CLEANUP_TIMEOUT_S,
    )


# runc's words when the engine asks for more than the host allows: "... error setting rlimit
# type 8: operation not permitted" (Docker's come "from daemon": its config is elsewhere).
RLIMIT_REFUSED = re.compile(r"error setting rlimit type (\d+)")
# Linux's resource numbers, by podman's names for them.
RLIMIT_NAMES = (
    "cpu",
    "fsize",
    "data",
    "stack",
    "core",
    "rss",
    "nproc",
    "nofile",
    "memlock",
    "as",
    "locks",
    "sigpending",
    "msgqueue",
    "nice",
    "rtprio",
    "rttime",
)
# What to change in default_ulimits, each checked here to start a container.
RLIMIT_FIXES = {
    "nofile": "lower nofile to at most the worker's 'ulimit -Hn'",
    "nproc": "lower nproc to at most the lower of the worker's 'ulimit -Hu' and "
    "/proc/sys/kernel/pid_max (podman keeps its own nproc within pid_max)",
}


def limit_hint(tail: Sequence[str]) -> str | None:
    """What to change when podman could not give a container a limit of containers.conf's
    default_ulimits (where a containers.conf names none, tpupod fits nofile and nproc itself)."""
    for line in tail:
        refused = RLIMIT_REFUSED.search(line)
        if refused and "daemon" not in line and int(refused[1]) < len(RLIMIT_NAMES):
            name = RLIMIT_NAMES[int(refused[1])]
            fix = RLIMIT_FIXES.get(
                name, f"remove {name} (the container then gets the worker's own)"
            )
            return (
                f"the engine asks for more {name} than this worker allows: in default_ulimits "
                "of containers.conf (/etc/containers/containers.conf, or the file "
                f"$CONTAINERS_CONF names), {fix}; or delete default_ulimits, and tpupod fits "
                "nofile and nproc to each worker itself"
            )
    return None


def explain(result: FanoutResult) -> FanoutResult:
    """The result with a hint on each worker whose engine could not start its container
    for a reason we know (the engine's message alone rarely says what to change)."""
    workers = []
    for worker in result.workers:
        hint = None if worker.ok or worker.hint else limit_hint(worker.tail)
        workers.append(worker.replace(hint=hint) if hint else worker)
    return result.replace(workers=workers)


async def execute_in_containers(
    ctx: Context,
    command: str,
    container: Container,
    *,
    workers: Sequence[Worker],
    policy: Policy,
    env: dict[str, str] | None = None,
) -> FanoutResult:
    """``exec --image``: check the image, run ``command`` in a container on every worker,
    then remove whatever is left of them."""
    pod, connector = ctx.pod, ctx.connector
    await check_workers(pod, connector, workers, container)
    launch_id = new_launch_id()
    try:
        line = wrap(command, container, launch_id)
        return explain(await run_on(ctx, line, workers=workers, policy=policy, env=env, guard=True))
    finally:
        await remove_containers(pod, connector, workers, container.engine, launch_id)
