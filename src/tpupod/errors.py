"""One exception hierarchy for everything tpupod says went wrong.

Every error a user can see carries a one-line message and a hint (what to do
about it); the CLI prints both and exits with the error's ``exit_code``, with
no traceback unless ``--debug`` is given. Third-party exceptions are
translated into these at the seam where they arise, chained with ``from``.

    TpupodError                  exit 1
    ├── UsageError               exit 2   bad flags or arguments
    │   ├── SpecError            exit 2   a pod spec file that does not validate
    │   ├── BenchConfigError     exit 2   a checkpoint benchmark config that does not validate
    │   └── ExtractError         exit 2   extraction input or output that cannot be used
    │       └── DataError        exit 2   a data file: malformed lines (--strict), duplicate ids
    ├── MissingExtra             exit 1   a command's optional packages are not installed
    ├── StateError               exit 1   the state directory: a pod exists, a record is corrupt
    │   ├── PodNotFound          exit 2   no pod by that name, no pod at all, or which one?
    │   └── PodExists
    ├── WorkerError              exit 1   one worker: could not start or reach it
    ├── IdentityError            exit 1   a worker's identity cannot be told for sure
    ├── RendezvousError          exit 1   a barrier timed out, workers disagree, or one was refused
    ├── PreflightError           exit 1   a worker is not ready for a launch; nothing started
    ├── GcpError                 exit 1   the Cloud TPU API refused, or a TPU is in a bad state
    │   └── GcpRefused           exit 1   ... for quota or permission: no retry changes that
    ├── ModelError               exit 1   the model: bad arguments, generation limits
    │   └── CheckpointError      exit 1   a folder that is not a loadable Qwen checkpoint
    ├── BenchError               exit 1   a checkpoint benchmark that failed or restored wrong data
    ├── JobError                 exit 1   the job service: a job failed, or the store refused
    │   ├── JobStoreError        exit 1   the database cannot be opened or reached
    │   │   └── JobStoreAway     exit 1   ... because it is not answering now (down, restarting)
    │   ├── JobNotFound          exit 2   no job by that id
    │   └── LeaseLost            exit 1   a runner's write was fenced off (a newer attempt owns it)
    ├── ServeError               exit 1   the serving fleet: an agent, server or router failed
    └── FanoutFailed             exit N   a fan-out where some worker did not succeed
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads it as True)
if TYPE_CHECKING:
    from typing import Any


class TpupodError(Exception):
    """Base of every error tpupod raises on purpose."""

    exit_code: int = 1
    # Another try fails the same way until the user changes something (a quota, a
    # permission, a worker's python without tpupod): a run with --retries ends with it.
    lasting: bool = False

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(TpupodError):
    """The command line or an argument is wrong."""

    exit_code = 2


class SpecError(UsageError):
    """A pod spec (tpupod.yaml or flags) does not validate."""


class ExtractError(UsageError):
    """``tpupod extract`` was given input or an output folder it cannot use."""


class DataError(ExtractError):
    """A data file that cannot be extracted from: malformed lines, duplicate ids, no samples."""


class BenchConfigError(UsageError):
    """A ``tpupod bench checkpoint`` config with problems, every one named by its key."""

    @classmethod
    def of(
        cls, source: str, problems: list[str], places: list[str | None] | None = None
    ) -> BenchConfigError:
        """One error of every problem; each with its ``LINE:COLUMN`` in ``source`` where
        ``places`` has one (``bench.yaml:12:7: benchmarks[0].options.use_zarr3: ...``)."""
        hint = "the format is Orbax's benchmark YAML; see 'tpupod bench checkpoint --help'"
        at = [f"{source}:{place}: " if place else "" for place in places or [None] * len(problems)]
        if len(problems) == 1:
            return cls(f"{at[0] or f'{source}: '}{problems[0]}", hint)
        listed = "\n".join(f"  - {a}{p}" for a, p in zip(at, problems, strict=True))
        return cls(f"{source}: {len(problems)} problems\n{listed}", hint)


class MissingExtra(TpupodError):
    """A command needs an extra (``tpupod[serve]``, ...) whose packages are not installed.

    ``subject``: what needs it (``'tpupod serve up'``, ``a Cloud TPU pod``); ``where``:
    said after it when the check ran on a worker."""

    def __init__(self, subject: str, extra: str, modules: list[str], *, where: str = "") -> None:
        super().__init__(
            f"{subject} needs the {extra} extra{where} (not installed: {', '.join(modules)})",
            hint=f"pip install 'tpupod[{extra}]'",
        )
        self.extra = extra
        self.modules = modules


class StateError(TpupodError):
    """The state directory does not hold what the command needs."""


class PodNotFound(StateError):
    """No pod by that name, no pod at all, or several and none named: bad input (exit 2)."""

    exit_code = 2


class PodExists(StateError):
    """A pod by that name exists with a different spec."""


class WorkerError(TpupodError):
    """Something failed on one worker before or around its command.

    ``reason`` is the message without the worker's name, for places (a row of
    the summary table) that already show which worker it is. ``unreachable``:
    the worker could not be reached at all (no connection, no answer), which
    every command reports with exit code 255, as ``ssh`` does.
    """

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        *,
        worker: int | None = None,
        reason: str = "",
        unreachable: bool = False,
    ) -> None:
        super().__init__(message, hint)
        self.worker = worker
        self.reason = reason or message
        self.unreachable = unreachable


class IdentityError(TpupodError):
    """The worker's identity cannot be told for sure."""


