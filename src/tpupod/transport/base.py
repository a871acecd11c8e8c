"""The transport seam's values: output lines, exit statuses, the script a worker runs.

The protocols a transport implements are in ``protocol.py``: this module is on the local
fast path (``localexec``), so it imports neither ``typing`` nor ``dataclasses``.
"""

from __future__ import annotations

import enum
import math
import re
import shlex
import signal
from collections.abc import Sequence

from tpupod.base.plain import Plain
from tpupod.errors import UsageError


class Stream(enum.Enum):
    STDOUT = "stdout"
    STDERR = "stderr"


class OutputLine(Plain):
    """One line a command printed, and on which stream."""

    __slots__ = ("stream", "text")

    def __init__(self, stream: Stream, text: str) -> None:
        self.stream = stream
        self.text = text


class ExitStatus(Plain):
    """How a command ended: an exit code, or the signal that killed it."""

    __slots__ = ("code", "signal")

    def __init__(self, code: int | None, signal: int | None = None) -> None:
        self.code = code
        self.signal = signal

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def shell_code(self) -> int:
        """The code a shell would report: the exit code, or 128 + the signal number."""
        if self.code is not None:
            return self.code
        return 128 + (self.signal or 0)

    def describe(self) -> str:
        if self.code is not None:
            return f"exit {self.code}"
        try:
            name = signal.Signals(self.signal or 0).name
        except ValueError:
            name = f"signal {self.signal}"
        return f"killed by {name}"


# A missing program reads "python: command not found", not "bash: line 22: python: ...".
NOT_FOUND = (
    "command_not_found_handle() { printf '%s: command not found\\n' \"$1\" >&2; return 127; }"
)
# TERM while the command runs: wait for it to end, then end this shell with the command's
# own status. So the status is the command's real end (a JAX process ignores TERM and dies
# by the KILL that follows; a program that saved and finished ends 0, not "killed by
# SIGTERM"), and a line of several commands does not go on to the next one.
TERM_TRAP = "trap 'tpupod_end $?' TERM"
# A command killed by signal N ends with 128+N; re-raise N so it is reported as one.
RERAISE = [
    'if [ "$tpupod_rc" -gt 128 ] && [ "$tpupod_rc" -lt 160 ]; then',
    "  trap - $((tpupod_rc - 128)); kill -$((tpupod_rc - 128)) $$",
    "fi",
]
GUARD_GRACE_S = 3.0
# A guard that got TERM itself (a host shutting down: GCE's preemption notice TERMs every
# process ~30 s before the VM stops) lets the program finish its save for this long.
GUARD_SHUTDOWN_S = 30.0
# Does process group $1 have a live member? Zombies do not count: where PID 1 reaps no
# orphans (containers, the simulated hosts) a dead member can stay a zombie for good.
GROUP_ALIVE = (
    "alive() { if command -v ps >/dev/null && command -v awk >/dev/null; then "
    "ps -eo pgid=,stat= | awk -v g=\"$1\" '$1 == g && $2 !~ /^Z/ {f = 1} END {exit !f}'; "
    'else kill -0 -- -"$1" 2>/dev/null; fi; }'
)
GUARD_POLL_S = 0.05


# A remote script's first line (on stdout, and on stderr where nothing else marks it): what
# comes before is the login's own (a ~/.bashrc that prints a banner), not the script's.
BEGIN_MARK = "\x1etpupod-begin"

# Bytes a bash double-quoted string and a single-quoted word of every common login shell
# (sh, zsh, fish, csh) take as they are; any other is written \xHH for printf %b.
_AS_IS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 #%&()*+,-./:;<=>?@[]^_{|}~"
)


def for_login_shell(script: str, shell: str | None) -> str:
    """``script`` (bash) as the command line to give an SSH server whose user logs in to
    ``shell``.

    sshd runs a command with the user's login shell: a bash login takes the script as it
    is; any other shell parses it first (fish refused it whole, and 'tpupod exec' said
    the command succeeded; zsh ran the user's command as zsh, not bash). For those, the
    line execs bash with the script in a form none of them alters: one single-quoted word
    of characters they all take literally, which bash decodes with a builtin (no extra
    process). ``shell`` None (not known: a pod recorded before it was) is taken as bash.
    """
    if shell is None or shell.rsplit("/", 1)[-1] == "bash":
        return script
    encoded = "".join(
        c if c in _AS_IS else "".join(f"\\x{b:02x}" for b in c.encode()) for c in script
    )
    return f'exec /bin/bash -c \'printf -v tpupod_script %b "{encoded}"; eval "$tpupod_script"\''


