"""``tpupod run`` (a program on every worker in lockstep), ``tpupod logs``, ``tpupod stacks``
and ``tpupod cancel``."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from tpupod.cli.app import command
from tpupod.cli.flow.attempt import RunArgs
from tpupod.cli.flow.run import run_command
from tpupod.cli.options import PodOption, WorkerOption
from tpupod.cli.typed import takes
from tpupod.errors import UsageError
from tpupod.pod.state import StateDir


@command("run", context_settings={"allow_interspersed_args": False})
@takes(RunArgs)
def run(args: RunArgs) -> None:
    """Run a program on every worker in lockstep: preflight, rendezvous, supervision, logs.

    The program calls tpupod.init_jax() (or tpupod.rendezvous()) to meet the
    other workers. The first worker that fails stops all others (TERM, then
    KILL: JAX ignores TERM), and the summary names it. Output is also kept
    per worker: 'tpupod logs'.

    Examples:

      tpupod run -- python train.py --steps 100

      tpupod run --sync ~/code -- python train.py   # this repository's HEAD, on every worker

      tpupod run --timeout 3600 -e XLA_FLAGS=--xla_dump_to=/tmp/x -- python bench.py

      tpupod run --image app:1 --mount /data:/data:ro -- python train.py   # in containers

      tpupod run --retries 3 --sync ~/code -- python train.py   # survives preemption

      tpupod run --resume RUN --retry-errors 1   # a failed run, again from its checkpoint
    """
    raise typer.Exit(run_command(args))


@command("logs")
def logs(
    run_id: Annotated[
        str | None,
        typer.Argument(
            metavar="[RUN]", help="A launch id (default: the latest run).", show_default=False
        ),
    ] = None,
    pod: PodOption = None,
    worker: Annotated[
        int | None,
        typer.Option("--worker", "-w", help="Only this worker's log.", show_default=False),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Keep printing until the run ends, then exit with its exit code "
            "(1 if its launcher died).",
        ),
    ] = False,
    list_runs_wanted: Annotated[
        bool, typer.Option("--list", "-l", help="List the pod's runs, oldest first.")
    ] = False,
) -> None:
    """Show the output of a run, kept per worker ('tpupod run' writes it as the run goes).

    Examples:

      tpupod logs                     # the latest run, every worker

      tpupod logs -w 3 -f             # follow worker 3 of the latest run

      tpupod logs --list              # every run: when, how it ended, what ran
    """
    from tpupod.launch.logview import list_runs, show_logs

    state = StateDir()
    if list_runs_wanted:
        if run_id is not None or worker is not None or follow:
            raise UsageError("--list takes no RUN, --worker or --follow", hint="tpupod logs --list")
        list_runs(state, state.resolve_name(pod))
        return
    raise typer.Exit(
        show_logs(state, state.resolve_name(pod), run_id, worker=worker, follow=follow)
    )


@command("stacks")
def stacks(
    run_id: Annotated[
        str | None,
        typer.Argument(
            metavar="[RUN]", help="A running launch (default: the latest run).", show_default=False
        ),
    ] = None,
    pod: PodOption = None,
    worker: WorkerOption = None,
    native: Annotated[
        bool, typer.Option("--native", help="Also C/C++ frames (py-spy --native).")
    ] = False,
) -> None:
    """Every worker's Python stacks, taken at once (py-spy on each worker), grouped by
    identical stack with the odd ones first; the whole dump is saved in the run's folder.

    Examples:

      tpupod stacks                   # the latest run: where is each worker now?

      tpupod stacks -w s1 --native    # slice 1's workers, with C/C++ frames
    """
    from tpupod.hang.digest import hints
    from tpupod.hang.ofrun import stacks_of_run

    state = StateDir()
    found, lines, took, saved = stacks_of_run(
        state, state.resolve_name(pod), run_id, worker, native
    )
    print("\n".join(lines))
    for hint in hints(found):
        print(f"hint: {hint}", file=sys.stderr)
    workers = f"{len(found)} worker{'s' if len(found) != 1 else ''}"
    print(f"stacks of {workers} in {took:.1f}s, saved in {saved}", file=sys.stderr)


@command("cancel")
def cancel(
    run_id: Annotated[
        str | None,
        typer.Argument(
            metavar="[RUN]",
            help="The run's id ('tpupod logs --list'); left out: the one run going on the pod.",
            show_default=False,
        ),
    ] = None,
    pod: PodOption = None,
) -> None:
    """Stop a run from anywhere on this machine, as Ctrl-C in its terminal would: its
    workers are stopped; a --retries run is stopped in any phase, and a TPU its recovery
    was creating is deleted.

    Examples:

      tpupod cancel 20261127-080102-5d1e2a

      tpupod cancel --pod dev          # the one run going on pod dev
    """
    from tpupod.cli.flow.recover import cancel_run

    print(cancel_run(pod, run_id))
