"""The engine of a multi-host replica: every device call mirrored on the followers.

``LockstepEngine`` is the builtin server's :class:`Engine` with a few hooks:

- its inputs go onto the devices with ``sharding.place`` (each process fills
  its own shards: ``jax.device_put`` cannot reach other processes' devices);
- on the leader, once a ``channel`` is attached (after warmup, which every
  member runs alike), each step's work is broadcast before it runs: a
  ``prefill`` carries the newcomers' prompt tokens, slots and sampling
  parameters, a ``decode`` the slots' host tokens (a newcomer's first; the
  others are fed back on the device, as on the leader), positions and sampling
  state, a
  ``reset`` asks for fresh caches (after a failed call);
- :func:`follow_steps` is a follower's whole life: rebuild each step's work
  and run the same ``Engine`` method on it, so the same jitted programs run in
  the same order as on the leader, whatever those methods run inside.

The scheduler, the text and the requests' sinks exist only on the leader.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from tpupod.model import sharding
from tpupod.serve.builtin.engine import Engine, Request
from tpupod.serve.builtin.events import SamplingParams
from tpupod.serve.replica.lockstep import Follower, Leader

# How long a failed step waits for the side channel to report a lost member.
LOST_WAIT_S = 2.0


def _nothing(event: object) -> None:
    """A follower's requests have no client."""


class LockstepEngine(Engine):
    channel: Leader | None = None  # set on the leader once warm

    def _put(self, *arrays: np.ndarray) -> Any:
        if self._inputs is None:
            return super()._put(*arrays)
        return tuple(sharding.place(a, self._inputs) for a in arrays)

    def _fetch(self, array: Any) -> np.ndarray:
        """With a data axis across processes a step's tokens are spread over them: every
        member gathers them (a collective; the followers run the same methods)."""
        if array.is_fully_addressable or array.is_fully_replicated:
            return np.asarray(array)
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    # -- the leader's side: broadcast, then run ------------------------------------------
    def _prefill(self, batch: list[Request]) -> np.ndarray:
        if self.channel is not None:
            self.channel.broadcast("prefill", prefill_work(batch))
        return super()._prefill(batch)

    def _dispatch(self, span: int | None = None) -> Any:
        if self.channel is not None:  # the followers choose the span from the same positions
            self.channel.broadcast("decode", self._decode_state())
        return super()._dispatch(span)

    def warmup(self) -> None:
        """Every member warms up alike; then, where reading a call's tokens is a
        collective (a data axis across processes), the leader reads each call's tokens
        right after starting it, in the order its followers do: no overlap."""
        super().warmup()
        if not (self._fed.is_fully_addressable or self._fed.is_fully_replicated):
            self.overlap = False

    def _fresh_caches(self) -> list[Any]:
        if self.channel is not None:
            if self.channel.failed:  # the replica is going down: nothing more runs
                return list(self._caches)
            self.channel.broadcast("reset", ())
        return super()._fresh_caches()

    def _failure_reason(self, exc: Exception) -> str:
        """A collective fails at once when a member dies (gloo: "Connection closed by
        peer"), often a moment before the side channel says who: wait for it, so the
        requests hear that the replica lost a member (the failure handler tells them, with
        the member's name), not gloo's words."""
        if self.channel is not None and self.channel.wait_failed(LOST_WAIT_S):
            return "the replica lost a member"
        return super()._failure_reason(exc)

    def _decode_state(self) -> list[np.ndarray]:
        return [
            self._tokens,
            self._use_host,
            self._positions,
            self._steps,
            self._temperature,
            self._top_p,
            self._seeds,
        ]

    # -- a follower's side: the same methods on the same work ----------------------------
    def follow_prefill(self, work: list[np.ndarray]) -> None:
        Engine._prefill(self, prefill_batch(work))

    def follow_decode(self, work: list[np.ndarray]) -> None:
        for mine, given in zip(self._decode_state(), work, strict=True):
            mine[...] = given
        self._fetch(Engine._dispatch(self))


def prefill_work(batch: list[Request]) -> list[np.ndarray]:
    """A prefill's work as arrays: the prompts one after another, their lengths, slots,
    temperatures, top-ps and seeds."""
    return [
        np.concatenate([np.asarray(r.prompt, np.int32) for r in batch]),
        np.asarray([len(r.prompt) for r in batch], np.int32),
        np.asarray([r.slot for r in batch], np.int32),
        np.asarray([r.params.temperature for r in batch], np.float32),
        np.asarray([r.params.top_p for r in batch], np.float32),
        np.asarray([r.seed for r in batch], np.uint32),
    ]


def prefill_batch(work: list[np.ndarray]) -> list[Request]:
    """The requests of a prefill's work, as the leader's engine saw them."""
    tokens, lengths, slots, temperature, top_p, seeds = work
    batch, at = [], 0
    for n, slot, t, p, seed in zip(lengths, slots, temperature, top_p, seeds, strict=True):
        params = SamplingParams(1, float(t), float(p), int(seed))
        request = Request(tokens[at : at + n].tolist(), params, _nothing)
        request.slot = int(slot)
        batch.append(request)
        at += int(n)
    return batch


def follow_steps(engine: LockstepEngine, follower: Follower) -> None:
    """Run the leader's steps until it goes away (``next_step`` raises then)."""
    with engine.model._precision():
        while True:
            kind, work = follower.next_step()
            if kind == "prefill":
                engine.follow_prefill(work)
            elif kind == "decode":
                engine.follow_decode(work)
            elif kind == "reset":
                engine._caches = Engine._fresh_caches(engine)
