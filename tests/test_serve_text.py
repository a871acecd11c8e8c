"""The front end's text side (``serve/builtin/text.py``) on the real tokenizer: token ids in the
frames the engine sends, text and stop strings out.

The engine sends a turn's tokens of a request as one ``Tokens`` event and goes on
computing until the front end's cancel reaches it; these tests feed such frames (and
the tokens past a stop) and check what a client would see.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import IN_CI

if importlib.util.find_spec("tokenizers") is None:
    if IN_CI:
        raise RuntimeError("prerequisite missing in CI: tokenizers (pip install -e '.[test]')")
    pytest.skip("needs the model extra", allow_module_level=True)

from tpupod.model.tokenizer import Tokenizer
from tpupod.serve.builtin.events import Delta, Event, Failed, Finished, SamplingParams, Sink, Tokens
from tpupod.serve.builtin.text import TextSink, submit

pytestmark = pytest.mark.local

TOKENIZER = Tokenizer(Path(__file__).parent / "fixtures" / "qwen2-tiny")
TEXT = "你是谁? héllo wörld"  # seed 000's prompt: characters the tiny tokenizer splits up


class Request:
    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> None:
        self.cancels += 1


class FakeEngine:
    """Records the sink the text side gave it; the test plays the engine's frames."""

    tokenizer = TOKENIZER

    def __init__(self) -> None:
        self.sink: Sink | None = None
        self.request = Request()

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Sink) -> Request:
        self.sink = sink
        return self.request


def play(frames: list[list[int]], stop: tuple[str, ...], end: Event) -> tuple[list[Event], int]:
    """The client's events for these engine frames (then ``end``), and the engine's cancels."""
    seen: list[Event] = []
    engine = FakeEngine()
    submit(engine, [1, 2, 3], SamplingParams(max_tokens=99, stop=stop), seen.append)
    assert engine.sink is not None
    for frame in frames:
        engine.sink(Tokens(tuple(frame)))
    engine.sink(end)
    return seen, engine.request.cancels


def frames_of(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def first_token_with(ids: list[int], stop: str) -> int:
    """How many tokens an answer has once ``stop`` is in its text (the usage it reports)."""
    return next(k for k in range(1, len(ids) + 1) if stop in TOKENIZER.decode(ids[:k]))


@pytest.mark.parametrize("size", [1, 2, 3, 64])
@pytest.mark.parametrize("stop", ["谁?", "é", "ö", "lo w"])
def test_a_stop_string_spanning_tokens_is_cut_and_cancels_the_request(size: int, stop: str) -> None:
    ids = TOKENIZER.encode(TEXT)
    k = first_token_with(ids, stop)
    assert stop not in TOKENIZER.decode(ids[k - 1 : k])  # it spans tokens: not in the last alone
    # the engine computed past the stop (frames in flight) and then reached max_tokens
    seen, cancels = play(frames_of(ids, size), (stop, "never"), Finished("length", 3, len(ids)))
    deltas = [e.text for e in seen if isinstance(e, Delta)]
    assert all(d and "\ufffd" not in d for d in deltas)  # never half a character
    assert "".join(deltas) == TEXT[: TEXT.index(stop)]
    assert seen[-1] == Finished("stop", 3, k)  # usage: the tokens up to the stop, not past it
    assert sum(not isinstance(e, Delta) for e in seen) == 1
    assert cancels == 1


@pytest.mark.parametrize("size", [1, 3])
def test_without_a_stop_the_engine_s_end_follows_the_whole_text(size: int) -> None:
    ids = TOKENIZER.encode(TEXT)
    assert len(ids) > len(TEXT)  # some characters take several tokens
    end = Finished("length", 3, len(ids))
    seen, cancels = play(frames_of(ids, size), ("wörlds",), end)
    deltas = [e.text for e in seen if isinstance(e, Delta)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT and seen[-1] == end and cancels == 0


def test_a_failure_passes_through_and_nothing_follows_it() -> None:
    ids = TOKENIZER.encode("hello world")
    seen, _ = play([ids], (), Failed("the engine went away"))
    assert seen == [Delta("hello world"), Failed("the engine went away")]
    sink = TextSink(TOKENIZER, SamplingParams(max_tokens=9), 3, seen.append)
    sink.cancel()  # the client left: the engine's later events are dropped
    sink(Tokens(tuple(ids)))
    assert seen[-1] == Failed("the engine went away")


def test_a_stream_behind_the_engine_gets_the_texts_waiting_as_one_delta() -> None:
    """Turns' texts that arrived while the stream was busy go out as one chunk."""
    import asyncio

    from tpupod.serve.builtin.openai_api import Metrics, _Call

    class Served:
        running = waiting = max_batch = 0

    async def main() -> list[Event]:
        call = _Call(Served(), Metrics(Served()), "chat")  # type: ignore[arg-type]
        for text in ("a", "b", "c"):
            call.sink(Delta(text))
        call.sink(Finished("length", 3, 3))
        return [event async for event in call.events()]

    assert asyncio.run(main()) == [Delta("abc"), Finished("length", 3, 3)]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("usage", [True, False])
def test_a_text_chunk_from_its_template_is_the_chunk_rendered_whole(
    chat: bool, usage: bool
) -> None:
    """The streamed text chunk is made from one rendering per request (the text put in its
    place): byte for byte the whole chunk's JSON, for any text and any model name."""
    import json

    from tpupod.serve.builtin.openai_api import _Shape, _sse

    shape = _Shape("chatcmpl-0f", 'a "model"\x00 named é', chat)
    frame = shape.text_frames(usage)
    for text in [TEXT, "x", 'quotes " and \\ and \n', "\x00text\x00", "😀", " "]:
        assert frame(text) == _sse(shape.chunk(text, None, usage))
        chunk = json.loads(frame(text).decode()[len("data: ") :])
        assert (
            chunk["choices"][0]["delta"]["content"] if chat else chunk["choices"][0]["text"]
        ) == text
