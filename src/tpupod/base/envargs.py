"""``NAME=VALUE`` arguments (``--env``, ``--label``), parsed and checked once (light: exec's
fast path uses it)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from tpupod.errors import UsageError
from tpupod.pod.names import ENV_NAME_RE


def parse_pairs(
    items: Iterable[str] | None,
    *,
    option: str,
    example: str,
    name_re: re.Pattern[str] | None = None,
    error: type[UsageError] = UsageError,
) -> dict[str, str]:
    """``["A=1", "B=x=y"]`` -> ``{"A": "1", "B": "x=y"}``. Each item needs a ``=`` and a name
    (that ``name_re`` matches, when given); a bad one raises ``error`` naming ``option``."""
    pairs: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        try:
            name.encode()
        except UnicodeEncodeError:  # a byte that is not UTF-8: a name is text everywhere
            from tpupod.base.jsontext import lone_surrogate  # (json) this rare case only

            said = lone_surrogate(name) or "not UTF-8 text"
            hint = f"write {option} NAME=VALUE as UTF-8 text"
            raise error(f"bad {option}: {said}", hint=hint) from None
        if not sep or not name or (name_re is not None and not name_re.match(name)):
            raise error(
                f"bad {option} {item!r}", hint=f"write {option} NAME=VALUE, e.g. {option} {example}"
            )
        pairs[name] = value
    return pairs


def parse_env(items: Iterable[str] | None) -> dict[str, str]:
    """``--env`` items, each name a valid environment variable name."""
    return parse_pairs(items, option="--env", example="XLA_FLAGS=--foo", name_re=ENV_NAME_RE)
