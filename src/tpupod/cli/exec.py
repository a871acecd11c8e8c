"""``tpupod exec``: one shell command on every worker (or a selection), at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from tpupod.cli.app import command
from tpupod.cli.flow.exec import ExecArgs, finish, plan_exec, run_held
from tpupod.cli.flow.live import run_live
from tpupod.cli.typed import takes
from tpupod.fanout.context import Context, Sinks
from tpupod.fanout.execute import Policy, run_on
from tpupod.fanout.results import FanoutResult
from tpupod.image.options import container_from_options
from tpupod.pod.state import StateDir

if TYPE_CHECKING:
    from tpupod.image.containerize import Container
    from tpupod.pod.record import Pod, Worker


@command("exec", context_settings={"allow_interspersed_args": False})
@takes(ExecArgs)
def exec_command(args: ExecArgs) -> None:
    """Run a command on every worker at once and summarize how each one ended.

    One argument is a shell command line; several are a command and its
    arguments, quoted for you. Output lines are prefixed with their worker
    ([w3]); the summary goes to stderr. The exit code is 0 when every worker
    succeeded, else the first failure's code (124: timed out, 130: Ctrl-C).

    Examples:

      tpupod exec -- hostname

      tpupod exec -w 0,2-3 -- 'echo $TPUPOD_WORKER_ID of $TPUPOD_NUM_WORKERS'

      tpupod exec --on-fail kill --timeout 600 -- python train.py --steps 100

      tpupod exec --image app:1 -- python -c 'import jax; print(jax.devices())'
    """
    if args.image is None:  # refuses container options without --image
        container_from_options(None, args.mounts, args.engine, args.privileged, [])
    run_exec(args)


def run_exec(args: ExecArgs) -> None:
    """The exec command proper: through the pod's connection holder for SSH pods, else here;
    in a container on every worker with ``--image`` (never through the holder)."""
    state = StateDir()
    plan = plan_exec(args, state)
    if plan.held and args.image is None:
        result = run_held(state, plan, args)
    else:
        target = state.load(plan.name)
        container = None
        if args.image is not None:
            names = [*plan.env, *target.spec.env]
            container = container_from_options(
                args.image, args.mounts, args.engine, args.privileged, names
            )
        result = run_with_signals(
            target,
            plan.line,
            [target.workers[i] for i in plan.ids],
            policy=Policy(args.on_fail, args.timeout, args.grace),
            quiet=args.quiet,
            env=plan.env,
            container=container,
        )
    raise typer.Exit(finish(result, plan, args.verbose))


def run_with_signals(
    pod: Pod,
    command: str,
    workers: list[Worker],
    *,
    policy: Policy,
    quiet: bool,
    env: dict[str, str],
    container: Container | None = None,
) -> FanoutResult:
    """Run a fan-out with its output printed; SIGINT/SIGTERM stop every worker cleanly."""
    from tpupod.image.containerize import execute_in_containers

    async def body(sinks: Sinks) -> FanoutResult:
        async with Context(pod, sinks) as ctx:
            if container is not None:
                return await execute_in_containers(
                    ctx, command, container, workers=workers, policy=policy, env=env
                )
            # guard: killed outright, this process takes its commands with it
            return await run_on(ctx, command, workers=workers, policy=policy, env=env, guard=True)

    return run_live(workers, quiet, body)
