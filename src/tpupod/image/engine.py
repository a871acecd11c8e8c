"""Which container engine a worker uses, as a piece of bash that picks it there.

The choice is made on each worker, not here: a pod may mix hosts, and the
launcher may have no engine at all. Docker where present, Podman otherwise
(``--engine`` names one). A user who is not root and cannot use Docker's
socket yet (``tpupod setup --docker`` just added them to the group, and their
session predates it) runs Docker through ``sudo -n -E``, so no re-login is needed.
"""

from __future__ import annotations

from tpupod.errors import UsageError

ENGINES = ("docker", "podman")
# The line a worker prints when it has no engine (the launcher turns it into an error).
NO_ENGINE = "tpupod-image: no container engine"
SETUP_HINT = "'tpupod setup --docker' installs one on every worker"
# Exit code of a script that found no engine (as a shell's "command not found").
NO_ENGINE_RC = 127


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
        ]
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
