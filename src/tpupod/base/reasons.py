"""pydantic's checks in a person's words, for every place that reports one: a command's
option (``cli/app.py``: ``--timeout -1: must be at least 0.001``) and a pod's spec
(``pod/spec.py``: ``--local: must be at least 1 (got 0)``) say it alike."""

from __future__ import annotations

from typing import Any

PLAIN_REASONS = {
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be more than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "bool_parsing": "must be true or false",
}


def plain_reason(error: Any) -> str:
    """One of pydantic's ``ValidationError.errors()`` items, as what the value must be."""
    plain = PLAIN_REASONS.get(error["type"])
    reason = plain.format(**error.get("ctx", {})) if plain else str(error["msg"])
    return reason.replace("Input should be", "must be")
