"""``tpupod run --retries ...`` and ``--resume RUN``: the recovery, driven for the CLI."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpupod import procfs, settings
from tpupod.choices import RendezvousOn
from tpupod.errors import UsageError
from tpupod.recovery.policy import DEFAULT_NOTICE_GRACE_S, RetryPolicy, parse_exit_codes
from tpupod.recovery.record import RecoveryRecord
from tpupod.results import FanoutResult, OnFail
from tpupod.state import StateDir

if TYPE_CHECKING:
    from tpupod.fanout import Interrupt
    from tpupod.launch.run import RunResult
    from tpupod.live import Live
    from tpupod.pod import Pod
    from tpupod.runflow import RunArgs

AttemptLauncher = Callable[
    ["RunArgs", "Pod", "Live", dict[str, str], "Interrupt | None"], Awaitable["RunResult"]
]


def policy_of(args: RunArgs) -> RetryPolicy:
    """The retry policy the options ask for (a bad option is a UsageError)."""
    try:
        codes = parse_exit_codes(args.retry_exit_codes)
    except ValueError as exc:
        raise UsageError(
            f"--retry-exit-codes: {exc.args[0]!r} is not an exit code",
            hint="a comma-separated list of codes from 1 to 255, e.g. 42,75",
        ) from None
    if args.retries < 0 or args.retry_errors < 0:
        raise UsageError("--retries and --retry-errors count from 0", hint="e.g. --retries 3")
    zones = tuple(z.strip() for z in (args.zones or "").split(",") if z.strip())
    grace = DEFAULT_NOTICE_GRACE_S if args.notice_grace is None else args.notice_grace
    probe_s, probe_tries = settings.recovery_probe()
    return RetryPolicy(
        args.retries,
        args.retry_errors,
        codes,
        zones,
        notice_grace=grace,
        probe_s=probe_s,
        probe_tries=probe_tries,
    )


def run_recovering(args: RunArgs, launch_attempt: AttemptLauncher) -> int:
    """Run with recovery (or resume one); the run's exit code."""
    from tpupod.live import run_live
    from tpupod.recovery.loop import Recovery
    from tpupod.runflow import report_attempt

    state = StateDir()
    if args.resume:
        record, args = _resumed(state, args)
    else:
        target = state.resolve(args.pod)
        target.select(args.worker)
        record = RecoveryRecord.new(state, target.name, list(args.command), _options(args))
    policy = policy_of(args)
    pod = state.load(record.pod)
    if policy.retries and pod.provider == "gcp":
        # A notice TERMs every process of a preempted VM, the program's shell too: the first
        # worker to end must not cut the others' save at the preemption sync point short.
        args = dataclasses.replace(args, grace=max(args.grace, policy.notice_grace))

    async def body(live: Live) -> int:
        notice = live.on_notice if not args.quiet else (lambda text: None)

        async def launch(pod: Pod, env: dict[str, str], interrupt: Any) -> tuple[str, FanoutResult]:
            result = await launch_attempt(args, pod, live, env, interrupt)
            report_attempt(args, result)
            return result.launch.launch_id, result.fanout

        notice(
            f"run {record.run_id}: --retries {policy.retries}, --retry-errors "
            f"{policy.retry_errors}; if this launcher dies: tpupod run --resume {record.run_id}"
        )
        recovery = Recovery(
            record,
            state,
            policy,
            launch,
            notice=notice,
            interrupt=live.interrupt,
            setup_script=Path(args.setup) if args.setup else None,
            sync_repo=Path.cwd() if args.sync else None,
        )
        return await recovery.run(resumed=bool(args.resume))

    return run_live(pod.select(args.worker), False, body)


def _options(args: RunArgs) -> dict[str, Any]:
    """The run's options, as JSON (for --resume)."""
    options = dataclasses.asdict(args)
    options["on_fail"] = args.on_fail.value
    options["rendezvous_on"] = args.rendezvous_on.value
    options["cwd"] = os.getcwd()
    return options


def _resumed(state: StateDir, args: RunArgs) -> tuple[RecoveryRecord, RunArgs]:
    """The record of the run to resume, and the options it was started with."""
    from tpupod.runflow import RunArgs

    assert args.resume is not None
    record = RecoveryRecord.load(state, state.resolve_name(args.pod), args.resume)
    if record.state in ("done", "failed", "cancelled"):
        raise UsageError(
            f"run {record.run_id} is {record.state}: nothing to resume",
            hint="start a new run with 'tpupod run --retries N -- CMD'",
        )
    if record.launcher_pid != os.getpid() and procfs.alive(record.launcher_pid):
        raise UsageError(
            f"run {record.run_id} is still driven by pid {record.launcher_pid}",
            hint=f"'kill {record.launcher_pid}' first if it hangs",
        )
    fields = {f.name for f in dataclasses.fields(RunArgs)}
    options = {k: v for k, v in record.options.items() if k in fields}
    options.update(on_fail=OnFail(options["on_fail"]))
    options.update(rendezvous_on=RendezvousOn(options["rendezvous_on"]), resume=record.run_id)
    cwd = record.options.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)  # --sync ships the repository the run began in
    print(f"resuming run {record.run_id} (attempt {len(record.attempts) + 1})", file=sys.stderr)
    return record, RunArgs(**options)


CANCEL_WAIT_S = 120.0


def cancel_run(pod_name: str | None, run_id: str) -> str:
    """Stop a --retries run: its launcher is told as by Ctrl-C (it stops the workers and
    deletes what the recovery was creating); a launcher that is gone is done for. Returns
    what happened, in words."""
    import asyncio
    import signal
    import time

    from tpupod.recovery.loop import delete_unfinished

    state = StateDir()
    pod = state.resolve_name(pod_name)
    record = RecoveryRecord.load(state, pod, run_id)
    if record.state in ("done", "failed", "cancelled"):
        return f"run {run_id} is already {record.state}"
    if procfs.alive(record.launcher_pid):
        os.kill(record.launcher_pid, signal.SIGINT)
        deadline = time.monotonic() + CANCEL_WAIT_S
        ended = ("done", "failed", "cancelled")
        while procfs.alive(record.launcher_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
            if RecoveryRecord.load(state, pod, run_id).state in ended:
                break  # it wrote its end (its parent may not have reaped it yet)
        record = RecoveryRecord.load(state, pod, run_id)
        return f"run {run_id}: {record.state} (its launcher, pid {record.launcher_pid}, stopped it)"
    deleted = asyncio.run(delete_unfinished(record, state))
    record.state = "cancelled"
    record.save()
    return f"run {run_id}: cancelled" + (f"; deleted {deleted}" if deleted else "")