class RendezvousError(TpupodError):
    """A barrier timed out, the workers disagree, or this worker was refused."""


class PreflightError(TpupodError):
    """A worker is not ready for a launch; nothing was started. ``unreachable``: the
    workers that did not answer (``w1``), which a run with --retries takes for lost."""

    def __init__(
        self, message: str, hint: str | None = None, unreachable: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message, hint)
        self.unreachable = unreachable


class GcpError(TpupodError):
    """The Cloud TPU API refused, or a TPU ended up in a state it cannot be used in."""


class GcpRefused(GcpError):
    """The Cloud TPU API refused for quota (429, RESOURCE_EXHAUSTED) or permission (403):
    until the user changes that, every try is refused the same way."""

    lasting = True

    def __init__(self, message: str, hint: str | None = None, *, quota: bool = False) -> None:
        super().__init__(message, hint)
        self.quota = quota


class ModelError(TpupodError):
    """The model was asked for something it cannot do (a layer it lacks, too long a prompt)."""


class CheckpointError(ModelError):
    """A checkpoint folder that is not a supported, complete Qwen checkpoint.

    ``problems`` lists every mismatch found (missing, unexpected or misshapen
    tensors), so one load reports all of them at once.
    """

    def __init__(self, message: str, hint: str | None = None, problems: list[str] | None = None):
        self.problems = problems or []
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message, hint)


class BenchError(TpupodError):
    """A checkpoint benchmark that did not finish, or whose restored arrays differ."""


class JobError(TpupodError):
    """The job service: a job that failed, or a store that cannot be used."""


class JobStoreError(JobError):
    """The job store's database cannot be opened or reached, or refused a query."""


class JobStoreAway(JobStoreError):
    """The job store's server is not answering now: not listening, starting up, shutting
    down or full. Worth waiting for, unlike a server that refuses (no such database, role
    or password) or a query it rejects."""


class JobNotFound(JobError):
    """No job by that id in the store: bad input (exit 2)."""

    exit_code = 2


class LeaseLost(JobError):
    """A runner's write was fenced off: its lease on that attempt expired or was taken over."""


class ServeError(TpupodError):
    """The serving fleet: an agent or server did not start, or the router cannot be reached."""


class FanoutFailed(TpupodError):
    """Raised by ``FanoutResult.raise_for_failures`` when some worker did not succeed.

    ``result`` is that ``FanoutResult``, typed loosely: the error tree imports nothing of
    tpupod (results.py raises this error, so naming its type here would close a circle)."""

    def __init__(self, message: str, exit_code: int, result: Any) -> None:
        super().__init__(
            message, hint="scroll up for that worker's output, or rerun on it alone with --worker"
        )
        self.result = result
        self.exit_code = exit_code
