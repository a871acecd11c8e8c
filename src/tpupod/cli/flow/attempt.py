"""``tpupod run``'s arguments, declared once (the typer command and the fast path read them
from here), and one launch of the program: an attempt, as a plain run or each of a
``--retries`` run's (``recover.py``) makes it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpupod.base.envargs import parse_env
from tpupod.cli.args import (
    ENGINE,
    ENV,
    GRACE,
    IMAGE,
    MOUNT,
    POD,
    PRIVILEGED,
    TIMEOUT,
    WORKER,
    opt,
    rest,
)
from tpupod.cli.flow.exec import ExecArgs
from tpupod.errors import UsageError
from tpupod.fanout.context import Context, Sinks
from tpupod.fanout.results import OnFail
from tpupod.pod.choices import RendezvousOn
from tpupod.transport.base import join_command, program_python

if TYPE_CHECKING:
    from tpupod.fanout.context import Interrupt
    from tpupod.image.containerize import Container
    from tpupod.launch.run import Launch, RunResult
    from tpupod.pod.record import Pod


class RunArgs(ExecArgs):
    """``tpupod run``'s arguments: exec's, some said otherwise, and its own."""

    command: list[str] = rest(metavar="-- CMD...", help="The program.", required=False)
    pod: str | None = POD
    worker: str | None = WORKER
    on_fail: OnFail = opt(
        "--on-fail", default=OnFail.KILL, help="On the first failure: kill the others, or wait."
    )
    timeout: float | None = TIMEOUT
    grace: float = GRACE
    quiet: bool = opt(
        "--quiet",
        "-q",
        default=False,
        help="Print only the program's output and errors: no notices, no summary "
        "(a failure still gets its one line).",
    )
    verbose: bool = opt(
        "--verbose",
        "-v",
        default=False,
        help="Also print the runtime's own chatter (gloo's connection lines) and what "
        "the others print after the first failure; both are always kept in 'tpupod logs'.",
    )
    env: list[str] = ENV
    sync: str | None = opt(
        "--sync",
        metavar="DIR",
        help="First ship this repository's HEAD to DIR on "
        "every worker (all must end at the same commit), and run the program there.",
        show_default=False,
    )
    rendezvous_on: RendezvousOn = opt(
        "--rendezvous-on",
        default=RendezvousOn.AUTO,
        help="Where the rendezvous runs: launcher, worker0, or auto "
        "(worker0 for a Cloud TPU reached at external addresses).",
    )
    worker_python: str | None = opt(
        "--worker-python",
        help="The python on worker 0 that has tpupod, for a rendezvous there (default: "
        "the command's python when it starts with one, else python3).",
        show_default=False,
    )
    coordinator_port: int | None = opt(
        "--coordinator-port",
        help="JAX coordinator port on worker 0 "
        "(default: 8476 on hosts, a free port on a local pod).",
        show_default=False,
    )
    image: str | None = IMAGE
    mounts: list[str] = MOUNT
    engine: str | None = ENGINE
    privileged: bool = PRIVILEGED
    retries: int = opt(
        "--retries",
        default=0,
        help="Recover up to N times from a preemption (the TPU deleted, created again, "
        "set up, synced, relaunched) or a lost worker, rerun: one whose host stops "
        "answering, or killed by KILL, TERM or HUP without a word of its own (the OOM "
        "killer, an operator, a host going down). A host still silent after the probe "
        "budget ends the run (exit 255).",
    )
    retry_errors: int = opt(
        "--retry-errors",
        default=0,
        help="Rerun up to M times after the program's own failures: an exception, "
        "sys.exit(N), an exit code, a crash.",
    )
    retry_exit_codes: str | None = opt(
        "--retry-exit-codes",
        metavar="CODES",
        help="Always rerun after these exit codes (e.g. 42,75; 143 for a program "
        "that saves on SIGTERM and exits 143 itself).",
        show_default=False,
    )
    zones: str | None = opt(
        "--zones",
        metavar="Z1,Z2",
        help="Recreate a preempted TPU in these zones when its own has no capacity.",
        show_default=False,
    )
    notice_grace: float | None = opt(
        "--notice-grace",
        metavar="SECONDS",
        minimum=0,
        help="On a preemption notice: SIGTERM, then KILL after this long (default 25).",
        show_default=False,
    )
    elastic: bool = opt(
        "--elastic",
        default=False,
        help="On a pod of separate TPU slices (up --gcp --slices N): when a slice is "
        "preempted, go on at once on the slices left (from the newest checkpoint) while it "
        "is made again, and grow back to every slice at the next checkpoint.",
    )
    min_slices: int = opt(
        "--min-slices",
        default=1,
        minimum=1,
        help="--elastic: with fewer slices left than this, wait until enough are back.",
    )
    setup: str | None = opt(
        "--setup",
        metavar="SCRIPT",
        help="The pod's setup script: run first, and again on a recreated TPU.",
        show_default=False,
    )
    hang_timeout: str | None = opt(
        "--hang-timeout",
        metavar="S",
        help="A run where no worker progresses this long (20s, 10m; a heartbeat's step, or "
        "a line) is hung: its stacks are taken and printed, then it is stopped (exit 124). "
        "Default: the pod spec's hang_timeout ('off' turns it off), else none.",
        show_default=False,
    )
    retry_hangs: int = opt(
        "--retry-hangs",
        default=0,
        help="Rerun up to N times after a hang (--hang-timeout), with the same run id.",
    )
    resume: str | None = opt(
        "--resume",
        metavar="RUN",
        help="Continue run RUN after its launcher died (no CMD); or a run that failed, "
        "with the flag that reruns its end (e.g. --retry-errors 1), from its checkpoint.",
        show_default=False,
    )


def check_args(args: RunArgs, target: Pod) -> None:
    """Refuse bad options before any work (each attempt reads them again)."""
    _program(args, target, {})
    if hang_timeout(args, target) is None and args.retry_hangs:
        raise UsageError(
            "--retry-hangs reruns a hung run, and nothing finds one hung here",
            hint="add --hang-timeout S (or hang_timeout: in the pod spec), e.g. --hang-timeout 10m",
        )


def hang_timeout(args: RunArgs, target: Pod) -> float | None:
    """--hang-timeout in seconds ("off": none), else the pod spec's, else None."""
    from tpupod.base.durations import parse_duration
    from tpupod.hang.watchdog import check_timeout

    if args.hang_timeout is not None and args.hang_timeout.strip().lower() in ("off", "none"):
        return None
    if args.hang_timeout is not None:
        return check_timeout(parse_duration(args.hang_timeout, "--hang-timeout"), "--hang-timeout")
    return target.spec.hang_timeout


