"""What ``--retries``, ``--retry-errors`` and ``--retry-exit-codes`` allow, and why an
attempt ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

DEFAULT_NOTICE_GRACE_S = 25.0  # within GCE's ~30 s preemption notice
DEFAULT_PROBE_S = 120.0  # how long an unreachable worker or a failing API is retried
DEFAULT_PROBE_TRIES = 0  # no cap on the count: the budget is its time (probe_s)
LISTED_MAX = 100  # listed exit codes are always rerun: up to this many times (a loop guard)


class Cause(enum.StrEnum):
    """Why an attempt ended."""

    OK = "ok"
    PREEMPTED = "preempted"  # the provider confirmed it
    LOST = "lost worker"  # a worker stopped answering, no preemption confirmed
    LISTED = "listed exit code"  # the program exited with one of --retry-exit-codes
    ERROR = "program error"
    HUNG = "hung"  # no worker progressed for --hang-timeout: the watchdog stopped it
    # an error no rerun fixes (TpupodError.lasting: the API refused the create for quota or
    # permission, the rendezvous cannot start): the run ends with it
    FATAL = "error"
    INTERRUPTED = "interrupted"  # Ctrl-C, tpupod cancel
    LAUNCHER_LOST = "launcher lost"  # the launcher died during it (then --resume)
    GROW = "grown"  # --elastic: stopped at a checkpoint to go on with a slice that came back


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 0  # recoveries from preemption or a lost worker
    retry_errors: int = 0  # reruns after the program's own failures
    retry_hangs: int = 0  # reruns after a hang (--hang-timeout)
    retry_exit_codes: frozenset[int] = field(default_factory=frozenset)  # always rerun
    zones: tuple[str, ...] = ()  # where to recreate when the first zone has no capacity
    notice_grace: float = DEFAULT_NOTICE_GRACE_S
    probe_s: float = DEFAULT_PROBE_S
    probe_tries: int = DEFAULT_PROBE_TRIES
    elastic: bool = False  # a preempted slice: go on without it while it is made again
    min_slices: int = 1  # --elastic: fewer slices left than this, wait for them

    @property
    def active(self) -> bool:
        """Does the run recover at all (else it is one plain attempt)?"""
        return bool(self.retries or self.retry_errors or self.retry_exit_codes or self.retry_hangs)


@dataclass
class Counters:
    recoveries: int = 0  # preemptions and lost workers recovered from
    error_reruns: int = 0  # reruns after the program's own failures
    listed_reruns: int = 0  # reruns after a listed exit code
    hang_reruns: int = 0  # reruns after a hang

    def allow(self, cause: Cause, policy: RetryPolicy) -> bool:
        """Count one more rerun for ``cause`` if its budget allows it; False when spent."""
        name, budget = {
            Cause.PREEMPTED: ("recoveries", policy.retries),
            Cause.LOST: ("recoveries", policy.retries),
            Cause.LISTED: ("listed_reruns", LISTED_MAX),
            Cause.ERROR: ("error_reruns", policy.retry_errors),
            Cause.HUNG: ("hang_reruns", policy.retry_hangs),
        }.get(cause, ("", 0))
        if not name or getattr(self, name) >= budget:
            return False
        setattr(self, name, getattr(self, name) + 1)
        return True

    def describe(self) -> str:
        return (
            f"{counted(self.recoveries, 'recovery', 'recoveries')} (preempted or lost), "
            f"{counted(self.error_reruns, 'rerun', 'reruns')} after errors, "
            f"{self.listed_reruns} after listed exit codes"
            + (
                f", {counted(self.hang_reruns, 'rerun', 'reruns')} after hangs"
                if self.hang_reruns
                else ""
            )
        )


def counted(count: int, one: str, many: str) -> str:
    """``1 recovery``, ``2 recoveries``."""
    return f"{count} {one if count == 1 else many}"
