"""``tpupod run`` (a program on every worker in lockstep) and ``tpupod logs``."""

from __future__ import annotations

from typing import Annotated

import typer

from tpupod.cli.app import command
from tpupod.cli.exec import GraceOption, TimeoutOption, WorkerOption
from tpupod.cli.flow.run import RunArgs, run_command
from tpupod.cli.image import EngineOption, ImageOption, MountOption, PrivilegedOption
from tpupod.cli.options import EnvOption, PodOption
from tpupod.fanout.results import DEFAULT_GRACE_S, OnFail
from tpupod.pod.choices import RendezvousOn


@command("run", context_settings={"allow_interspersed_args": False})
def run(
    command_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="-- CMD...", help="The program.", show_default=False),
    ] = None,
    pod: PodOption = None,
    worker: WorkerOption = None,
    on_fail: Annotated[
        OnFail, typer.Option("--on-fail", help="On the first failure: kill the others, or wait.")
    ] = OnFail.KILL,
    timeout: TimeoutOption = None,
    grace: GraceOption = DEFAULT_GRACE_S,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            help="Print only the program's output and errors: no notices, no summary "
            "(a failure still gets its one line).",
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Also print the runtime's own chatter (gloo's connection lines) and what "
            "the others print after the first failure; both are always kept in 'tpupod logs'.",
        ),
    ] = False,
    env: EnvOption = None,
    sync: Annotated[
        str | None,
        typer.Option(
            "--sync",
            metavar="DIR",
            help="First ship this repository's HEAD to DIR on "
            "every worker (all must end at the same commit), and run the program there.",
            show_default=False,
        ),
    ] = None,
    rendezvous_on: Annotated[
        RendezvousOn,
        typer.Option(
            "--rendezvous-on",
            help="Where the rendezvous runs: launcher, worker0, or auto "
            "(worker0 for a Cloud TPU reached at external addresses).",
        ),
    ] = RendezvousOn.AUTO,
    worker_python: Annotated[
        str | None,
        typer.Option(
            "--worker-python",
            help="The python on worker 0 that has tpupod, for a rendezvous there (default: "
            "the command's python when it starts with one, else python3).",
            show_default=False,
        ),
    ] = None,
    coordinator_port: Annotated[
        int | None,
        typer.Option(
            "--coordinator-port",
            help="JAX coordinator port on worker 0 "
            "(default: 8476 on hosts, a free port on a local pod).",
            show_default=False,
        ),
    ] = None,
    image: ImageOption = None,
    mount: MountOption = None,
    engine: EngineOption = None,
    privileged: PrivilegedOption = False,
    retries: Annotated[
        int,
        typer.Option(
            "--retries",
            help="Recover up to N times from a preemption (the TPU deleted, created again, "
            "set up, synced, relaunched) or a lost worker, rerun: one whose host stops "
            "answering, or killed by KILL, TERM or HUP without a word of its own (the OOM "
            "killer, an operator, a host going down). A host still silent after the probe "
            "budget ends the run (exit 255).",
        ),
    ] = 0,
    retry_errors: Annotated[
        int,
        typer.Option(
            "--retry-errors",
            help="Rerun up to M times after the program's own failures: an exception, "
            "sys.exit(N), an exit code, a crash.",
        ),
    ] = 0,
    retry_exit_codes: Annotated[
        str | None,
        typer.Option(
            "--retry-exit-codes",
            metavar="CODES",
            help="Always rerun after these exit codes (e.g. 42,75; 143 for a program "
            "that saves on SIGTERM and exits 143 itself).",
            show_default=False,
        ),
    ] = None,
    zones: Annotated[
        str | None,
        typer.Option(
            "--zones",
            metavar="Z1,Z2",
            help="Recreate a preempted TPU in these zones when its own has no capacity.",
            show_default=False,
        ),
    ] = None,
    notice_grace: Annotated[
        float | None,
        typer.Option(
            "--notice-grace",
            metavar="SECONDS",
            help="On a preemption notice: SIGTERM, then KILL after this long (default 25).",
            show_default=False,
            min=0,
        ),
    ] = None,
    setup: Annotated[
        str | None,
        typer.Option(
            "--setup",
            metavar="SCRIPT",
            help="The pod's setup script: run first, and again on a recreated TPU.",
            show_default=False,
        ),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN",
            help="Continue run RUN after its launcher died (no CMD); or a run that failed, "
            "with the flag that reruns its end (e.g. --retry-errors 1), from its checkpoint.",
            show_default=False,
        ),
    ] = None,
) -> None:
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
    args = RunArgs(
        command=list(command_args or []),
        pod=pod,
        worker=worker,
        on_fail=on_fail,
        timeout=timeout,
        grace=grace,
        quiet=quiet,
        verbose=verbose,
        env=list(env or []),
        sync=sync,
        rendezvous_on=rendezvous_on,
        worker_python=worker_python,
        coordinator_port=coordinator_port,
        image=image,
        mounts=list(mount or []),
        engine=engine,
        privileged=privileged,
        retries=retries,
        retry_errors=retry_errors,
        retry_exit_codes=retry_exit_codes,
        zones=zones,
        notice_grace=notice_grace,
        setup=setup,
        resume=resume,
    )
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
        bool, typer.Option("--follow", "-f", help="Keep printing until the run ends.")
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
    from tpupod.errors import UsageError
    from tpupod.launch.logview import list_runs, show_logs
    from tpupod.pod.state import StateDir

    state = StateDir()
    if list_runs_wanted:
        if run_id is not None or worker is not None or follow:
            raise UsageError("--list takes no RUN, --worker or --follow", hint="tpupod logs --list")
        list_runs(state, state.resolve_name(pod))
        return
    show_logs(state, state.resolve_name(pod), run_id, worker=worker, follow=follow)


@command("cancel")
def cancel(
    run_id: Annotated[
        str, typer.Argument(metavar="RUN", help="The run's id ('tpupod logs --list').")
    ],
    pod: PodOption = None,
) -> None:
    """Stop a run from anywhere on this machine, as Ctrl-C in its terminal would: its
    workers are stopped; a --retries run is stopped in any phase, and a TPU its recovery
    was creating is deleted.

    Examples:

      tpupod cancel 20261127-080102-5d1e2a
    """
    from tpupod.cli.flow.recover import cancel_run

    print(cancel_run(pod, run_id))
