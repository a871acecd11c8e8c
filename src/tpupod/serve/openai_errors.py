"""OpenAI's error shape, shared by the builtin server and the router.

Every refusal, even of a path or method that does not exist, answers::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

so an OpenAI client shows the message instead of failing to parse
FastAPI's ``{"detail": ...}`` or aiohttp's plain ``404: Not Found``.
"""

from __future__ import annotations

from typing import Any


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def path_error(status: int, method: str, path: str, detail: str) -> dict[str, Any]:
    """The body of a 404 or 405 (or another HTTP error a framework raised)."""
    if status == 404:
        return error_body(f"no such endpoint: {method} {path}", code="not_found")
    if status == 405:
        return error_body(f"{method} is not allowed on {path}", code="method_not_allowed")
    return error_body(detail)
