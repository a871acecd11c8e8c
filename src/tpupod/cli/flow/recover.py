"""``tpupod run --retries ...`` and ``--resume RUN``: the recovery, driven for the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpupod import settings
from tpupod.base import procfs
from tpupod.cli.flow.attempt import RunArgs, check_args, launch_attempt, report_attempt
from tpupod.errors import UsageError
from tpupod.fanout.results import FanoutResult, OnFail
from tpupod.pod.choices import RendezvousOn
from tpupod.pod.state import StateDir
from tpupod.recovery.policy import (
    DEFAULT_NOTICE_GRACE_S,
    Cause,
    Counters,
    RetryPolicy,
)
from tpupod.recovery.record import RecoveryRecord

if TYPE_CHECKING:
    from tpupod.fanout.context import Sinks
    from tpupod.pod.record import Pod


def parse_exit_codes(text: str | None) -> frozenset[int]:
    """``--retry-exit-codes 42,75`` -> {42, 75}; a ValueError names a bad item."""
    if not text:
        return frozenset()
    codes = set()
    for word in text.split(","):
        item = word.strip()
        if not item.isdigit() or not 0 < int(item) < 256:
            raise ValueError(item)
        codes.add(int(item))
    return frozenset(codes)


def policy_of(args: RunArgs) -> RetryPolicy:
    """The retry policy the options ask for (a bad option is a UsageError)."""
    try:
        codes = parse_exit_codes(args.retry_exit_codes)
    except ValueError as exc:
        raise UsageError(
            f"--retry-exit-codes: {exc.args[0]!r} is not an exit code",
            hint="a comma-separated list of codes from 1 to 255, e.g. 42,75",
        ) from None
    if min(args.retries, args.retry_errors, args.retry_hangs) < 0:
        raise UsageError(
            "--retries, --retry-errors and --retry-hangs count from 0", hint="e.g. --retries 3"
        )
    zones = tuple(z.strip() for z in (args.zones or "").split(",") if z.strip())
    grace = DEFAULT_NOTICE_GRACE_S if args.notice_grace is None else args.notice_grace
    probe_s, probe_tries = settings.recovery_probe()
    return RetryPolicy(
        args.retries,
        args.retry_errors,
        args.retry_hangs,
        codes,
        zones,
        notice_grace=grace,
        probe_s=probe_s,
        probe_tries=probe_tries,
        elastic=args.elastic,
        min_slices=args.min_slices,
    )


def run_recovering(args: RunArgs) -> int:
    """Run with recovery (or resume one); the run's exit code."""
    from tpupod.cli.flow.live import run_live
    from tpupod.recovery.loop import Recovery

    state = StateDir()
    record: RecoveryRecord | None = None
    if args.resume:
        record, args = _resumed(state, args)
        pod = state.load(record.pod)
    else:
        pod = state.resolve(args.pod)
    pod.subset(pod.select(args.worker))
    policy = policy_of(args)
    options = _checked(args, pod, policy)  # bad input leaves no record behind
    if record is None:
        record = RecoveryRecord.new(state, pod.name, list(args.command), options)
    if policy.retries and pod.provider == "gcp":
        # A notice TERMs every process of a preempted VM, the program's shell too: the first
        # worker to end must not cut the others' save at the preemption sync point short.
        args = args.replace(grace=max(args.grace, policy.notice_grace))

    async def body(live: Sinks) -> int:
        notice = live.on_notice if not args.quiet else (lambda text: None)

        async def launch(
            pod: Pod,
            env: dict[str, str],
            interrupt: Any,
            began: Callable[[str], None],
            on: str | None,
        ) -> tuple[str, FanoutResult]:
            result = await launch_attempt(
                args.replace(worker=on) if on else args, pod, live, env, interrupt,
                on_launch=lambda launch: began(launch.launch_id),
            )  # fmt: skip
            report_attempt(args, result)
            return result.launch.launch_id, result.fanout

        notice(
            f"run {record.run_id}: --retries {policy.retries}, --retry-errors "
            f"{policy.retry_errors}"
            + (f", --retry-hangs {policy.retry_hangs}" if policy.retry_hangs else "")
            + f"; if this launcher dies: tpupod run --resume {record.run_id}"
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
            on_line=None if args.quiet else live.on_line,
        )
        return await recovery.run(resumed=bool(args.resume))

    return run_live(pod.subset(pod.select(args.worker)).workers, False, body)


