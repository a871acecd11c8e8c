"""The engine with and without overlap: greedy answers token for token ``generate``'s.

With overlap the engine starts decode call k+1 before it reads call k's tokens,
so a request that stops is found one call late and a newcomer joins while a
call is in flight (docs/serving.md). Each case runs on three engines over two
slots (so slots are reused after early stops): overlap on and off, and overlap
on with three decode steps a call. Their decode calls attend over spans of 8, 16
and 24 positions (the last the slots' whole length, not a power of two), so every
answer crosses from one span's program to the next, and with three steps a call
the last call's steps run past the slots' end (dropped).
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import IN_CI

if importlib.util.find_spec("flax") is None:
    if IN_CI:
        raise RuntimeError("prerequisite missing in CI: flax (pip install -e '.[test]')")
    pytest.skip("needs the model extra", allow_module_level=True)

from tpupod.model import QwenModel, load_model
from tpupod.serve.builtin.engine import Engine
from tpupod.serve.builtin.events import Delta, Event, Finished, SamplingParams, Tokens
from tpupod.serve.builtin.text import TextStream, submit

# The module's first test also pays for its shared server or engines (loads and
# compiles: ~10 s on a quiet machine, 94-187 s at load 13-19), past the 60 s default.
pytestmark = [pytest.mark.local, pytest.mark.timeout(300)]

FIXTURE = Path(__file__).parent / "fixtures" / "qwen2-tiny"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [50, 51, 52, 53], [100, 7, 300, 12]]
# the fixture's answers to PROMPTS[1] and [2] hold these, and no other answer does
STOP_STRING, STOP_TOKEN = "Who", 169
NEW = 16
WAIT_S = 120  # generous: the machine may be busy


class Collect:
    def __init__(self, then: Callable[[Event], None] | None = None) -> None:
        self.text = ""
        self.deltas = 0
        self.end: Event | None = None
        self.done = threading.Event()
        self.then = then

    def __call__(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.text += event.text
            self.deltas += 1
        else:
            self.end = event
            self.done.set()
        if self.then is not None:
            self.then(event)

    def finished(self) -> Finished:
        assert self.done.wait(WAIT_S), "no answer in time"
        assert isinstance(self.end, Finished), self.end
        return self.end


@pytest.fixture(scope="module")
def model() -> QwenModel:
    return load_model(FIXTURE)


@pytest.fixture(scope="module")
def reference(model: QwenModel) -> list[list[int]]:
    """Greedy tokens of ``generate`` for every prompt, one batch."""
    return [list(t) for t in model.generate(PROMPTS, max_new_tokens=NEW).tokens]


@pytest.fixture(scope="module", params=["overlap", "no-overlap", "overlap-3-steps"])
def engine(request: pytest.FixtureRequest, model: QwenModel) -> Iterator[Engine]:
    overlap = request.param != "no-overlap"
    steps = 3 if request.param.endswith("3-steps") else 1
    eng = Engine(  # spans of 8, 16 and 24 positions: the answers cross them
        model, max_batch=2, max_length=24, decode_steps=steps, overlap=overlap, smallest_span=8
    )
    eng.warmup()
    eng.start()
    yield eng
    eng.shutdown()


def text(model: QwenModel, tokens: list[int], stop: tuple[str, ...] = ()) -> str:
    """What the server streams for these tokens (the random model makes stray bytes, which
    its incremental decoding renders as it goes): ``TextStream`` fed them, until a stop."""
    stream = TextStream(model.tokenizer, stop)
    out = ""
    for token in tokens:
        delta, stopped = stream.push(token)
        out += delta
        if stopped:
            return out
    return out + stream.flush()


def test_early_stops_while_others_continue_equal_generate(
    engine: Engine, model: QwenModel, reference: list[list[int]]
) -> None:
    """Four requests through two slots: one stops at max_tokens, one at a stop string,
    one at a stop token; each answer is generate's, cut where it stopped."""
    stop, eos = STOP_STRING, STOP_TOKEN
    eos_at = reference[2].index(eos)
    assert eos_at >= 2 and all(eos not in r for j, r in enumerate(reference) if j != 2)
    assert stop in text(model, reference[1])
    assert all(stop not in text(model, r) for j, r in enumerate(reference) if j != 1)
    engine.stop_tokens = frozenset({*model.stop_tokens, eos})
    try:
        sinks = [Collect() for _ in PROMPTS]
        submit(engine, PROMPTS[0], SamplingParams(max_tokens=3), sinks[0])
        submit(engine, PROMPTS[1], SamplingParams(max_tokens=NEW, stop=(stop,)), sinks[1])
        submit(engine, PROMPTS[2], SamplingParams(max_tokens=NEW), sinks[2])
        submit(engine, PROMPTS[3], SamplingParams(max_tokens=NEW), sinks[3])
        ends = [s.finished() for s in sinks]
    finally:
        engine.stop_tokens = frozenset(model.stop_tokens)
    assert sinks[0].text == text(model, reference[0][:3])
    assert (ends[0].reason, ends[0].completion_tokens) == ("length", 3)
    assert sinks[1].text == text(model, reference[1], (stop,)) and ends[1].reason == "stop"
    assert ends[1].completion_tokens < NEW
    assert sinks[2].text == text(model, reference[2][: eos_at + 1])
    assert (ends[2].reason, ends[2].completion_tokens) == ("stop", eos_at + 1)
    assert sinks[3].text == text(model, reference[3])
    assert (ends[3].reason, ends[3].completion_tokens) == ("length", NEW)
    assert engine.running == 0 and engine.waiting == 0


