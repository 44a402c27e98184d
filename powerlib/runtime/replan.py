"""Re-planning at run time: a new straggler deadline, planned off the training thread.

A straggler changes the deadline an iteration can meet (Perseus, SOSP'24 §4.3): the other
stages can slow down to it. :meth:`Session.replan <powerlib.runtime.session.Session.replan>`
starts one :class:`PendingReplan`: rank 0 solves the new point on its planning thread, from the
frontier it kept (:class:`~powerlib.runtime.planning_step.KeptFrontier`; the direct solve
re-uses its last basis), while every rank keeps training on the current plan. At each iteration
boundary the ranks vote whether rank 0's plan is ready (one small collective); the first
boundary where it is, rank 0 ships the plan with the iteration to start it at (one past the
latest rank's, :class:`~powerlib.runtime.records.Replanned`), and every rank switches before that
iteration's first instruction: all ranks change plans at the same iteration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor
from concurrent.futures import Future as ThreadFuture

from powerlib.errors import PlanError
from powerlib.runtime.coordination import Coordinator, Future, Vote
from powerlib.runtime.planning_step import KeptFrontier
from powerlib.runtime.records import NoPlan, Outcome, Payload, Planned, Replanned, ReplanReady

__all__ = ["PendingReplan"]

logger = logging.getLogger("powerlib.runtime.session")


class PendingReplan:
    """One re-plan, from the request to the boundary every rank switches at.

    Args:
        coordinator: The job's ranks.
        deadline_s: The new iteration time to plan for.
        frontier: Rank 0's kept frontier (``None`` on the other ranks).
        executor: Rank 0's planning thread.
        iteration: This rank's current iteration.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        deadline_s: float,
        frontier: KeptFrontier | None,
        executor: Executor | None,
        iteration: Callable[[], int],
    ) -> None:
        self.deadline_s = deadline_s
        self._coordinator = coordinator
        self._job: ThreadFuture[Planned | NoPlan] | None = None
        if frontier is not None:
            assert executor is not None
            self._job = executor.submit(frontier.plan_for, deadline_s)
        self._vote: Future[Vote] | None = None
        self._exchange: Future[Outcome] | None = None
        self._iteration = iteration
        self._arrived: Replanned | None = None

    @property
    def solve(self) -> ThreadFuture[Planned | NoPlan] | None:
        """Rank 0's solve on its planning thread (``None`` on the other ranks)."""
        return self._job

    def poll(self) -> Replanned | None:
        """At an iteration boundary: the re-plan to switch to now, or ``None`` (not yet).

        Raises:
            PlanError: Rank 0's re-plan failed (every rank gets the same error).
        """
        if self._arrived is not None:
            return self._due(self._arrived)
        if self._exchange is None:
            if self._vote is None:
                ready = self._job.done() if self._job is not None else True
                self._vote = self._coordinator.all_agree(ready)
            agreed = self._vote()
            if agreed is None:
                return None  # the other ranks have not voted yet (in-process groups)
            self._vote = None
            if not agreed:
                return None
            payload = ReplanReady(deadline_s=self.deadline_s, iteration=self._iteration())
            self._exchange = self._coordinator.exchange(payload, self._result)
        got = self._exchange()
        if got is None:
            return None
        if not isinstance(got, Replanned):
            raise PlanError(f"rank 0 answered a re-plan with {type(got).__name__}")
        self._arrived = got
        return self._due(got)

    def take(self, *, failed: bool) -> tuple[bool, Planned | None]:
        """At an iteration boundary: ``(settled, plan to switch to)``.

        ``settled``: the re-plan is over (switched to, refused, failed, or not for this rank,
        which failed: it voted with the others, its device stays at its baseline); each but
        the switch is said in one log line.
        """
        deadline_s = self.deadline_s
        try:
            replanned = self.poll()
        except PlanError as err:
            logger.warning(
                "powerlib: re-planning for %g s failed: %s; keeping the current plan",
                deadline_s,
                err,
            )
            return True, None
        if replanned is None:
            return False, None
        outcome = replanned.outcome
        if failed:
            logger.info(
                "powerlib: the re-plan for %g s is not applied: this rank failed", deadline_s
            )
            return True, None
        if isinstance(outcome, NoPlan):
            logger.warning(
                "powerlib: the re-plan for %g s was refused: %s; keeping the current plan",
                deadline_s,
                outcome.reason,
            )
            return True, None
        return True, outcome

    def _due(self, replanned: Replanned) -> Replanned | None:
        """The re-plan once this rank reaches the iteration every rank switches at."""
        return replanned if self._iteration() >= replanned.switch_iteration else None

    def _result(self, payloads: list[Payload]) -> Outcome:
        """Rank 0, inside the exchange: the finished plan (its error, if it failed).

        Ranks may reach the exchange at different boundaries (in-process groups resolve when
        the last one calls in), so all switch one iteration past the latest of them.
        """
        assert self._job is not None
        outcome = self._job.result()
        latest = max(p.iteration for p in payloads if isinstance(p, ReplanReady))
        return Replanned(outcome=outcome, switch_iteration=latest + 1)

    def cancel(self) -> None:
        """The session ends: a solve not yet started never starts."""
        if self._job is not None:
            self._job.cancel()
