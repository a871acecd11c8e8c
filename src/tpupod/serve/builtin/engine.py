"""Continuous batching: one model, a fixed set of KV-cache slots, one thread.

Requests join and leave the running batch at step boundaries. Each turn of
the loop (the engine's own thread):

1. forgets what was cancelled;
2. admits waiting requests into free slots, as many as there are free slots:
   their prompts are packed into prefills of up to ``prefill_tokens``
   tokens (``slots.prefill``, one compiled program per length bucket) that
   write their keys and values and pick their first tokens (newcomers go
   first: a burst of arrivals joins at once rather than a few per step);
3. starts one decode call over every slot (``slots.Programs.decode``, one or
   several steps a call; compiled once; idle slots compute and are ignored),
   its input tokens the previous call's, fed back on the device;
4. reads a call's tokens and hands each running request its next ones: with
   ``overlap``, the previous call's, while the one just started runs
   (docs/serving.md); without, the call just started.

A request that stops (a stop token, ``max_tokens``) frees its slot when its
stop is read; the next newcomer reuses it. Results go out through each
request's ``sink`` as ``Tokens`` / ``Finished`` / ``Failed`` events, a turn's
tokens of a request as one ``Tokens``, called from the engine's thread (the
HTTP side hops them onto its event loop).

The engine makes no text: token ids go out, and the front end decodes them
and finds stop strings (``text.py``), cancelling a request whose stop string
it read; the engine frees its slot at its next turn.
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tpupod.errors import ModelError
from tpupod.model import QwenModel, sharding, slots
from tpupod.model.qwen import MIN_LENGTH_BUCKET
from tpupod.serve import defaults
from tpupod.serve.builtin.events import (  # the engine's vocabulary, re-exported for its callers
    EngineStopped,
    Event,
    Failed,
    Finished,
    FinishReason,
    RequestRejected,
    SamplingParams,
    Sink,
    Tokens,
    check_request,
    deliver,
)

# The default packed prefill (or a slot's length, if longer). Fewer, larger
# prefills read the weights and compute the newcomers' LM head fewer times: 32
# chat prompts (1,794 tokens, the 0.5B shape cut to 4 layers, a CPU) took 2.6 s
# of CPU time in packs of 512 tokens, 3.4 s in packs of 256, 2.9 s in packs of
# 1,024 (a pack's causal attention grows with its square).
PREFILL_TOKENS = 512


def length_buckets(largest: int) -> list[int]:
    """The packed prefill lengths: powers of two from 16 below ``largest``, then it."""
    buckets = []
    size = MIN_LENGTH_BUCKET
    while size < largest:
        buckets.append(size)
        size *= 2
    return [*buckets, largest]


class Request:
    """One request inside the engine."""

    def __init__(self, prompt: list[int], params: SamplingParams, sink: Sink):
        self.prompt = prompt
        self.params = params
        self.sink = sink
        if params.seed is not None and not 0 <= params.seed < 2**32:
            # the rows' seeds are uint32 on the device (the API passes a seed's low 32 bits)
            raise RequestRejected(f"seed {params.seed} is not in [0, 2**32)", "seed")
        self.seed = params.seed if params.seed is not None else secrets.randbits(32)
        self.generated = 0
        self.slot: int | None = None
        self.closed = False
        self.cancelled = False

    def cancel(self) -> None:
        """Stop generating for this request (its client went away); no more events."""
        self.cancelled = True


class Engine:
    """Continuous batching over ``max_batch`` slots of ``max_length`` positions."""

    def __init__(
        self,
        model: QwenModel,
        *,
        max_batch: int = 16,
        max_length: int = 1024,
        stop_tokens: Sequence[int] | None = None,
        decode_steps: int = 1,
        prefill_tokens: int | None = None,
        overlap: bool | None = None,
        smallest_span: int = defaults.SMALLEST_SPAN,
    ) -> None:
        if max_batch < 1 or max_length < 2 or decode_steps < 1 or smallest_span < 1:
            raise ModelError(
                "max_batch, decode_steps and smallest_span must be >= 1 and max_length >= 2"
            )
        self.decode_steps = decode_steps
        # read a decode call's tokens only after the next call is started (docs/serving.md);
        # on by default, a CPU included: on a quiet 2-core machine the tiny model's engine
        # made 0.76-0.88x generate's tokens/s with it against 0.61-0.62x without, and the
        # 0.5B shape (4 layers) 161 against 165 tok/s (BENCHMARKS.md, issue 24)
        self.overlap = True if overlap is None else overlap
        self.model = model
        self.programs = slots.Programs(model._graphdef, model._state, decode_steps)
        self.tokenizer = model.tokenizer
        self.max_batch = max_batch
        self.max_length = min(max_length, model.config.max_position_embeddings)
        self.stop_tokens = frozenset(model.stop_tokens if stop_tokens is None else stop_tokens)
        # one packed prefill holds up to this many tokens (at least one whole prompt)
        self.prefill_tokens = max(prefill_tokens or PREFILL_TOKENS, self.max_length)
        self.buckets = length_buckets(self.prefill_tokens)
        # the cache positions a decode call attends over: the smallest of these that holds
        # every running row's last position of the call (slots.attention_spans)
        self.spans = slots.attention_spans(self.max_length, smallest_span)
        self.span_calls: collections.Counter[int] = collections.Counter()  # decode calls a span
        # how many newcomers' logits a prefill computes: powers of two, then every slot
        self.head_counts = [
            c for c in (1 << i for i in range(max_batch.bit_length())) if c < max_batch
        ]
        self.head_counts.append(max_batch)
        mesh = model.mesh
        self._inputs = (
            None if mesh is None else NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]
        )
        self._cache_sharding = (
            None if mesh is None else sharding.cache_sharding(mesh, model.config.num_kv_heads)
        )
        self._caches = self._fresh_caches()
        s = max_batch
        self._tokens = np.zeros(s, np.int32)
        self._use_host = np.ones(s, np.int32)  # 1: the slot's next input is _tokens, not fed
        self._positions = np.zeros(s, np.int32)
        self._steps = np.zeros(s, np.int32)
        self._temperature = np.zeros(s, np.float32)
        self._top_p = np.ones(s, np.float32)
        self._seeds = np.zeros(s, np.uint32)
        self._running: dict[int, Request] = {}
        # the last decode call's tokens [decode_steps, S], left on the device to feed the next
        self._fed: Any = self._put(np.zeros((decode_steps, s), np.int32))[0]
        # decode calls started and not yet read: their tokens and the slots they ran for
        self._inflight: collections.deque[tuple[Any, list[tuple[int, Request]]]] = (
            collections.deque()
        )
        self._waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[Sink, Event]] = []
        self._swept = False  # cancels freed slots this turn
        # how a turn's events reach their sinks; by default each sink is called here
        self.dispatch: Callable[[list[tuple[Sink, Event]]], None] = deliver
        self.steps = 0  # decode steps run
        self.prefills = 0  # prefill programs run
        self.slot_history: list[tuple[int, int]] = []  # (slot, id of the request) per admission
        # the end of the last turn, or the first submit after a quiet time: a silence past
        # --stall-timeout with work owed is a hung device call (builtin.watch_progress)
        self.progressed = time.monotonic()

    # ---- state seen from outside -------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stalled(self, stall_s: float) -> bool:
        """Whether it owes requests and has finished no turn for ``stall_s`` seconds."""
        owes = self._running or self._waiting
        return bool(owes) and time.monotonic() - self.progressed > stall_s

    # ---- the device programs -----------------------------------------------

    def _fresh_caches(self) -> list[Any]:
        return slots.empty_caches(
            self.model.module, self.max_batch, self.max_length, self._cache_sharding
        )

    def _put(self, *arrays: np.ndarray) -> Any:
        if self._inputs is None:
            return tuple(jnp.asarray(a) for a in arrays)
        return jax.device_put(arrays, self._inputs)

    def _fetch(self, array: Any) -> np.ndarray:
        """A device result on the host (a hook: a replica across hosts gathers it first)."""
        return np.asarray(array)

    def _precision(self) -> contextlib.AbstractContextManager[Any]:
        return self.model._precision()

    def _prefill(self, batch: list[Request]) -> np.ndarray:
        total = sum(len(r.prompt) for r in batch)
        t = next(b for b in self.buckets if b >= total)
        ids = np.zeros(t, np.int32)
        token_slots = np.full(t, self.max_batch, np.int32)
        positions = np.zeros(t, np.int32)
        p = self.max_batch
        last = np.zeros(p, np.int32)
        temperature = np.zeros(p, np.float32)
        top_p = np.ones(p, np.float32)
        seeds = np.zeros(p, np.uint32)
        at = 0
        for i, r in enumerate(batch):
            n = len(r.prompt)
            assert r.slot is not None
            ids[at : at + n] = r.prompt
            token_slots[at : at + n] = r.slot
            positions[at : at + n] = np.arange(n)
            at += n
            last[i] = at - 1
            temperature[i] = r.params.temperature
            top_p[i] = r.params.top_p
            seeds[i] = r.seed
        ids_, slots_, positions_, last_, *sampling = self._put(
            ids, token_slots, positions, last, np.zeros(p, np.int32), temperature, top_p, seeds
        )
        self._caches, ends = self.programs.prefill(self._caches, ids_, slots_, positions_, last_)
        count = next(c for c in self.head_counts if c >= len(batch))
        logits = self.programs.head(ends, count)
        self.prefills += 1
        return self._fetch(slots.choose(logits, *sampling))[: len(batch)]

    def _span(self) -> int:
        """The span the next decode call attends over: the smallest that holds the last
        position it writes in any slot. From the slots' positions alone (a free slot's is
        0), so a replica's followers, given the same positions, choose the same program."""
        last = int(self._positions.max()) + self.decode_steps
        return next((s for s in self.spans if s >= last), self.spans[-1])

    def _dispatch(self, span: int | None = None) -> Any:
        """Start the next ``decode_steps`` tokens of every slot: [decode_steps, S] on the
        device (JAX returns at once; the host reads them with ``_fetch``). Each running
        slot's position and step move on by ``decode_steps`` here, so the call after it
        can start before these tokens are read; its input tokens stay on the device.
        ``span``: the positions attended over (None: ``_span``; warmup names each)."""
        span = self._span() if span is None else span
        ints = np.stack(
            [self._tokens, self._use_host, self._positions, self._steps, self._seeds.view(np.int32)]
        )
        floats = np.stack([self._temperature, self._top_p])
        ints_, floats_ = self._put(ints, floats)  # fresh arrays: the device may read them late
        self._caches, self._fed = self.programs.decode(
            self._caches, self._fed, ints_, floats_, span
        )
        self.span_calls[span] += 1
        for slot in self._running:
            self._positions[slot] += self.decode_steps
            self._steps[slot] += self.decode_steps
        self._use_host[:] = 0
        self.steps += self.decode_steps
        return self._fed

    def warmup(self) -> None:
        """Compile everything a request may run: the prefill per length bucket, the LM
        head per newcomer count, sampling, and the decode call per attention span."""
        with self._precision():
            for t in self.buckets:
                args = self._put(
                    np.zeros(t, np.int32),
                    np.full(t, self.max_batch, np.int32),  # every token dropped
                    np.zeros(t, np.int32),
                    np.zeros(self.max_batch, np.int32),
                )
                self._caches, ends = self.programs.prefill(self._caches, *args)
            for count in self.head_counts:
                logits = self.programs.head(ends, count)
            p = self.max_batch
            zeros = np.zeros(p, np.int32)
            seeds = np.zeros(p, np.uint32)  # the dtypes _prefill passes: no compile later
            sampling = self._put(zeros, np.ones(p, np.float32), np.ones(p, np.float32), seeds)
            slots.choose(logits, *sampling).block_until_ready()
            for span in self.spans:
                self._fetch(self._dispatch(span))
            self.span_calls.clear()
            self._use_host[:] = 1

    # ---- requests ----------------------------------------------------------

    def check(self, prompt: Sequence[int], max_tokens: int | None) -> int:
        """The ``max_tokens`` this prompt gets (the room left when not given), or a refusal."""
        return check_request(prompt, max_tokens, self.max_length)

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Sink) -> Request:
        """Queue a request; its events go to ``sink`` (from the engine's thread)."""
        self.check(prompt, params.max_tokens)
        request = Request(list(map(int, prompt)), params, sink)
        with self._wake:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if not (self._running or self._waiting or self._inflight):
                self.progressed = time.monotonic()  # it owed nothing: silence counts from here
            self._waiting.append(request)
            self._wake.notify()
        return request

    def start(self, name: str = "engine") -> None:
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def shutdown(self, message: str = "the server is shutting down", timeout: float = 10) -> None:
        """Fail every request in flight or waiting (at once, from this thread), then stop."""
        with self._wake:
            self._stopping = True
            pending = [*self._running.values(), *self._waiting]
            self._waiting.clear()
            self._wake.notify()
        for request in pending:
            self._emit(request, Failed(message), close=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- the loop ----------------------------------------------------------

    def _emit(self, request: Request, event: Event, close: bool = False) -> None:
        """Send an event: gathered for the end of the turn on the engine's thread,
        at once from any other (``shutdown``). A cancelled request gets none."""
        if request.closed or request.cancelled:
            return
        if close:
            request.closed = True
        if threading.current_thread() is self._thread:
            self._outbox.append((request.sink, event))
        else:
            self.dispatch([(request.sink, event)])

    def _flush(self) -> None:
        """Send the turn's events, each request's tokens of the turn as one ``Tokens``
        (none, when only cancels freed slots: a linked front end hears the new counts)."""
        if not self._outbox and not self._swept:
            return
        self._swept = False
        merged: dict[int, tuple[Sink, list[Event]]] = {}
        for sink, event in self._outbox:
            _, events = merged.setdefault(id(sink), (sink, []))
            if isinstance(event, Tokens) and events and isinstance(events[-1], Tokens):
                events[-1] = Tokens(events[-1].ids + event.ids)
            else:
                events.append(event)
        self._outbox = []
        self.dispatch([(sink, event) for sink, events in merged.values() for event in events])

    def _loop(self) -> None:
        with self._precision():
            while self._turn():
                self._flush()
                self.progressed = time.monotonic()

    def _turn(self) -> bool:
        """One turn: admit every newcomer a slot is free for (packed prefills), then
        run one decode call over all slots. False once stopping."""
        with self._wake:
            while not (self._stopping or self._running or self._waiting or self._inflight):
                self._wake.wait()
            if self._stopping:
                return False
            self._sweep()
        try:
            while batch := self._admit():
                first = self._prefill(batch)
                for request, token in zip(batch, first.tolist(), strict=True):
                    self._accept(request, token)
                self._going_on()
            if self._running:
                self._inflight.append((self._dispatch(), list(self._running.items())))
            # with overlap, the call just started runs on the device while the host
            # reads and hands out the one before it (found one call late: docs/serving.md)
            keep = 1 if self.overlap and self._running else 0
            while len(self._inflight) > keep:
                self._collect(*self._inflight.popleft())
        except Exception as exc:  # a device failure: fail what runs, start clean
            reason = self._failure_reason(exc)
            with self._wake:
                failed = list(self._running.values())
                for slot in list(self._running):
                    self._free(slot)
            for request in failed:
                self._emit(request, Failed(reason), close=True)
            self._inflight.clear()
            self._caches = self._fresh_caches()
        return True

    def _going_on(self) -> None:
        """A turn goes on: after each packed prefill, as a turn that admits many long
        prompts can outlast ``--stall-timeout``: the stamp the in-process watch reads, and
        an empty frame (the counts) for a linked front end's watch."""
        self.progressed = time.monotonic()
        self.dispatch([])

    def _collect(self, out: Any, ran: list[tuple[int, Request]]) -> None:
        """Read a decode call's tokens and hand them to the requests it ran for: a request
        that finished (or was cancelled) since the call started is no longer running in
        its slot, and the tokens its slot computed after its end are dropped unseen."""
        for row in self._fetch(out).tolist():
            for slot, request in ran:
                if self._running.get(slot) is request:  # not finished meanwhile
                    self._accept(request, row[slot])

    def _failure_reason(self, exc: Exception) -> str:
        """What the requests a failed step held are told."""
        return f"generation failed: {exc}"

    def _admit(self) -> list[Request]:
        with self._wake:
            return [] if self._stopping else self._take_newcomers()

    def _sweep(self) -> None:
        """Forget cancelled requests (the lock held): their slots are free again."""
        for slot, request in list(self._running.items()):
            if request.cancelled or request.closed:
                self._free(slot)
                self._swept = True
        while self._waiting and (self._waiting[0].cancelled or self._waiting[0].closed):
            self._waiting.popleft()
            self._swept = True

    def _take_newcomers(self) -> list[Request]:
        """Waiting requests for the free slots, as many as one packed prefill holds."""
        free = [s for s in range(self.max_batch) if s not in self._running]
        batch: list[Request] = []
        total = 0
        while self._waiting and len(batch) < len(free):
            n = len(self._waiting[0].prompt)
            if batch and total + n > self.buckets[-1]:
                break
            request = self._waiting.popleft()
            if request.cancelled or request.closed:
                continue
            request.slot = free[len(batch)]
            self._running[request.slot] = request
            self.slot_history.append((request.slot, id(request)))
            batch.append(request)
            total += n
        return batch

    def _accept(self, request: Request, token: int) -> None:
        """A request's next token: out to its sink, and either finish or feed it back."""
        slot = request.slot
        assert slot is not None
        request.generated += 1
        self._emit(request, Tokens((token,)))
        reason: FinishReason | None = None
        if token in self.stop_tokens:
            reason = "stop"
        elif request.generated >= request.params.max_tokens:
            reason = "length"
        if reason is not None:
            with self._wake:
                self._free(slot)
            self._emit(
                request, Finished(reason, len(request.prompt), request.generated), close=True
            )
            return
        if request.generated == 1:  # its first token, from its prefill: decoding starts
            self._tokens[slot] = token
            self._use_host[slot] = 1
            self._positions[slot] = len(request.prompt)
            self._steps[slot] = 1
            self._temperature[slot] = request.params.temperature
            self._top_p[slot] = request.params.top_p
            self._seeds[slot] = request.seed

    def _free(self, slot: int) -> None:
        """Give a slot back (the lock held): its row computes idle until reused."""
        self._running.pop(slot, None)
        self._tokens[slot] = 0
        self._use_host[slot] = 1
        self._positions[slot] = 0
        self._steps[slot] = 0
        self._temperature[slot] = 0
        self._top_p[slot] = 1
        self._seeds[slot] = 0
