"""What the builtin server's front end and its engine say to each other: a request's
sampling parameters, the events of its answer (token ids from the engine, text
after the front end's ``text.py``), the refusals, and the one rule on a
prompt's length. Nothing here imports JAX, so the front-end process (``split``) starts
in a fraction of the engine's import time and a restarted front end serves sooner.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

from tpupod.errors import ModelError

FinishReason = Literal["stop", "length"]


class RequestRejected(ModelError):
    """A request the engine cannot take: too long a prompt, too many tokens asked."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineStopped(ModelError):
    """The engine is shutting down (or has) and takes no more requests."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Tokens:
    """The answer's next token ids, as the engine makes them (``text.py`` makes text)."""

    ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Delta:
    """New text of the answer, made from ``Tokens`` by the front end (``text.py``)."""

    text: str


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str


Event = Tokens | Delta | Finished | Failed
Sink = Callable[[Event], None]


def deliver(events: list[tuple[Sink, Event]]) -> None:
    """Call each sink with its event; a sink's failure must not take the engine down."""
    for sink, event in events:
        with contextlib.suppress(Exception):
            sink(event)


def stalled_message(stall_s: float, in_flight: int) -> str:
    """What the requests of an engine that stopped making progress are told (the split
    server's front end and a ``--no-split`` server say the same)."""
    return (
        f"the engine made no progress for {stall_s:g}s with {in_flight} "
        f"request{'s' if in_flight != 1 else ''} in flight "
        "(stalled); it is being restarted: retry shortly"
    )


def check_request(prompt: Sequence[int], max_tokens: int | None, max_length: int) -> int:
    """The ``max_tokens`` this prompt gets (the room left when not given), or a refusal."""
    n = len(prompt)
    if n == 0:
        raise RequestRejected("the prompt is empty", "prompt")
    room = max_length - n
    if room < 1:
        raise RequestRejected(
            f"the prompt has {n} tokens; this server holds at most "
            f"{max_length} per request (prompt and answer), so it takes prompts "
            f"of up to {max_length - 1} tokens",
            "messages",
            "context_length_exceeded",
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise RequestRejected(
            f"max_tokens is {max_tokens}, but the prompt has {n} tokens and this server "
            f"holds at most {max_length} per request: ask for at most {room}",
            "max_tokens",
            "context_length_exceeded",
        )
    return max_tokens
