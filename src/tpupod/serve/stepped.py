"""The engine of a multi-host replica: every device call mirrored on the followers.

``LockstepEngine`` is the builtin server's :class:`Engine` with three hooks:

- its inputs go onto the devices with ``sharding.place`` (each process fills
  its own shards: ``jax.device_put`` cannot reach other processes' devices);
- on the leader, once a ``channel`` is attached (after warmup, which every
  member runs alike), each device call's inputs are broadcast first, tagged
  ``prefill``, ``decode`` or ``reset`` (fresh caches after a failed call);
- :func:`follow_steps` is a follower's whole life: run the same jitted
  program on each broadcast, in the same order as the leader.

The scheduler, the text and the requests exist only on the leader.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpupod.model import sharding, slots
from tpupod.serve.engine import Engine
from tpupod.serve.lockstep import Follower, Leader


class LockstepEngine(Engine):
    channel: Leader | None = None  # set on the leader once warm
    _phase: str | None = None

    def _put(self, *arrays: np.ndarray) -> Any:
        phase, self._phase = self._phase, None
        if self.channel is not None and phase is not None:
            self.channel.broadcast(phase, arrays)
        if self._inputs is None:
            return super()._put(*arrays)
        return tuple(sharding.place(a, self._inputs) for a in arrays)

    def _prefill(self, batch: list[Any]) -> np.ndarray:
        self._phase = "prefill"
        return super()._prefill(batch)

    def _decode(self) -> np.ndarray:
        self._phase = "decode"
        return super()._decode()

    def _fresh_caches(self) -> list[Any]:
        if self.channel is not None:
            if self.channel.failed:  # the replica is going down: nothing more runs
                return list(self._caches)
            self.channel.broadcast("reset", ())
        return super()._fresh_caches()

    # -- a follower's side -----------------------------------------------------------
    def run_prefill(self, arrays: list[np.ndarray]) -> None:
        """What ``Engine._prefill`` runs on the devices, from its broadcast inputs."""
        ids, slots_, positions, last, *sampling = self._put(*arrays)
        self._caches, logits = slots.prefill(
            self.model._graphdef, self.model._state, self._caches, ids, slots_, positions, last
        )
        np.asarray(slots.choose(logits, *sampling))

    def run_decode(self, arrays: list[np.ndarray]) -> None:
        """What ``Engine._decode`` runs, from its broadcast inputs."""
        (
            self._tokens,
            self._positions,
            self._steps,
            self._temperature,
            self._top_p,
            self._seeds,
        ) = arrays
        Engine._decode(self)


def follow_steps(engine: LockstepEngine, follower: Follower) -> None:
    """Run the leader's steps until it goes away (``next_step`` raises then)."""
    with engine.model._precision():
        while True:
            kind, arrays = follower.next_step()
            if kind == "prefill":
                engine.run_prefill(arrays)
            elif kind == "decode":
                engine.run_decode(arrays)
            elif kind == "reset":
                engine._caches = Engine._fresh_caches(engine)