def _checked(args: RunArgs, pod: Pod, policy: RetryPolicy) -> dict[str, Any]:
    """The run's options as its record keeps them (for --resume), once what would fail
    every attempt the same way is refused, before any work (a UsageError)."""
    from tpupod.recovery.loop import head_commit

    options = _options(args)
    check_args(args, pod)
    if args.setup and not Path(args.setup).is_file():
        raise UsageError(
            f"--setup {args.setup}: no such file",
            hint="--setup takes the pod's setup script, a file here; it runs on every worker "
            "first, and again on a recreated TPU",
        )
    if args.sync:
        head_commit(Path.cwd())
    _check_elastic(args, pod, policy)
    if policy.zones and pod.provider != "gcp":
        raise UsageError(
            f"--zones: pod {pod.name!r} is a {pod.provider} pod, which is never created again",
            hint="leave --zones out: on local and SSH pods --retries reruns on the same hosts",
        )
    return options


def _check_elastic(args: RunArgs, pod: Pod, policy: RetryPolicy) -> None:
    """--elastic needs separate TPU slices (they are preempted and made again one by one)
    and retries; --min-slices, a count of them."""
    from tpupod.pod.spec import GcpPodSpec

    separate = isinstance(pod.spec, GcpPodSpec) and pod.spec.slices > 1
    if policy.elastic and not separate:
        raise UsageError(
            f"--elastic: pod {pod.name!r} is not a pod of separate TPU slices",
            hint="make one with 'tpupod up --gcp --slices N' (a preempted slice is made "
            "again alone, while the others go on)",
        )
    if policy.elastic and not policy.retries:
        raise UsageError(
            "--elastic recovers from preemptions, and --retries N counts them",
            hint="e.g. --retries 3 --elastic",
        )
    if args.min_slices != 1 and not policy.elastic:
        raise UsageError("--min-slices is --elastic's", hint="add --elastic")
    if policy.elastic and policy.min_slices > pod.slices:
        raise UsageError(
            f"--min-slices {policy.min_slices}: pod {pod.name!r} has {pod.slices} slices",
            hint=f"from 1 to {pod.slices}",
        )
    if policy.elastic and args.worker:
        raise UsageError("--elastic runs on every slice of the pod: leave -w out")


def _options(args: RunArgs) -> dict[str, Any]:
    """The run's options, as JSON (for --resume)."""
    options = args.as_dict()
    options["on_fail"] = args.on_fail.value
    options["rendezvous_on"] = args.rendezvous_on.value
    options["cwd"] = os.getcwd()
    return options


def _resumed(state: StateDir, args: RunArgs) -> tuple[RecoveryRecord, RunArgs]:
    """The record of the run to resume, and the options it was started with."""

    assert args.resume is not None
    record = RecoveryRecord.load(state, state.resolve_name(args.pod), args.resume)
    if record.state in ("done", "cancelled"):
        raise UsageError(
            f"run {record.run_id} is {record.state}: nothing to resume",
            hint="start a new run with 'tpupod run --retries N -- CMD'",
        )
    if record.launcher_pid != os.getpid() and procfs.alive(record.launcher_pid):
        raise UsageError(
            f"run {record.run_id} is still driven by pid {record.launcher_pid}",
            hint=f"'kill {record.launcher_pid}' first if it hangs",
        )
    fields = set(RunArgs.names())
    options = {k: v for k, v in record.options.items() if k in fields}
    options.update(on_fail=OnFail(options["on_fail"]))
    options.update(rendezvous_on=RendezvousOn(options["rendezvous_on"]), resume=record.run_id)
    # Retry flags given with --resume count from here (they replace the run's own).
    options.update({k: getattr(args, k) for k in RETRY_FLAGS if getattr(args, k) != _default(k)})
    resumed = RunArgs(**options)
    if record.state == "failed":
        _rerun_failed(record, policy_of(resumed))
    cwd = record.options.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)  # --sync ships the repository the run began in
    print(f"resuming run {record.run_id} (attempt {len(record.attempts) + 1})", file=sys.stderr)
    return record, resumed