def _program(
    args: RunArgs, target: Pod, extra_env: dict[str, str]
) -> tuple[str, dict[str, str], Container | None, str | None]:
    """What the options make of one launch: the command line, its environment, the
    container it runs in, the python that has tpupod on worker 0."""
    from tpupod.image.options import container_from_options

    # the names of -e NAME=VALUE (parse_env below reads the values, and refuses bad ones)
    names = [*(item.partition("=")[0] for item in args.env), *extra_env, *target.spec.env]
    container = container_from_options(args.image, args.mounts, args.engine, args.privileged, names)
    line = join_command(args.command)
    # In a container the program's python is the image's, not the host's.
    python = args.worker_python or (None if container else program_python(args.command))
    return line, {**parse_env(args.env), **extra_env}, container, python


def report_attempt(args: RunArgs, result: RunResult) -> int:
    """The summary of one attempt (-q: of tpupod's only why the run failed)."""
    from tpupod.fanout.report import print_summary, print_verdict
    from tpupod.hang.progress import summary_line

    if args.quiet:
        print_verdict(result.fanout, sys.stderr)
    else:
        print_summary(result.fanout, sys.stderr, title=f"run {result.launch.launch_id}")
        steps = summary_line(result.launch.run_dir)  # with tpupod.heartbeat: each one's step
        if steps is not None:
            print(steps, file=sys.stderr)
    return result.fanout.exit_code()


async def launch_attempt(
    args: RunArgs,
    target: Pod,
    sinks: Sinks,
    extra_env: dict[str, str],
    interrupt: Interrupt | None,
    *,
    on_launch: Callable[[Launch], None] | None = None,
) -> RunResult:
    """One launch of the program on ``target``'s selected workers, its output to ``sinks``
    (``interrupt``: an attempt's own, in place of the command's)."""
    from tpupod.fanout.execute import Policy
    from tpupod.launch.run import run

    line, env, container, python = _program(args, target, extra_env)
    notice = _silent if args.quiet else sinks.on_notice
    attempt = Sinks(sinks.on_line, notice, interrupt or sinks.interrupt)
    async with Context(target, attempt) as ctx:
        return await run(
            ctx,
            line,
            workers=target.select(args.worker),
            env=env,
            policy=Policy(args.on_fail, args.timeout, args.grace),
            coordinator_port=args.coordinator_port,
            sync_dir=args.sync,
            rendezvous_on=args.rendezvous_on.value,
            worker_python=python,
            show_chatter=args.verbose,
            collateral_in_logs_only=not args.verbose,
            container=container,
            on_launch=on_launch,
            hang_timeout=hang_timeout(args, target),
        )


def _silent(text: str) -> None:
    """No notices (``run -q``)."""
