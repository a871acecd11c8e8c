"""The arguments of ``tpupod exec``, and its fast path.

``tpupod exec`` on an SSH pod is the command people run most, and its cost is
mostly Python importing the CLI framework. When the arguments are plain (no
``--help``, nothing unusual) and the pod's connection holder can run it, the
console script parses them here with no framework at all and talks to the
holder directly. Anything else goes to the typer command, which stays the
reference for what the options mean (tests check that both agree).
"""

from __future__ import annotations

import sys

from tpupod import settings
from tpupod.base.envargs import parse_env
from tpupod.base.plain import TYPE_CHECKING, Plain
from tpupod.cli.args import (
    ENGINE,
    ENV,
    GRACE,
    IMAGE,
    MOUNT,
    POD,
    PRIVILEGED,
    QUIET,
    TIMEOUT,
    WORKER,
    Args,
    opt,
    rest,
)
from tpupod.errors import TpupodError, UsageError
from tpupod.fanout.results import OnFail
from tpupod.pod.selection import select_ids
from tpupod.transport.base import join_command

if TYPE_CHECKING:
    from tpupod.fanout.results import FanoutResult
    from tpupod.pod.state import PodBrief, StateDir


class ExecArgs(Args):
    """``tpupod exec``'s arguments, declared once: the typer command and the fast path
    both read them from here (``cli/args.py``)."""

    command: list[str] = rest(
        metavar="-- CMD...",
        help="A shell command line (one argument), or a command and its arguments.",
    )
    pod: str | None = POD
    worker: str | None = WORKER
    on_fail: OnFail = opt(
        "--on-fail",
        default=OnFail.WAIT,
        help="On the first failure: kill the others, or wait for them.",
    )
    timeout: float | None = TIMEOUT
    grace: float = GRACE
    quiet: bool = QUIET
    verbose: bool = opt(
        "--verbose",
        "-v",
        default=False,
        help="A summary row for every worker (by default a success with no output is one "
        "line, and beyond 16 workers identical results are grouped).",
    )
    env: list[str] = ENV
    image: str | None = IMAGE
    mounts: list[str] = MOUNT
    engine: str | None = ENGINE
    privileged: bool = PRIVILEGED


class ExecPlan(Plain):
    """What one ``tpupod exec`` does: on which pod and workers, which command line."""

    __slots__ = ("brief", "env", "ids", "line", "name")

    def __init__(
        self, name: str, brief: PodBrief, ids: list[int], line: str, env: dict[str, str]
    ) -> None:
        self.name = name
        self.brief = brief
        self.ids = ids
        self.line = line
        self.env = env

    @property
    def held(self) -> bool:
        """Through the pod's connection holder (SSH pods, unless turned off)."""
        return self.brief.provider == "ssh" and settings.holder_enabled()


def plan_exec(args: ExecArgs, state: StateDir) -> ExecPlan:
    """Check exec's arguments against the pod's record (a light read, no pydantic)."""
    name = state.resolve_name(args.pod)
    brief = state.load_brief(name)
    ids = select_ids(args.worker, len(brief.workers), [w.slice for w in brief.workers])
    return ExecPlan(name, brief, ids, join_command(args.command), parse_env(args.env))


def run_held(state: StateDir, plan: ExecPlan, args: ExecArgs) -> FanoutResult:
    """Run the plan through the pod's connection holder, output printed as it arrives."""
    from tpupod.holder.client import held_exec

    workers = [plan.brief.workers[i] for i in plan.ids]
    return held_exec(state, plan.name, workers, exec_request(args, plan), args.quiet)


def run_here(state: StateDir, plan: ExecPlan, args: ExecArgs) -> FanoutResult:
    """Run the plan on a local pod's workers with no event loop (``localexec``)."""
    from tpupod.fanout.local import run_local

    workers = [plan.brief.workers[i] for i in plan.ids]
    record = state.read_record(plan.name)
    return run_local(record, workers, plan.line, plan.env, grace=args.grace, quiet=args.quiet)


def finish(result: FanoutResult, plan: ExecPlan, verbose: bool = False) -> int:
    """Print the summary; the exit code."""
    from tpupod.fanout.report import print_summary

    print_summary(result, sys.stderr, title=f"exec on {plan.name}", verbose=verbose)
    return result.exit_code()


def exec_request(args: ExecArgs, plan: ExecPlan) -> dict[str, object]:
    """What the connection holder is asked to run."""
    return {
        "command": plan.line,
        "workers": plan.ids,
        "on_fail": args.on_fail.value,
        "timeout": args.timeout,
        "grace": args.grace,
        "env": plan.env,
        "quiet": args.quiet,
    }


def parse_plain(argv: list[str]) -> ExecArgs | None:
    """``exec``'s arguments when they are plain (no container: the typer command runs
    those); None sends them to the full CLI parser."""
    args = ExecArgs.read(argv)
    if args is None or args.image or args.mounts or args.engine or args.privileged:
        return None
    return args if env_ok(args.env) else None


def env_ok(items: list[str]) -> bool:
    """Whether ``-e`` values parse (else the full CLI reports them)."""
    try:
        parse_env(items)
    except UsageError:
        return False
    return True


def fast_exec(argv: list[str]) -> int | None:
    """Run ``tpupod exec`` through the pod's holder, or on a local pod's processes without an
    event loop, if that applies; None means: use the full CLI."""
    if not argv or argv[0] != "exec":
        return None
    args = parse_plain(argv[1:])
    if args is None:
        return None
    from tpupod.pod.state import StateDir

    state = StateDir()
    try:
        plan = plan_exec(args, state)
    except TpupodError:
        return None  # the full CLI reports it, the one way
    local = plan.brief.provider == "local" and args.on_fail is OnFail.WAIT and not args.timeout
    if not (plan.held or local):
        return None
    try:
        result = run_held(state, plan, args) if plan.held else run_here(state, plan, args)
    except TpupodError as exc:
        from tpupod.fanout.report import print_error

        print_error(f"error: {exc.message}", exc.hint, sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return 141
    return finish(result, plan, args.verbose)
