"""What a job is: its status, the request that submits it, and the row read back."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpupod.base.jsontext import lone_surrogate
from tpupod.jobs.code import syntax_problem
from tpupod.jobs.history import Entry, counted, load_history
from tpupod.jobs.rows import MAX_ATTEMPTS


class JobStatus(enum.StrEnum):
    """pending -> scheduled (leased by a runner) -> running (every worker started) -> an end."""

    PENDING = "pending"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})
LEASED = frozenset({JobStatus.SCHEDULED, JobStatus.RUNNING})


class JobRequest(BaseModel):
    """A new job: Python ``code`` (run with ``logger`` and ``result``) or a ``command`` line.

    Seed 003's Firestore document is accepted as is: its ``status`` and ``created_at`` are
    ignored (the store sets them) and fields this model does not know (``challenge_number``)
    are kept in ``metadata``.
    """

    model_config = ConfigDict(extra="allow")

    code: str | None = None
    command: str | None = None
    name: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)
    max_attempts: int = Field(default=3, ge=1, le=MAX_ATTEMPTS)
    retries: int = Field(default=0, ge=0, le=99)  # program failures run again this many times
    pod: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_body(self) -> JobRequest:
        if (self.code is None) == (self.command is None):
            raise ValueError("give exactly one of code and command")
        if not (self.code or self.command or "").strip():
            raise ValueError("code or command is empty")
        if self.code is not None and (problem := syntax_problem(self.code)):
            raise ValueError(problem)
        if self.retries >= self.max_attempts:
            raise ValueError(
                f"retries {self.retries} needs max_attempts of at least {self.retries + 1}"
            )
        if (problem := lone_surrogate(self.model_dump())) is not None:
            raise ValueError(f"{problem}: no database can store it")
        extra = dict(self.model_extra or {})
        for ignored in ("status", "created_at"):  # the seed's; the store owns these
            extra.pop(ignored, None)
        if extra:
            self.metadata = {**extra, **self.metadata}
            for key in list(self.model_extra or {}):
                delattr(self, key)
        return self


@dataclass(frozen=True)
class Job:
    """A job as stored."""

    id: int
    name: str
    status: JobStatus
    code: str | None
    command: str | None
    labels: dict[str, str]
    priority: int
    timeout: float | None
    pod: str | None
    attempt: int
    max_attempts: int
    lease_owner: str | None
    lease_expires_at: float | None
    cancel_requested: bool
    created_at: float
    scheduled_at: float | None
    started_at: float | None
    completed_at: float | None
    updated_at: float
    result: Any  # the JSON value the job's ``result`` became (None: none)
    error: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    retries: int = 0  # program failures that run it again (max_attempts bounds all attempts)
    runner: str | None = None  # the runner of the latest attempt (kept after it ends)
    history: tuple[Entry, ...] = ()  # attempts that did not simply end the job

    @property
    def counted_attempts(self) -> int:
        """Its attempts that count against ``max_attempts`` (those given back do not)."""
        return counted(self.attempt, self.history)

    @classmethod
    def from_row(cls, row: Any) -> Job:
        values = dict(row._mapping)
        return cls(
            id=values["id"],
            name=values["name"],
            status=JobStatus(values["status"]),
            code=values["code"],
            command=values["command"],
            labels=json.loads(values["labels"]),
            priority=values["priority"],
            timeout=values["timeout_s"],
            pod=values["pod"],
            attempt=values["attempt"],
            max_attempts=values["max_attempts"],
            retries=values["retries"],
            lease_owner=values["lease_owner"],
            lease_expires_at=values["lease_expires_at"],
            cancel_requested=bool(values["cancel_requested"]),
            created_at=values["created_at"],
            scheduled_at=values["scheduled_at"],
            started_at=values["started_at"],
            completed_at=values["completed_at"],
            updated_at=values["updated_at"],
            result=decode_result(values["result"]),
            error=values["error"],
            metadata=json.loads(values["metadata"]),
            runner=values.get("runner"),
            history=load_history(values.get("history")),
        )

    def to_dict(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["status"] = self.status.value
        data["history"] = [entry.to_dict() for entry in self.history]
        return data


def decode_result(stored: str | None) -> Any:
    """A stored result (JSON text) as its value. Rows written before results were always
    JSON hold a string as is: what is not JSON is that string."""
    if stored is None:
        return None
    try:
        return json.loads(stored)
    except ValueError:
        return stored


@dataclass(frozen=True)
class LogLine:
    """One line of a job's output; ``seq`` is its offset in the job's log (from 1)."""

    seq: int
    attempt: int
    worker: int
    line: str


@dataclass(frozen=True)
class AttemptLines:
    """What one attempt of a job printed: how many lines, the offsets of its first and last
    (None: none), and how many workers printed them."""

    attempt: int
    lines: int
    first_seq: int | None
    last_seq: int | None
    workers: int


@dataclass(frozen=True)
class Claim:
    """A runner's lease on one attempt of a job: every write it makes is fenced by it."""

    job: Job
    attempt: int
    owner: str
    next_seq: int
