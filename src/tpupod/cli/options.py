"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

import enum
from typing import Annotated

import typer


class Format(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


PodOption = Annotated[
    str | None,
    typer.Option("--pod", "-p", help="The pod to use (default: the only pod).", show_default=False),
]
FormatOption = Annotated[Format, typer.Option("--format", help="Output format.")]
EnvOption = Annotated[
    list[str] | None,
    typer.Option(
        "--env",
        "-e",
        metavar="NAME=VALUE",
        help="Set a variable on every worker (repeatable).",
        show_default=False,
    ),
]
