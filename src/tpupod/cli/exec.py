"""``tpupod exec``: one shell command on every worker (or a selection), at once."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Awaitable
from typing import Annotated

import typer

from tpupod.cli import command
from tpupod.cli.options import EnvOption, PodOption, parse_env
from tpupod.cli.running import Live, run_live
from tpupod.errors import UsageError
from tpupod.fanout import DEFAULT_GRACE_S, FanoutResult, OnFail, execute_async
from tpupod.pod import Pod, Worker
from tpupod.report import print_summary

WorkerOption = Annotated[
    str | None,
    typer.Option(
        "--worker",
        "-w",
        metavar="SEL",
        help="Workers to use, e.g. 0,2-3 (default: all).",
        show_default=False,
    ),
]
TimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        "-t",
        metavar="S",
        min=0.001,
        help="Stop every worker still running after S seconds.",
        show_default=False,
    ),
]
GraceOption = Annotated[
    float,
    typer.Option(
        "--grace", metavar="S", min=0.0, help="Seconds between TERM and KILL when stopping."
    ),
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the summary.")]


@command(
    "exec", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True}
)
def exec_command(
    command: Annotated[
        list[str],
        typer.Argument(metavar="-- CMD...", help="The command (see below).", show_default=False),
    ],
    pod: PodOption = None,
    worker: WorkerOption = None,
    on_fail: Annotated[
        OnFail,
        typer.Option("--on-fail", help="On the first failure: kill the others, or wait for them."),
    ] = OnFail.WAIT,
    timeout: TimeoutOption = None,
    grace: GraceOption = DEFAULT_GRACE_S,
    quiet: QuietOption = False,
    env: EnvOption = None,
) -> None:
    """Run a command on every worker at once and summarize how each one ended.

    One argument is a shell command line; several are a command and its
    arguments, quoted for you. Output lines are prefixed with their worker
    ([w3]); the summary goes to stderr. The exit code is 0 when every worker
    succeeded, else the first failure's code (124: timed out, 130: Ctrl-C).

    Examples:

      tpupod exec -- hostname

      tpupod exec -w 0,2-3 -- 'echo $TPUPOD_WORKER_ID of $TPUPOD_NUM_WORKERS'

      tpupod exec --on-fail kill --timeout 600 -- python train.py --steps 100
    """
    from tpupod.state import StateDir

    target = StateDir().resolve(pod)
    result = run_with_signals(
        target,
        join_command(command),
        target.select(worker),
        on_fail=on_fail,
        timeout=timeout,
        grace=grace,
        quiet=quiet,
        env=parse_env(env),
    )
    print_summary(result, sys.stderr, title=f"exec on {target.name}")
    raise typer.Exit(result.exit_code())


def join_command(argv: list[str]) -> str:
    """One argument is a command line as typed; several are an argv, quoted for the shell."""
    if not argv or not any(arg.strip() for arg in argv):
        raise UsageError(
            "no command given", hint="put the command after --, e.g. tpupod exec -- hostname"
        )
    return argv[0] if len(argv) == 1 else shlex.join(argv)


def run_with_signals(
    pod: Pod,
    command: str,
    workers: list[Worker],
    *,
    on_fail: OnFail,
    timeout: float | None,
    grace: float,
    quiet: bool,
    env: dict[str, str],
) -> FanoutResult:
    """Run a fan-out with its output printed; SIGINT/SIGTERM stop every worker cleanly."""

    def body(live: Live) -> Awaitable[FanoutResult]:
        return execute_async(
            pod,
            command,
            workers=workers,
            on_fail=on_fail,
            timeout=timeout,
            grace=grace,
            env=env,
            on_line=live.on_line,
            on_notice=live.on_notice,
            interrupt=live.interrupt,
        )

    return run_live(workers, quiet, body)
