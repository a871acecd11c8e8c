"""What ``tpupod run`` does with its arguments, and its fast path.

Both readers of the command line, the typer command (the reference, with ``--help``) and
the console script's framework-free fast path, build a :class:`RunArgs` (declared once, in
``attempt.py``) and call :func:`run_command`, so they cannot drift apart in what a run
does. The fast path saves the CLI framework's start (typer imports pydantic and builds a
validator per option: 0.1 to 0.2 s) on every plain ``tpupod run``.
"""

from __future__ import annotations

from tpupod.cli.flow.attempt import RunArgs, check_args, launch_attempt, report_attempt
from tpupod.cli.flow.exec import env_ok
from tpupod.errors import UsageError
from tpupod.pod.state import StateDir


def run_command(args: RunArgs) -> int:
    """What ``tpupod run`` does, whichever reader read its arguments; the exit code."""
    from tpupod.cli.flow.live import run_live

    if bool(args.command) == bool(args.resume):
        raise UsageError(
            "run takes a command, or --resume RUN without one",
            hint="tpupod run -- python train.py",
        )
    if (
        args.retries
        or args.retry_errors
        or args.retry_hangs
        or args.retry_exit_codes
        or args.resume
        or args.elastic
        or args.min_slices != 1
    ):
        from tpupod.cli.flow.recover import run_recovering

        return run_recovering(args)
    target = StateDir().resolve(args.pod)
    workers = target.subset(target.select(args.worker)).workers  # as the run numbers them
    check_args(args, target)  # every option is checked before any work
    result = run_live(workers, False, lambda live: launch_attempt(args, target, live, {}, None))
    return report_attempt(args, result)


def parse_plain(argv: list[str]) -> RunArgs | None:
    """``run``'s arguments when they are plain; None sends them to the full CLI parser."""
    args = RunArgs.read(argv)
    return args if args is not None and env_ok(args.env) else None


def fast_run(argv: list[str]) -> int | None:
    """Run ``tpupod run`` without the CLI framework if its arguments are plain; None
    means: use the full CLI. Errors are reported as the CLI reports them."""
    if not argv or argv[0] != "run":
        return None
    args = parse_plain(argv[1:])
    if args is None:
        return None
    try:
        return run_command(args)
    except Exception as exc:
        from tpupod.fanout.report import report_failure

        return report_failure(exc, "'tpupod run'")
