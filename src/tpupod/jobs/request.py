"""A job request from what a person gives: a ``FILE.py`` (code), a ``FILE.json`` (seed 003's
job document) or a command line, with the submit options laid over it. The fast path
(``cli/flow/submit.py``) reads plain submissions itself; this is the reference it agrees with."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from tpupod.base.envargs import parse_pairs
from tpupod.base.jsontext import lone_surrogate
from tpupod.errors import UsageError
from tpupod.jobs.code import syntax_problem
from tpupod.jobs.models import JobRequest
from tpupod.jobs.rows import attempts_for
from tpupod.transport.base import join_command

JSON_HINT = 'a job document: {"code": "...", "timeout": 300} or {"command": "..."}'
UTF8_HINT = "write it as UTF-8 text (bash's $'\\xNN' is a raw byte; $'\\uNNNN' a character)"


def read_request(args: list[str], *, dashed: bool) -> JobRequest:
    """``FILE.py``, ``FILE.json`` or a command; ``dashed``: the arguments came after ``--``,
    so they are a command whatever they look like."""
    if not args:
        raise UsageError("nothing to submit", hint="tpupod jobs submit FILE.py | -- CMD...")
    if dashed or len(args) > 1 or not args[0].endswith((".py", ".json")):
        return JobRequest(command=join_command(args))  # as exec and run read it
    path = Path(args[0])
    if not path.is_file():
        raise UsageError(f"{path}: no such file", hint="give a .py or .json file, or -- CMD...")
    if path.suffix == ".py":
        source = path.read_text()
        if problem := syntax_problem(source, str(path)):
            raise UsageError(problem, hint=f"fix the code: 'python -m py_compile {path}'")
        return JobRequest(code=source)
    try:
        return JobRequest.model_validate(json.loads(path.read_text()))
    except (ValueError, ValidationError) as exc:
        raise UsageError(f"{path}: {first_problem(exc)}", hint=JSON_HINT) from exc


def first_problem(exc: Exception) -> str:
    """The first thing pydantic (or the JSON reader) found wrong, in our words."""
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        cause = err.get("ctx", {}).get("error")  # our own validator's words, unprefixed
        said = str(cause) if isinstance(cause, ValueError) else str(err["msg"])
        return f"{where}: {said}" if where else said
    return f"not JSON: {exc}"


def labels(values: list[str] | None) -> dict[str, str]:
    """``--label NAME=VALUE`` options as a dict."""
    return parse_pairs(values, option="--label", example="team=ml")


def positive_seconds(option: str, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise UsageError(f"{option} {value:g}: must be more than 0 seconds", hint=f"{option} 300")
    return value


def build_request(
    args: list[str],
    *,
    dashed: bool = False,
    name: str = "",
    label: list[str] | None = None,
    priority: int = 0,
    timeout: float | None = None,
    max_attempts: int | None = None,
    retries: int = 0,
    pod: str | None = None,
) -> JobRequest:
    """``read_request``'s request with the submit options given laid over the file's own."""
    if (problem := lone_surrogate([args, name, label])) is not None:
        raise UsageError(f"{problem}: no database can store it", hint=UTF8_HINT)
    try:
        request = read_request(args, dashed=dashed)
        changes = {"name": name or request.name, "priority": priority or request.priority}
        extra: dict[str, object] = {"timeout": positive_seconds("--timeout", timeout), "pod": pod}
        extra["labels"] = labels(label) or None
        changes.update({k: v for k, v in extra.items() if v is not None})
        if retries < 0:
            raise UsageError(f"--retries {retries}: must be 0 or more", hint="--retries 2")
        if retries:
            changes["retries"] = retries
        if max_attempts is not None or retries >= request.max_attempts:
            changes["max_attempts"] = max_attempts or attempts_for(retries)
        return JobRequest.model_validate({**request.model_dump(), **changes})
    except ValidationError as exc:
        raise UsageError(first_problem(exc), hint=JSON_HINT) from exc
