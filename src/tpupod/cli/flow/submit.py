"""``tpupod jobs submit``'s arguments, declared once, and its fast path.

Submitting is the job command people run most, and importing typer, pydantic and
SQLAlchemy cost it about a second before any work. When the arguments are plain and the
store exists at this tpupod's schema version, the console script checks the request here
and adds the row with the database's own driver (``jobs/rows.py``). Anything else
(``--help``, ``--wait``, a JSON document, anything to explain, a store to create or
migrate) gives None, and the typer command, the reference for what the options mean,
does it. A PostgreSQL server that is away is waited for here, as by the typer command.
Both write ``rows.job_row`` with the one INSERT; tests check that both paths store the
same row and refuse the same input.
"""

from __future__ import annotations

import math
import shlex
import time
from pathlib import Path
from typing import Any

from tpupod.base.envargs import parse_pairs
from tpupod.base.jsontext import lone_surrogate
from tpupod.cli.args import Args, opt, rest
from tpupod.errors import JobStoreError, PodNotFound, UsageError
from tpupod.extras import missing
from tpupod.jobs.code import syntax_problem
from tpupod.jobs.rows import (
    MAX_ATTEMPTS,
    attempts_for,
    check_key,
    check_pod,
    default_url,
    insert,
    job_row,
    new_submit_key,
)

DB = opt(  # every jobs command's
    "--db",
    metavar="URL",
    help="The job store: sqlite:///PATH or postgresql://... "
    "(default: $TPUPOD_JOBS_DB, else jobs.db in the state directory).",
    show_default=False,
)


class SubmitArgs(Args):
    """``tpupod jobs submit``'s arguments."""

    what: list[str] = rest(metavar="FILE.py | FILE.json | -- CMD...")
    db: str | None = DB
    # A job names no pod unless asked: any runner takes it. Not "the only pod", as other
    # commands default: a store may be shared, and what runs a job must not hang on the
    # submitter's pods.
    pod: str | None = opt(
        "--pod",
        "-p",
        help="The pod whose runner ('jobs worker --pod P') takes the job (default: none, any "
        "runner takes it: a local one or any pod's).",
        show_default=False,
    )
    name: str = opt("--name", default="", help="A name to know it by.")
    label: list[str] = opt("--label", "-l", metavar="NAME=VALUE", help="Repeatable.")
    priority: int = opt("--priority", default=0, help="Higher runs first.")
    # spelled as cli.args.TIMEOUT, checked by jobs.request as 'jobs wait --timeout' is
    timeout: float | None = opt(
        "--timeout",
        "-t",
        metavar="S",
        help="Stop the job's run after S seconds.",
        show_default=False,
    )
    max_attempts: int | None = opt(
        "--max-attempts",
        help="Attempts in all, lost runners' too, not those a stopped runner gave back "
        "(default: 3, or --retries + 1).",
        show_default=False,
    )
    retries: int = opt(
        "--retries", default=0, help="Run it again when the program fails, this many times."
    )
    wait: bool = opt("--wait", default=False, help="Wait, then print the result.")
    key: str | None = opt(
        "--key",
        metavar="KEY",
        help="An idempotency key: a submit whose key the store has already adds no job and "
        "prints that job's id (default: a new key, so a try sent again after a dropped "
        "connection never adds the job twice).",
        show_default=False,
    )
    remote_pod: bool = opt(
        "--remote-pod", default=False, help="--pod names a pod whose runner is on another machine."
    )


def fast_submit(argv: list[str]) -> int | None:
    """Submit and print the id (exit 0); None when the typer command should do it."""
    if missing("jobs"):
        return None  # the typer command checks the extra and says what is missing
    args = SubmitArgs.read(argv)
    if args is None or args.wait:
        return None
    fields = _fields(args, dashed="--" in argv)
    if fields is None:
        return None
    try:
        check_pod(args.pod, args.remote_pod)
        key = new_submit_key() if args.key is None else check_key(args.key)
    except (PodNotFound, UsageError):
        return None  # the typer command says why
    try:
        row = job_row(fields, time.time(), key)
        job_id = insert(args.db or default_url(), row, say=_notice)
    except JobStoreError as exc:
        from tpupod.fanout.report import report_failure

        return report_failure(exc, "'tpupod jobs submit'")
    if job_id is None:
        return None
    print(job_id, flush=True)
    return 0


def _notice(text: str) -> None:
    """What the submit says while it waits for the store (rarely: imported then)."""
    from tpupod.fanout.report import notice

    notice(text)


def _fields(args: SubmitArgs, *, dashed: bool) -> dict[str, Any] | None:
    """A plain request's fields, or None for anything the typer command must explain."""
    try:
        labels = parse_pairs(args.label, option="--label", example="team=ml")
    except UsageError:
        return None  # the typer command says what is wrong
    attempts = args.max_attempts or attempts_for(args.retries)
    if not 0 <= args.retries < attempts <= MAX_ATTEMPTS:
        return None
    if args.timeout is not None and not 0 < args.timeout < math.inf:
        return None
    rest = args.what
    code = command = None
    if dashed or len(rest) > 1 or not rest[0].endswith((".py", ".json")):
        if not dashed and any(arg.startswith("-") for arg in rest):
            return None  # an option after the arguments: typer reads those
        if not any(arg.strip() for arg in rest):
            return None
        command = rest[0] if len(rest) == 1 else shlex.join(rest)
    elif rest[0].endswith(".py") and Path(rest[0]).is_file():
        code = Path(rest[0]).read_text()
        if not code.strip() or syntax_problem(code) is not None:
            return None
    else:
        return None  # a JSON document (pydantic reads it), or no such file
    if lone_surrogate([command, args.name, labels]) is not None:
        return None  # a byte that is not UTF-8: the typer command says so
    return {
        "name": args.name,
        "code": code,
        "command": command,
        "labels": labels,
        "priority": args.priority,
        "timeout": args.timeout,
        "pod": args.pod,
        "max_attempts": attempts,
        "retries": args.retries,
        "metadata": {},
    }
