"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from tpupod.errors import UsageError
from tpupod.names import ENV_NAME_RE


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


def parse_env(items: list[str] | None) -> dict[str, str]:
    """``["A=1", "B=x=y"]`` -> ``{"A": "1", "B": "x=y"}``, each name checked."""
    env: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not ENV_NAME_RE.match(name):
            raise UsageError(
                f"bad --env {item!r}", hint="write --env NAME=VALUE, e.g. --env XLA_FLAGS=--foo"
            )
        env[name] = value
    return env
