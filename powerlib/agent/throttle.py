"""The agent's request rate per pool: one uid's (or pod's) connections share one rate.

A uid may hold 128 connections (docs/agent.md §5). A rate per connection let one uid that opened
them all pipeline 128 times that rate, and the one event loop answered its flood and little
else: a granted job's power-limit change went from a millisecond to hundreds (issue 46). Here a
pool (``uid:N`` or ``pod:NAME``, the same key as the connection table's share) has one schedule
that all its connections take turns in, so 128 connections get what one does.

The schedule is a token bucket kept as a time (GCRA): each request of a pool takes the pool's
next slot, ``1 / rate_per_s`` after the slot before, and waits until that slot, less the burst
the pool may spend at once. A flood therefore waits on its own coroutines, spaced in time, and
the loop serves everyone else between them: no queue is scanned, nothing is woken in a herd, and
a pool costs one float. A pool whose schedule has caught up with the clock is the same as a new
one, so the table forgets those first when it is full (at most ``max_pools`` kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PoolThrottle"]


class PoolThrottle:
    """The schedule of every pool's requests; :meth:`delay_s` takes a slot.

    Args:
        max_pools: Pools kept at once; past it, the pools that are idle (their schedule
            caught up with the clock: forgetting one loses nothing) go first, else the oldest.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(
        self, *, max_pools: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_pools < 1:
            raise ValueError(f"max_pools must be at least 1, not {max_pools!r}")
        self.max_pools = max_pools
        self._clock = clock
        self._due_s: dict[str, float] = {}
        """Per pool: the time its next request's slot starts (its bucket, kept as a time)."""

    def __len__(self) -> int:
        return len(self._due_s)

    def delay_s(self, pool: str, rate_per_s: float, burst: float) -> float:
        """Take ``pool``'s next slot: how long the request must wait for it (0: go now).

        Args:
            pool: Whose share it counts against (``uid:N``, ``pod:NAME``).
            rate_per_s: Requests per second the pool may make, all its connections together.
            burst: Requests it may make at once after a quiet spell (at least 1).

        Raises:
            ValueError: A rate that is not positive.
        """
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be positive, not {rate_per_s!r}")
        now = self._clock()
        due = self._due_s.get(pool)
        if due is None:
            self._make_room(now)
            due = now
        elif due < now:
            due = now  # a quiet spell refills the burst, never more
        period_s = 1.0 / rate_per_s
        self._due_s[pool] = due + period_s
        return max(0.0, due - now - (max(1.0, burst) - 1.0) * period_s)

    def _make_room(self, now: float) -> None:
        if len(self._due_s) < self.max_pools:
            return
        for pool in [p for p, due in self._due_s.items() if due <= now]:
            del self._due_s[pool]  # caught up: the same as a pool never seen
        if len(self._due_s) >= self.max_pools:
            self._due_s.pop(next(iter(self._due_s)))  # all busy: the oldest goes
