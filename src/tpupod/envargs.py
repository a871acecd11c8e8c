"""``--env NAME=VALUE`` arguments, parsed and checked once (light: exec's fast path uses it)."""

from __future__ import annotations

from collections.abc import Iterable

from tpupod.errors import UsageError
from tpupod.names import ENV_NAME_RE


def parse_env(items: Iterable[str] | None) -> dict[str, str]:
    """``["A=1", "B=x=y"]`` -> ``{"A": "1", "B": "x=y"}``, each name checked."""
    env: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not ENV_NAME_RE.match(name):
            raise UsageError(
                f"bad --env {item!r}", hint="write --env NAME=VALUE, e.g. --env XLA_FLAGS=--foo"
            )
        env[name] = value
    return env
