"""The text side of an answer: token ids in, text and stop strings out (the front end's).

The engine speaks token ids only (``Tokens``, then ``Finished`` at a stop
token or ``max_tokens``, or ``Failed``). :func:`submit` puts a
:class:`TextSink` between an engine and a caller's sink: it decodes the ids
incrementally, finds the request's stop strings, and hands the caller
``Delta`` text and the ``Finished``/``Failed`` end. Both servers run it on
their event loop: the split server in its front-end process (the engine
process never decodes), ``--no-split`` and a replica's leader on the loop
beside their engine's thread; one code path.

A stop string is found one frame late: the engine has already computed a few
more tokens of that request by the time the front end reads the one that
completed it. Those tokens are dropped unseen (no text past the stop goes
out), the request is cancelled in the engine (its slot frees at the engine's
next turn), and the answer's ``completion_tokens`` counts the tokens up to
the one that completed the stop string, as an engine that stopped there
would have.

Text is decoded incrementally: each token decodes only a short window (the
tokens since the last whole character, as vLLM and TGI do), a trailing
partial UTF-8 character is held back, and a tail that could still grow into
a stop string waits until it cannot; at the end the whole answer is decoded
once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tpupod.serve.builtin.events import Delta, Event, Finished, SamplingParams, Sink, Tokens


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class TokenEngine(Protocol):
    """What :func:`submit` needs of an engine (in process, or behind a link)."""

    tokenizer: Any

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Sink) -> Cancellable: ...


class TextStream:
    """The answer's text as tokens arrive: incremental decoding and stop strings.

    Each token decodes only a short window (the tokens since the last whole
    character), so a long answer costs no more per token than a short one.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.longest_stop = max(map(len, self.stop), default=0)
        self.tokens: list[int] = []
        self.prefix = 0  # the window: tokens[prefix:read] are decoded already ...
        self.read = 0  # ... and tokens[read:] are new
        self.sent = 0  # characters of the text already handed out
        self.text = ""  # the text of the tokens up to the last whole character

    def _decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f"<{t}>" for t in tokens)
        return str(self.tokenizer.decode(tokens))

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token: the text that may go out now, and whether a stop string ended it."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return "", False  # no new whole character yet
        grown = len(self.text)
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)
        if self.stop:
            start = max(grown - self.longest_stop + 1, 0)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self._take(len(self.text)), True
        safe = len(self.text)
        hold = 0
        for s in self.stop:  # a tail that may still grow into a stop string waits
            for n in range(min(len(s) - 1, safe), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return self._take(max(safe - hold, self.sent)), False

    def flush(self) -> str:
        """Everything not yet handed out (the answer ended without a stop string)."""
        self.text = self._decode(self.tokens)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


class TextSink:
    """An engine's sink that turns one request's token events into text events for
    ``sink``; cancels the request in the engine once a stop string ends the answer."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_tokens: int, sink: Sink):
        self.stream = TextStream(tokenizer, params.stop)
        self.prompt_tokens = prompt_tokens
        self.sink = sink
        self.request: Cancellable | None = None
        self.ended = False

    def attach(self, request: Cancellable) -> None:
        """The engine's handle of the request (a stop found before it came cancels now)."""
        self.request = request
        if self.ended:
            request.cancel()

    def cancel(self) -> None:
        """The caller went away: stop the request in the engine."""
        self.ended = True
        if self.request is not None:
            self.request.cancel()

    def __call__(self, event: Event) -> None:
        if self.ended:
            return  # tokens computed after a stop string, or after the caller left
        if isinstance(event, Tokens):
            self._tokens(event.ids)
            return
        if isinstance(event, Finished):
            tail = self.stream.flush()
            if tail:
                self.sink(Delta(tail))
        self.ended = True
        self.sink(event)

    def _tokens(self, ids: Sequence[int]) -> None:
        text = []
        for token in ids:
            delta, stopped = self.stream.push(token)
            text.append(delta)
            if stopped:
                self.cancel()
                if out := "".join(text):
                    self.sink(Delta(out))
                count = len(self.stream.tokens)
                self.sink(Finished("stop", self.prompt_tokens, count))
                return
        if out := "".join(text):
            self.sink(Delta(out))


def submit(
    engine: TokenEngine, prompt: Sequence[int], params: SamplingParams, sink: Sink
) -> TextSink:
    """Submit to ``engine``; ``sink`` gets the answer as text (``Delta``, then ``Finished``
    or ``Failed``). Returns what cancels the request (``.cancel()``)."""
    text = TextSink(engine.tokenizer, params, len(prompt), sink)
    text.attach(engine.submit(prompt, params, text))
    return text
