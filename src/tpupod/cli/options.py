"""Options shared by several commands, so each is spelled and documented once: the light
declarations are in ``cli/args.py`` (the fast paths read them); these are their typer
forms, for the commands without a fast path."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Annotated

import typer

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
)
from tpupod.cli.typed import annotated


class Format(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


if TYPE_CHECKING:  # what mypy checks the parameters against
    PodOption = str | None
    WorkerOption = str | None
    TimeoutOption = float | None
    GraceOption = float
    QuietOption = bool
    EnvOption = list[str] | None
    ImageOption = str | None
    MountOption = list[str] | None
    EngineOption = str | None
    PrivilegedOption = bool
else:
    PodOption = annotated(POD, str | None)
    WorkerOption = annotated(WORKER, str | None)
    TimeoutOption = annotated(TIMEOUT, float | None)
    GraceOption = annotated(GRACE, float)
    QuietOption = annotated(QUIET, bool)
    EnvOption = annotated(ENV, list[str] | None)
    ImageOption = annotated(IMAGE, str | None)
    MountOption = annotated(MOUNT, list[str] | None)
    EngineOption = annotated(ENGINE, str | None)
    PrivilegedOption = annotated(PRIVILEGED, bool)
FormatOption = Annotated[Format, typer.Option("--format", help="Output format.")]
