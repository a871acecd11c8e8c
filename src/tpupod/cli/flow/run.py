"""The arguments of ``tpupod run``, what it does with them, and its fast path.

Both readers of the command line, the typer command (the reference, with ``--help``)
and the console script's framework-free fast path (``plainargs``), build a
:class:`RunArgs` and call :func:`run_command`, so they cannot drift apart in what a
run does. The fast path saves the CLI framework's start (typer imports pydantic and
builds a validator per option: 0.1 to 0.2 s) on every plain ``tpupod run``.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpupod.cli.args import scan
from tpupod.cli.flow.exec import EXEC_OPTIONS, env_ok
from tpupod.fanout.results import DEFAULT_GRACE_S, OnFail
from tpupod.pod.choices import RendezvousOn

if TYPE_CHECKING:
    from tpupod.cli.flow.live import Live
    from tpupod.fanout.execute import Interrupt
    from tpupod.launch.run import Launch, RunResult
    from tpupod.pod.record import Pod


@dataclass
class RunArgs:
    command: list[str]
    pod: str | None = None
    worker: str | None = None
    on_fail: OnFail = OnFail.KILL
    timeout: float | None = None
    grace: float = DEFAULT_GRACE_S
    quiet: bool = False
    verbose: bool = False
    env: list[str] = field(default_factory=list)
    sync: str | None = None
    rendezvous_on: RendezvousOn = RendezvousOn.AUTO
    worker_python: str | None = None  # None: the command's python if it is one, else python3
    coordinator_port: int | None = None
    image: str | None = None
    mounts: list[str] = field(default_factory=list)
    engine: str | None = None
    privileged: bool = False
    # --retries and its company (``recovery``): 0 and empty run one plain attempt
    retries: int = 0
    retry_errors: int = 0
    retry_exit_codes: str | None = None
    zones: str | None = None
    notice_grace: float | None = None
    setup: str | None = None
    resume: str | None = None


def run_command(args: RunArgs) -> int:
    """What ``tpupod run`` does, whichever reader read its arguments; the exit code."""
    from tpupod.cli.flow.live import run_live
    from tpupod.pod.state import StateDir

    if bool(args.command) == bool(args.resume):
        from tpupod.errors import UsageError

        raise UsageError(
            "run takes a command, or --resume RUN without one",
            hint="tpupod run -- python train.py",
        )
    if args.retries or args.retry_errors or args.retry_exit_codes or args.resume:
        from tpupod.cli.flow.recover import run_recovering

        return run_recovering(args, launch_attempt)
    target = StateDir().resolve(args.pod)
    workers = target.select(args.worker)
    check_args(args, target)  # every option is checked before any work
    result = run_live(workers, False, lambda live: launch_attempt(args, target, live, {}, None))
    return report_attempt(args, result)


def check_args(args: RunArgs, target: Pod) -> None:
    """Refuse bad options before any work (launch_attempt reads them again)."""
    from tpupod.base.envargs import parse_env
    from tpupod.image.options import container_from_options

    names = [*parse_env(args.env), *target.spec.env]
    container_from_options(args.image, args.mounts, args.engine, args.privileged, names)


def report_attempt(args: RunArgs, result: RunResult) -> int:
    """The summary of one attempt (-q: of tpupod's only why the run failed)."""
    from tpupod.fanout.report import print_summary, print_verdict

    if args.quiet:
        print_verdict(result.fanout, sys.stderr)
    else:
        print_summary(result.fanout, sys.stderr, title=f"run {result.launch.launch_id}")
    return result.fanout.exit_code()


def launch_attempt(
    args: RunArgs,
    target: Pod,
    live: Live,
    extra_env: dict[str, str],
    interrupt: Interrupt | None,
    *,
    on_launch: Callable[[Launch], None] | None = None,
) -> Awaitable[RunResult]:
    """One launch of the program on ``target``'s selected workers."""
    from tpupod.base.envargs import parse_env
    from tpupod.cli.flow.exec import join_command
    from tpupod.image.options import container_from_options
    from tpupod.launch.run import program_python
    from tpupod.launch.run import run as launch_run

    workers = target.select(args.worker)
    run_env = {**parse_env(args.env), **extra_env}
    names = [*run_env, *target.spec.env]
    container = container_from_options(args.image, args.mounts, args.engine, args.privileged, names)
    return launch_run(
        target,
        join_command(args.command),
        workers=workers,
        env=run_env,
        timeout=args.timeout,
        on_fail=args.on_fail,
        grace=args.grace,
        coordinator_port=args.coordinator_port,
        sync_dir=args.sync,
        rendezvous_on=args.rendezvous_on.value,
        # In a container the program's python is the image's, not the host's.
        worker_python=args.worker_python or (None if container else program_python(args.command)),
        show_chatter=args.verbose,
        collateral_in_logs_only=not args.verbose,
        on_line=live.on_line,
        on_notice=_silent if args.quiet else live.on_notice,
        interrupt=interrupt or live.interrupt,
        container=container,
        on_launch=on_launch,
    )


def _silent(text: str) -> None:
    """No notices (``run -q``)."""


# exec's options (pod, workers, on-fail, timeout, grace, env, quiet) and run's own.
RUN_OPTIONS = EXEC_OPTIONS.extended(
    valued={
        "--sync": "sync",
        "--rendezvous-on": "rendezvous_on",
        "--worker-python": "worker_python",
        "--coordinator-port": "coordinator_port",
        "--image": "image",
        "--engine": "engine",
    },
    repeated={"--mount": "mounts"},
    flags={"-v": "verbose", "--verbose": "verbose", "--privileged": "privileged"},
)


def parse_plain(argv: list[str]) -> RunArgs | None:
    """``run``'s arguments when they are plain; None sends them to the full CLI parser."""
    scanned = scan(argv, RUN_OPTIONS)
    if scanned is None or not scanned.rest:
        return None
    values = scanned.values
    try:
        args = RunArgs(
            command=scanned.rest,
            pod=values.get("pod"),
            worker=values.get("worker"),
            on_fail=OnFail(values.get("on_fail", OnFail.KILL)),
            timeout=float(values["timeout"]) if "timeout" in values else None,
            grace=float(values.get("grace", DEFAULT_GRACE_S)),
            quiet="quiet" in scanned.flags,
            verbose="verbose" in scanned.flags,
            env=scanned.lists.get("env", []),
            sync=values.get("sync"),
            rendezvous_on=RendezvousOn(values.get("rendezvous_on", RendezvousOn.AUTO)),
            worker_python=values.get("worker_python"),
            coordinator_port=_integer(values.get("coordinator_port")),
            image=values.get("image"),
            mounts=scanned.lists.get("mounts", []),
            engine=values.get("engine"),
            privileged="privileged" in scanned.flags,
        )
    except ValueError:
        return None
    in_range = args.grace >= 0 and (args.timeout is None or args.timeout >= 0.001)
    return args if in_range and env_ok(args.env) else None


def _integer(text: str | None) -> int | None:
    """An integer as the CLI reads one (``int()`` alone would take '1_000' and ' 7')."""
    if text is None:
        return None
    if not text.lstrip("-").isdigit() or not text.isascii():
        raise ValueError(text)
    return int(text)


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

        return report_failure(exc)