RETRY_FLAGS = (
    "retries",
    "retry_errors",
    "retry_hangs",
    "retry_exit_codes",
    "zones",
    "notice_grace",
    "elastic",
    "min_slices",
)


def _default(name: str) -> Any:
    return RunArgs.default_of(name)


def _rerun_failed(record: RecoveryRecord, policy: RetryPolicy) -> None:
    """A failed run goes on from its checkpoint when the flags given now rerun the cause of
    its last attempt (that rerun is the first they allow); else a UsageError names them."""
    last = record.current
    cause = Cause(last.cause) if last.cause else Cause.ERROR
    if cause is Cause.ERROR and last.exit_code in policy.retry_exit_codes:
        cause = Cause.LISTED
    counters = Counters()
    # an error no rerun fixes (quota, permission) ended it: fixed since, it goes on as it was
    if cause is not Cause.FATAL and not counters.allow(cause, policy):
        flag = {
            Cause.PREEMPTED: "--retries 1",
            Cause.LOST: "--retries 1",
            Cause.HUNG: "--retry-hangs 1",
        }.get(cause, "--retry-errors 1")
        raise UsageError(
            f"run {record.run_id} failed ({cause}, exit {last.exit_code}): nothing given reruns it",
            hint=f"'tpupod run --resume {record.run_id} {flag}' reruns it from its checkpoint",
        )
    record.counters = vars(counters).copy()
    record.state, record.exit_code = "recovering", None


CANCEL_WAIT_S = 120.0


def cancel_run(pod_name: str | None, run_id: str | None) -> str:
    """Stop a --retries run: its launcher is told as by Ctrl-C (it stops the workers and
    deletes what the recovery was creating); a launcher that is gone is done for. Returns
    what happened, in words. ``run_id`` None: the one run going on the pod."""
    from tpupod.recovery.loop import delete_unfinished

    state = StateDir()
    pod = state.resolve_name(pod_name)
    run_id = run_id or _the_run_going(state, pod)
    if not RecoveryRecord.exists(state, pod, run_id):
        return _stop_plain(pod, run_id)
    record = RecoveryRecord.load(state, pod, run_id)
    if record.state in ("done", "failed", "cancelled"):
        return f"run {run_id} is already {record.state}"
    if procfs.alive(record.launcher_pid):
        record.cancel_file.write_text("'tpupod cancel'\n")  # so it says why, not "Ctrl-C"
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


def _the_run_going(state: StateDir, pod: str) -> str:
    """The id of the one run going on ``pod`` (its users: a plain run's launch, a --retries
    run), or a UsageError that lists them or says there is none."""
    from tpupod.pod import users  # a cancel without RUN only
    from tpupod.pod.lifecycle import one_per_run  # as above

    going = [user.run_id for user in one_per_run(users.users(state, pod)) if user.run_id]
    if len(going) == 1:
        return going[0]
    if not going:
        raise UsageError(
            f"no run is going on pod {pod!r}",
            hint=f"'tpupod logs --list --pod {pod}' lists its runs",
        )
    raise UsageError(
        f"{len(going)} runs are going on pod {pod!r}: {', '.join(going)}",
        hint="name the one to stop: tpupod cancel RUN",
    )


def _stop_plain(pod: str, run_id: str) -> str:
    """A run without --retries: its launcher is told as by Ctrl-C, as the dashboard's stop."""
    from tpupod.launch.records import get_run

    run = get_run(pod, run_id)
    if run.ended():
        return f"run {run_id} is already over: {run.reread().ending.describe()}"
    ended = run.stop(CANCEL_WAIT_S, by=f"'tpupod cancel' (pid {os.getpid()})")
    if ended:  # stopped (exit 130): stopped by 'tpupod cancel' (pid 8002): 2 workers did not ...
        return f"run {run_id}: {run.reread().ending.describe()}"
    return f"run {run_id}: still stopping (its launcher, pid {run.launcher_pid}, was told to stop)"