def test_arrivals_during_a_step_equal_generate(
    engine: Engine, model: QwenModel, reference: list[list[int]]
) -> None:
    """Newcomers submitted from the first request's sink (the engine's thread, right
    after a call was started: with overlap, one is in flight) join the batch."""
    late = [Collect(), Collect()]

    def arrive(event: Event) -> None:
        if isinstance(event, Delta) and first.deltas in {2, 4}:
            i = first.deltas // 2 - 1
            submit(engine, PROMPTS[1 + i], SamplingParams(max_tokens=NEW), late[i])

    first = Collect(arrive)
    steps = engine.steps
    submit(engine, PROMPTS[0], SamplingParams(max_tokens=NEW), first)
    first.finished()
    late[0].finished()
    late[1].finished()
    assert first.text == text(model, reference[0])
    assert [s.text for s in late] == [text(model, r) for r in reference[1:3]]
    # the newcomers ran beside the first: one after the other took 3 x 15 steps
    assert engine.steps - steps <= 2.5 * NEW


def test_the_engine_sends_token_ids_and_no_text(engine: Engine, reference: list[list[int]]) -> None:
    """The engine's events are token ids (its front end makes the text, ``text.py``), a
    turn's tokens of a request as one ``Tokens``."""
    seen: list[Event] = []
    done = threading.Event()

    def sink(event: Event) -> None:
        seen.append(event)
        if not isinstance(event, Tokens):
            done.set()

    engine.submit(PROMPTS[3], SamplingParams(max_tokens=NEW), sink)
    assert done.wait(WAIT_S)
    assert [t for e in seen if isinstance(e, Tokens) for t in e.ids] == reference[3]
    assert seen[-1] == Finished("length", len(PROMPTS[3]), NEW)
    assert all(isinstance(e, Tokens) for e in seen[:-1])


def test_each_call_attends_over_the_smallest_span_holding_its_rows(
    engine: Engine, reference: list[list[int]]
) -> None:
    """A 7-token prompt and 16 new tokens: its calls write positions 7 to 22 (and one call
    more with overlap), so they run the 16- and 24-position programs (and the 8 one, one
    step a call); the answer is generate's across the changes of span."""
    model: QwenModel = engine.model
    sink = Collect()
    engine.span_calls.clear()
    submit(engine, PROMPTS[0], SamplingParams(max_tokens=NEW), sink)
    assert sink.finished().completion_tokens == NEW
    assert sink.text == text(model, reference[0])
    assert engine.spans == [8, 16, 24]
    assert {16, 24} <= set(engine.span_calls) <= {8, 16, 24}, engine.span_calls


def test_nothing_compiles_after_warmup(model: QwenModel) -> None:
    """Warmup compiles every program a request runs, with the dtypes requests use: a
    request (a prefill, its sampling, its decode calls) compiles nothing. The
    sampling program was warmed with int32 seeds where requests pass uint32 ones, so the
    first request compiled it again (0.35 s on the tiny model). Three slots: shapes no
    other engine of this process has compiled (``choose`` is shared by them all)."""
    from tpupod.model import slots

    engine = Engine(model, max_batch=3, max_length=64)  # one span: warms up sooner
    engine.warmup()
    programs = engine.programs

    def compiled() -> list[int]:
        jitted = [slots.choose, programs._prefill, programs._head, *programs._decodes.values()]
        return [fn._cache_size() for fn in jitted]

    before = compiled()
    engine.start()
    try:
        sinks = [Collect() for _ in PROMPTS]
        params = SamplingParams(max_tokens=NEW, temperature=0.7, top_p=0.9, seed=3)
        for prompt, sink in zip(PROMPTS, sinks, strict=True):
            submit(engine, prompt, params, sink)
        for sink in sinks:
            sink.finished()
    finally:
        engine.shutdown()
    assert compiled() == before
