"""The arguments of ``tpupod exec``, and its fast path.

``tpupod exec`` on an SSH pod is the command people run most, and its cost is
mostly Python importing the CLI framework. When the arguments are plain (no
``--help``, nothing unusual) and the pod's connection holder can run it, the
console script parses them here with no framework at all and talks to the
holder directly. Anything else goes to the typer command, which stays the
reference for what the options mean (tests check that both agree).
"""

from __future__ import annotations

import shlex
import sys

from tpupod import settings
from tpupod.base.envargs import parse_env
from tpupod.base.plain import TYPE_CHECKING, Plain
from tpupod.cli.args import OptionTable, scan
from tpupod.errors import TpupodError, UsageError
from tpupod.fanout.results import DEFAULT_GRACE_S, OnFail
from tpupod.pod.selection import select_ids

if TYPE_CHECKING:
    from tpupod.fanout.results import FanoutResult
    from tpupod.pod.state import PodBrief, StateDir


class ExecArgs(Plain):
    """``tpupod exec``'s options, as either parser read them."""

    __slots__ = (
        "command",
        "env",
        "grace",
        "on_fail",
        "pod",
        "quiet",
        "timeout",
        "verbose",
        "worker",
    )

    def __init__(
        self,
        command: list[str],
        *,
        pod: str | None = None,
        worker: str | None = None,
        on_fail: OnFail = OnFail.WAIT,
        timeout: float | None = None,
        grace: float = DEFAULT_GRACE_S,
        quiet: bool = False,
        env: list[str] | None = None,
        verbose: bool = False,
    ) -> None:
        self.command = command
        self.pod = pod
        self.worker = worker
        self.on_fail = on_fail
        self.timeout = timeout
        self.grace = grace
        self.quiet = quiet
        self.env = env if env is not None else []
        self.verbose = verbose


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
    ids = select_ids(args.worker, len(brief.workers))
    return ExecPlan(name, brief, ids, join_command(args.command), parse_env(args.env))


def run_held(state: StateDir, plan: ExecPlan, args: ExecArgs) -> FanoutResult:
    """Run the plan through the pod's connection holder, output printed as it arrives."""
    from tpupod.holder.client import held_exec

    workers = [plan.brief.workers[i] for i in plan.ids]
    return held_exec(state, plan.name, workers, exec_request(args, plan), args.quiet)


def run_here(state: StateDir, plan: ExecPlan, args: ExecArgs) -> FanoutResult:
    """Run the plan on a local pod's workers with no event loop (``localexec``)."""
    from tpupod.fanout.local import run_local

    return run_local(state.read_record(plan.name), plan, args)


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


def join_command(argv: list[str]) -> str:
    """One argument is a command line as typed; several are an argv, quoted for the shell."""
    if not argv or not any(arg.strip() for arg in argv):
        raise UsageError(
            "no command given", hint="put the command after --, e.g. tpupod exec -- hostname"
        )
    return argv[0] if len(argv) == 1 else shlex.join(argv)


EXEC_OPTIONS = OptionTable(
    valued={
        "-p": "pod",
        "--pod": "pod",
        "-w": "worker",
        "--worker": "worker",
        "--on-fail": "on_fail",
        "-t": "timeout",
        "--timeout": "timeout",
        "--grace": "grace",
    },
    repeated={"-e": "env", "--env": "env"},
    flags={"-q": "quiet", "--quiet": "quiet", "-v": "verbose", "--verbose": "verbose"},
)


def parse_plain(argv: list[str]) -> ExecArgs | None:
    """``exec``'s arguments when they are plain; None sends them to the full CLI parser."""
    scanned = scan(argv, EXEC_OPTIONS)
    if scanned is None:
        return None
    values = scanned.values
    env = scanned.lists.get("env", [])
    try:
        args = ExecArgs(
            command=scanned.rest,
            pod=values.get("pod"),
            worker=values.get("worker"),
            quiet="quiet" in scanned.flags,
            env=env,
            verbose="verbose" in scanned.flags,
        )
        args.on_fail = OnFail(values.get("on_fail", OnFail.WAIT))
        args.timeout = float(values["timeout"]) if "timeout" in values else None
        args.grace = float(values.get("grace", DEFAULT_GRACE_S))
    except ValueError:
        return None
    plain = args.command and args.grace >= 0 and (args.timeout is None or args.timeout >= 0.001)
    return args if plain and env_ok(env) else None


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