def command_script(
    command: str,
    *,
    guard: bool = False,
    grace: float = GUARD_GRACE_S,
    shutdown_grace: float = GUARD_SHUTDOWN_S,
) -> str:
    """The bash script that runs ``command`` on a worker (local or SSH), in its own group.

    With ``guard``, an orphan guard kills the group when our end of its stdin
    closes: the command's standard input stays open to us (we never write to
    it) and is handed to a guard process, while the command reads /dev/null.
    If we vanish (killed, connection lost), the guard reads EOF and TERMs the
    whole process group, waits until it is empty or ``grace`` has passed, then
    KILLs what is left. The guard runs in a session of its own (``setsid``), so
    it is not in the group it kills and leaves as soon as the group is gone
    (without ``setsid`` it stays in the group, ignores TERM, and waits out the
    grace). When the command ends, the guard stands down first, so background
    processes it deliberately left (``nohup ... &``) live on.

    TERM does not end the guard (its ``cat`` ignores it): a host going down TERMs every
    process (GCE's preemption notice), and the SSH session may end with it. A guard that
    got TERM sends none on EOF (the program has had its TERM and is saving) and waits up
    to ``shutdown_grace`` for the group to end before it KILLs: a 3 s grace would cut the
    save short, and a guard dead of the TERM would leave a program that ignores TERM
    behind its launcher.
    """
    lines = [NOT_FOUND]
    if guard:
        # The grace is wall-clock time (bash's whole-second SECONDS: at least n s, under
        # n + 1), not a count of polls: on a loaded host each poll's ps takes far longer
        # than its sleep, and 600 polls of a 30 s grace stretched past a minute.
        watch = (
            f"{GROUP_ALIVE}; trap 'down=1' TERM; (trap '' TERM; exec cat) >/dev/null 2>&1; "
            f'if [ -n "$down" ]; then n={math.ceil(shutdown_grace)}; '
            f"else n={math.ceil(grace)}; kill -TERM -- -$1 2>/dev/null; fi; SECONDS=0; "
            f"while [ $SECONDS -le $n ] && alive $1; do sleep {GUARD_POLL_S:g}; done; "
            "kill -KILL -- -$1 2>/dev/null"
        )
        lines += [
            "exec 3<&0 </dev/null",
            "if command -v setsid >/dev/null; then",
            f"  setsid /bin/bash -c {shlex.quote(watch)} tpupod-guard $$ <&3 >/dev/null 2>&1 &",
            "else",
            f"  ( trap '' TERM; set -- $$; {watch} ) <&3 >/dev/null 2>&1 &",
            "fi",
            "tpupod_guard=$!; disown $tpupod_guard",  # no job note when it stands down
            "exec 3<&-",
        ]
    # The script is the whole shell (local) or its end (SSH): `exit`, not a `(exit N)` subshell,
    # whose fork cost 0.25 ms per host per command (measured: 16 hosts, 34.0 -> 30.0 ms).
    # TERM is ignored first: one that came while the end ran (a stop's TERM as the program
    # left by itself) ran the trap again with the status of `tpupod_rc=$1` (0) and ended a
    # worker that exited 143 with "exit 0". Before this line $? is still the command's.
    end = ["trap '' TERM", "tpupod_rc=$1"]
    if guard:
        end.append("kill -KILL $tpupod_guard 2>/dev/null")
    end += [*RERAISE, 'exit "$tpupod_rc"']
    lines += ["tpupod_end() {", *(f"  {line}" for line in end), "}"]
    return "\n".join([*lines, TERM_TRAP, command, "tpupod_end $?"])


def join_command(argv: list[str]) -> str:
    """One argument is a command line as typed; several are an argv, quoted for the shell."""
    if not argv or not any(arg.strip() for arg in argv):
        raise UsageError(
            "no command given", hint="put the command after --, e.g. tpupod exec -- hostname"
        )
    return argv[0] if len(argv) == 1 else shlex.join(argv)


PYTHON_NAME = re.compile(r"python[0-9.]*")


def program_python(argv: Sequence[str]) -> str | None:
    """The Python a program runs with, when its command starts with one (``python3
    train.py``, ``/opt/venv/bin/python -m app``; ``env`` and NAME=VALUE words first are
    skipped): it imports tpupod (it calls ``init_jax``), so it can run the rendezvous."""
    words = list(argv)
    if words and words[0].rsplit("/", 1)[-1] == "env":
        words = words[1:]
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]
    if words and PYTHON_NAME.fullmatch(words[0].rsplit("/", 1)[-1]):
        return words[0]
    return None
