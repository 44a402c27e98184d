"""Re-planning at run time: a new straggler deadline, planned off the training thread.

A straggler changes the deadline an iteration can meet (Perseus, SOSP'24 §4.3): the other
stages can slow down to it. :meth:`Session.replan <powerlib.runtime.session.Session.replan>`
starts one :class:`Replanning`: rank 0 solves the new point on its planning thread, from the
frontier it kept (:class:`~powerlib.runtime.planning_step.Replanner`; the direct solve re-uses
its last basis), while every rank keeps training on the current plan. At each iteration
boundary the ranks vote whether rank 0's plan is ready (one small collective); the first
boundary where it is, rank 0 ships the plan with the iteration to start it at (one past the
latest rank's), and every rank switches before that iteration's first instruction: all ranks
change plans at the same iteration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Executor
from concurrent.futures import Future as ThreadFuture
from typing import Any

from powerlib.runtime.coordination import Coordinator, Future
from powerlib.runtime.planning_step import PlanningOutcome, Replanner

__all__ = ["Replanning"]


class Replanning:
    """One re-plan, from the request to the boundary every rank switches at.

    Args:
        coordinator: The job's ranks.
        deadline_s: The new iteration time to plan for.
        replanner: Rank 0's kept frontier (``None`` on the other ranks).
        executor: Rank 0's planning thread.
        iteration: This rank's current iteration.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        deadline_s: float,
        replanner: Replanner | None,
        executor: Executor | None,
        iteration: Callable[[], int],
    ) -> None:
        self.deadline_s = deadline_s
        self._coordinator = coordinator
        self._job: ThreadFuture[PlanningOutcome] | None = None
        if replanner is not None:
            assert executor is not None
            self._job = executor.submit(replanner.plan_for, deadline_s)
        self._vote: Future | None = None
        self._exchange: Future | None = None
        self._iteration = iteration
        self._arrived: PlanningOutcome | None = None

    def poll(self) -> PlanningOutcome | None:
        """At an iteration boundary: the outcome to switch to now, or ``None`` (not yet).

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
            payload = {"replan": self.deadline_s, "iteration": self._iteration()}
            self._exchange = self._coordinator.exchange(payload, self._result)
        got = self._exchange()
        if got is None:
            return None
        self._arrived = got
        return self._due(got)

    def _due(self, outcome: PlanningOutcome) -> PlanningOutcome | None:
        """The outcome once this rank reaches the iteration every rank switches at."""
        due = outcome.switch_iteration or 0
        return outcome if self._iteration() >= due else None

    def _result(self, payloads: list[dict[str, Any]]) -> PlanningOutcome:
        """Rank 0, inside the exchange: the finished plan (its error, if it failed).

        Ranks may reach the exchange at different boundaries (in-process groups resolve when
        the last one calls in), so all switch one iteration past the latest of them.
        """
        assert self._job is not None
        outcome = self._job.result()
        latest = max(int(p.get("iteration", 0)) for p in payloads)
        return dataclasses.replace(outcome, switch_iteration=latest + 1)

    def cancel(self) -> None:
        """The session ends: a solve not yet started never starts."""
        if self._job is not None:
            self._job.cancel()
