"""The wait before a process that ended is started again: one rule for the agent's servers
(``supervisor``), the split server's children (``split``) and the router (``respawn``)."""

from __future__ import annotations

MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a run this long was a good one: the next wait is the first again


class Backoff:
    """Waits that double from ``first`` up to ``most``, back to ``first`` after a run of
    ``stable_s`` (a process failing at once is not restarted in a tight loop; one that
    served for an hour and died is restarted soon)."""

    def __init__(self, first: float, most: float = MAX_BACKOFF_S, stable_s: float = STABLE_S):
        self.first, self.most, self.stable_s = first, most, stable_s
        self._next = first

    def after(self, ran_s: float) -> float:
        """The wait before the next start, for a process that ran ``ran_s`` seconds."""
        if ran_s > self.stable_s:
            self._next = self.first
        wait = self._next
        self._next = min(wait * 2, self.most)
        return wait

    def reset(self) -> None:
        """The process served well (it was killed, it did not fail): the next wait is the
        first again."""
        self._next = self.first
