"""Which container engine a worker uses, as a piece of bash that picks it there.

The choice is made on each worker, not here: a pod may mix hosts, and the
launcher may have no engine at all. Docker where present, Podman otherwise
(``--engine`` names one). A user who is not root and cannot use Docker's
socket yet (``tpupod setup --docker`` just added them to the group, and their
session predates it) runs Docker through ``sudo -n -E``, so no re-login is needed.

A Docker client whose daemon does not answer fails every call with the same line
("Cannot connect to the Docker daemon at ... Is the docker daemon running?"); a script
whose engine call failed calls ``tpupod_daemon``, which turns that into a line of its
own, so the launcher says the daemon is down instead of "no images" or "image missing".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tpupod.errors import PreflightError, UsageError

if TYPE_CHECKING:
    from tpupod.fanout.results import WorkerResult

ENGINES = ("docker", "podman")
# The line a worker prints when it has no engine (the launcher turns it into an error).
NO_ENGINE = "tpupod-image: no container engine"
SETUP_HINT = "'tpupod setup --docker' installs one on every worker"
# Exit code of a script that found no engine (as a shell's "command not found").
NO_ENGINE_RC = 127
# The line a worker prints when Docker cannot reach its daemon (then the daemon's words).
NO_DAEMON = "tpupod-image: no daemon:"
DAEMON_HINT = (
    "'tpupod setup --docker --force' starts Docker on every worker (installs it where "
    "missing), or use --engine podman"
)


def check_engine(engine: str | None) -> str | None:
    """``--engine``: docker, podman, or None (pick on each worker)."""
    if engine is None or engine in ENGINES:
        return engine
    raise UsageError(f"--engine {engine!r}", hint="one of: docker, podman")


def pick_engine(engine: str | None) -> str:
    """Bash that sets ``$tpupod_engine`` (a command prefix) or exits with NO_ENGINE_RC."""
    wanted = [engine] if engine else list(ENGINES)
    missing = f"{NO_ENGINE} ({' or '.join(wanted)}) on $(hostname)"
    # Unnamed, Docker counts only with a daemon to talk to (a client alone is common).
    daemon = "" if engine else ' && { [ -S /var/run/docker.sock ] || [ -n "$DOCKER_HOST" ]; }'
    found = [
        f"elif command -v {name} >/dev/null 2>&1{daemon if name == 'docker' else ''}; then "
        f"tpupod_engine={name}"
        for name in wanted
    ]
    return "\n".join(
        [
            "tpupod_engine=",
            "if false; then :",
            *found,
            "fi",
            'if [ -z "$tpupod_engine" ]; then',
            f'  echo "{missing}" >&2; exit {NO_ENGINE_RC}',
            "fi",
            # Docker's socket is root's and the docker group's; a group joined in this
            # session's lifetime is not ours yet: sudo, if it needs no password.
            'if [ "$tpupod_engine" = docker ] && [ "$(id -u)" != 0 ] '
            "&& ! [ -w /var/run/docker.sock ] && sudo -n true 2>/dev/null; then",
            '  tpupod_engine="sudo -n -E docker"',
            "fi",
            # Called after an engine call failed: exit with NO_DAEMON if that is why.
            "tpupod_daemon() {",
            '  [ "${tpupod_engine##* }" = docker ] || return 0',
            "  tpupod_why=$($tpupod_engine version --format '{{.Server.Version}}' 2>&1 "
            ">/dev/null) && return 0",
            f'  echo "{NO_DAEMON} $(echo "$tpupod_why" | tail -n 1)"; exit {NO_ENGINE_RC}',
            "}",
        ]
    )


def raise_unusable(results: Sequence[WorkerResult]) -> None:
    """A PreflightError for the first worker whose engine is missing or has no daemon."""
    for r in results:
        if r.ok:
            continue
        if any(NO_ENGINE in line for line in r.tail):
            raise PreflightError(
                f"no container engine on {r.worker.label} ({r.worker.hostname})", hint=SETUP_HINT
            )
        why = next((line for line in r.tail if line.startswith(NO_DAEMON)), None)
        if why is not None:
            raise PreflightError(
                f"cannot reach the docker daemon on {r.worker.label} ({r.worker.hostname}): "
                + why.removeprefix(NO_DAEMON).strip(),
                hint=DAEMON_HINT,
            )


def force_remove(name_expr: str) -> str:
    """Bash that removes a container at once, whichever engine, quietly if it is gone.

    ``name_expr`` is a bash word (quoted or a variable). Podman's ``rm -f`` would first
    wait the container's stop timeout (10 s); ``-t 0`` kills at once. Docker's kills at once.
    """
    return (
        'if [ "${tpupod_engine##* }" = podman ]; then '
        f"$tpupod_engine rm -f -t 0 --ignore {name_expr} >/dev/null 2>&1; "
        f"else $tpupod_engine rm -f {name_expr} >/dev/null 2>&1; fi; true"
    )
