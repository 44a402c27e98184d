"""The session's plan flow: profile to plan, plan arrival, re-planning, the closed loop's verdict.

:class:`PlanFlow` is the half of :class:`~powerlib.runtime.session.Session` that moves a job from
one phase to the next (issue 32, point 6: the session does not grow): a rank's profile goes to
rank 0 (:meth:`_profiled`), the plan that comes back is checked and applied, wrapped in the
closed loop (:meth:`_try_plan`; :mod:`powerlib.runtime.closed_loop`), whose verdict keeps or
reverts it (:meth:`_verdict`); :meth:`replan` plans for a new straggler deadline off the training
thread (:mod:`powerlib.runtime.replan`). The session keeps the lifecycle (the ``with`` block,
device, lock, sampler, controller) and the hooks; it mixes this class in, so these methods read
the session's attributes.

A rank that fails (its clock change refused or failed, a driver or measurement error in a hook)
stops managing its device at once but stays in every collective the other ranks will make
(:meth:`_fail_in_phase`): the sweep's votes, the profile gather, the closed loop's exchange, a
re-plan's votes. The failure rides on them (an unhealthy vote, a ``stopped`` payload with its
reason), so every rank stops at the same point and rank 0 warns once with the reason
(docs/real-gpu.md §3). After the closed loop's verdict the apply phase makes no collective: a
rank that fails then runs at its baseline alone (its stage only gets faster) and warns itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from powerlib.errors import InvalidArgumentError, PlanError, PowerlibError
from powerlib.planning.plan import FrequencyPlan
from powerlib.runtime.apply_phase import ApplyPhase
from powerlib.runtime.closed_loop import CheckConfig, ClosedLoop
from powerlib.runtime.coordination import Future
from powerlib.runtime.listeners import (
    plan_has_partitions,
    registered_listener,
    unclaimed_partitions,
)
from powerlib.runtime.phases import DONE, Idle, Waiting
from powerlib.runtime.planning_step import (
    PlanningOutcome,
    Replanner,
    make_plan,
    write_no_plan,
    write_profile,
)
from powerlib.runtime.profile_phase import ProfilePhase
from powerlib.runtime.records import ProfilePayload, Realized
from powerlib.runtime.replan import Replanning

if TYPE_CHECKING:
    pass

__all__ = ["PlanFlow"]

logger = logging.getLogger("powerlib.runtime.session")

_RESET_ALONE = (
    "this rank's GPU was reset to its baseline clocks and powerlib leaves it alone; "
    "training continues"
)
"""How a rank that failed with no collective left to carry it says what it did."""


def _stopped_profiles(payloads: Sequence[Any]) -> str | None:
    """Rank 0: why profiling stopped on every rank (some rank's stop payload), or ``None``."""
    stops = [p for p in payloads if isinstance(p, Mapping) and p.get("stopped")]
    if not stops:
        return None
    why = "; ".join(str(p["reason"]) for p in stops if p.get("reason")) or "a rank failed"
    return f"{why}; powerlib stopped profiling on every rank"


def _warn_at_exit(message: str) -> None:
    """One ``RuntimeWarning`` at the ``with`` statement's exit.

    Where warnings are errors (``-W error``) it is a log record instead: a training run that went
    well must not fail for a notice.
    """
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=4)  # the `with` statement's line
    except Warning:
        logger.warning(message)


class PlanFlow:
    """Profile -> plan -> apply -> verdict, and re-planning (mixed into the session)."""

    _failure: str | None = None
    """This rank's own failure (the first), once it has one: it manages its device no more."""

    # -- from profile to plan to apply -----------------------------------------------------------

    def _profiled(self, payload: ProfilePayload | dict[str, Any]) -> None:
        """The sweep is over: send this rank's profile to rank 0 and wait for its outcome."""
        assert self._coordinator is not None
        plan_fn = self._profile_only_fn if self.mode == "profile" else self._plan_fn
        self._await(self._coordinator.exchange(payload, plan_fn), strict=False)

    def _plan_fn(self, payloads: list[dict[str, Any]]) -> PlanningOutcome:
        stopped = _stopped_profiles(payloads)
        if stopped is not None:
            write_no_plan(self.spec.out_dir, {"refused": stopped})
            return PlanningOutcome(baseline_reason=stopped)
        spec = dataclasses.replace(self.spec, progress=self._progress.enabled)
        return make_plan(spec, payloads, keep=self._keep_replanner)

    def _keep_replanner(self, replanner: Replanner) -> None:
        self._replanner = replanner

    # -- re-planning at run time -----------------------------------------------------------------

    def replan(self, deadline_s: float) -> None:
        """Plan again for a new straggler deadline; switch at the first iteration boundary after.

        Every rank calls it at the same iteration (the deadline is normally a job-wide
        measurement, such as the slowest rank's iteration time). Rank 0 solves the new plan on
        its planning thread from the frontier it kept, while training goes on with the current
        plan; at each later :meth:`step` the ranks check (one small collective) whether it is
        ready, and all switch before the same iteration. A deadline below the fastest plan
        plans the fastest; a plan that would not pay is refused with one warning and the
        current plan stays. :attr:`replans` records every switch.

        Args:
            deadline_s: The iteration time to plan for, in seconds.

        Raises:
            InvalidArgumentError: Outside the ``with`` block, a deadline that is not a positive
                number, no plan made by this session being applied (``apply`` mode has no
                frontier), or a re-plan still pending.
        """
        if not self._active:
            self._refuse_outside("replan")
        if not (
            isinstance(deadline_s, (int, float)) and math.isfinite(deadline_s) and deadline_s > 0
        ):
            raise InvalidArgumentError(
                f"replan: deadline_s must be a positive number, got {deadline_s!r}"
            )
        if self._applying is None or self.mode not in ("auto", "plan"):
            raise InvalidArgumentError(
                "replan: the session applies no plan it made itself (re-planning needs the "
                "frontier of mode 'auto' or 'plan')"
            )
        if self._replanning is not None:
            raise InvalidArgumentError(
                f"replan: the re-plan for {self._replanning.deadline_s:g} s is still pending"
            )
        assert self._coordinator is not None
        if self.rank == 0 and self._replanner is None:
            raise InvalidArgumentError("replan: rank 0 kept no frontier to re-plan from")
        if self.rank == 0 and self._planner_thread is None:
            self._planner_thread = ThreadPoolExecutor(1, thread_name_prefix="powerlib-replan")
        self._replanning = Replanning(
            self._coordinator,
            float(deadline_s),
            self._replanner if self.rank == 0 else None,
            self._planner_thread,
            lambda: self.iteration,
        )
        self._progress.say(
            f"re-planning for a {deadline_s:g} s iteration (rank 0, in the background)"
        )

    def _switch_replanned(self) -> None:
        """At an iteration boundary: switch to the re-plan if every rank has it now."""
        assert self._replanning is not None and self.device is not None
        assert self.controller is not None
        deadline_s = self._replanning.deadline_s
        try:
            outcome = self._replanning.poll()
        except PlanError as err:
            self._replanning = None
            logger.warning(
                "powerlib: re-planning for %g s failed: %s; keeping the current plan",
                deadline_s,
                err,
            )
            return
        if outcome is None:
            return
        self._replanning = None
        if self._failure is not None:  # it voted with the others; its device stays at baseline
            logger.info(
                "powerlib: the re-plan for %g s is not applied: this rank failed", deadline_s
            )
            return
        plan = outcome.plan
        if plan is None:
            logger.warning(
                "powerlib: the re-plan for %g s was refused: %s; keeping the current plan",
                deadline_s,
                outcome.baseline_reason,
            )
            return
        try:
            # every rank at the same boundary: a listener may make a collective (see _try_plan)
            self._hand_to_listeners(plan)
            plan.check_frequencies(self.device.info.supported_sm_freqs_mhz, self.stage)
        except PlanError as err:
            logger.warning("powerlib: the re-plan for %g s cannot be applied: %s", deadline_s, err)
            return
        self.plan = plan
        self.outcome = outcome
        self._phase = self._applying = self._apply_phase(plan)
        saving = None if outcome.prediction is None else outcome.prediction.saving_percent
        self.replans.append(
            {
                "iteration": self.iteration,
                "deadline_s": deadline_s,
                "policy": plan.policy,
                "realized_saving_percent": saving,
            }
        )
        self._progress.say(
            f"switched to the plan for {deadline_s:g} s at iteration {self.iteration}"
            + ("" if saving is None else f" (saves {saving:.2f} % replayed on the profile)")
        )

    def _hand_to_listeners(self, plan: FrequencyPlan) -> None:
        """Hand ``plan`` to the instruction listeners; one must take its partition settings.

        When none of the session's listeners takes them, the listener registered for
        ``partitions`` (Kareus's launch control, docs/architecture.md §1) is added and handed the
        plan. Every rank takes the same path at the same point: a listener may make a
        collective.

        Raises:
            PlanError: The plan has partition settings and nothing takes them.
        """
        if self._listeners.plan_applied(plan, self.stage) or not plan_has_partitions(plan):
            return
        listener = registered_listener("partitions")
        if listener is not None:
            self._listeners.add(listener)
            if listener.plan_applied(plan, self.stage):
                return
        raise PlanError(unclaimed_partitions(plan))

    def _apply_phase(self, plan: FrequencyPlan) -> ApplyPhase:
        """This rank's stage of ``plan``, through the session's controller."""
        assert self.controller is not None
        return ApplyPhase(
            plan,
            self.stage,
            self.controller,
            prefetch=self.apply_config.prefetch,
            on_mismatch=self._stopped,
            on_failure=self._disable,
        )

    def _profile_only_fn(self, payloads: list[dict[str, Any]]) -> PlanningOutcome:
        stopped = _stopped_profiles(payloads)
        if stopped is not None:
            write_no_plan(self.spec.out_dir, {"refused": stopped})
            return PlanningOutcome(profile_only=True, baseline_reason=stopped)
        spec = dataclasses.replace(self.spec, progress=self._progress.enabled)
        return write_profile(spec, payloads)

    def _await(self, future: Future, *, strict: bool) -> None:
        self._plan_future = future
        self._phase = Waiting(lambda: self._try_plan(strict=False))
        self._try_plan(strict=strict)

    def _try_plan(self, *, strict: bool) -> None:
        assert self._plan_future is not None
        assert self.device is not None and self.controller is not None
        try:
            result = self._plan_future()
        except PlanError as err:
            if strict:
                raise
            self._disable(f"planning failed: {err}", job_wide=True)
            return
        if result is None:
            return
        self._plan_future = None
        self.outcome = result
        if result.profile_only:
            self._phase = Idle(DONE)
            if result.baseline_reason:
                self._disable(f"{result.baseline_reason}; no profile written", job_wide=True)
            return
        if result.plan is None:  # rank 0 refused to plan, or refused the plan it made
            self._disable(
                f"{result.baseline_reason}; running at the baseline clocks, no plan applied",
                job_wide=True,
            )
            return
        plan = result.plan
        failure = self._failure  # this rank failed while the plan was on its way
        try:
            if self.mode == "apply":
                self.spec.check_saved_plan(plan, self._layout_given)
            elif plan.num_stages != self.spec.num_stages:  # pragma: no cover - made for the job
                raise PlanError(
                    f"{plan.source}: the plan has {plan.num_stages} stages, the session has "
                    f"{self.spec.num_stages}"
                )
            # Before any per-rank check: a listener may make a collective for the plan (Kareus
            # creates its NCCL communicators), which every rank must join at the same point.
            self._hand_to_listeners(plan)
            plan.check_frequencies(self.device.info.supported_sm_freqs_mhz, self.stage)
        except PowerlibError as err:
            if strict:
                raise
            # This rank alone may not apply it: it still joins the closed loop, stopped.
            failure = failure or f"stage {self.stage}: the plan cannot be applied: {err}"
        try:
            applying = self._apply_phase(plan)
        except PowerlibError as err:  # the plan has no part for this stage: so on every rank
            self._disable(f"the plan cannot be applied: {err}", job_wide=True)
            return
        self.plan = plan
        self._phase = self._applying = applying
        if self.apply_config.check_rounds and self.sampler is not None:
            self._phase = ClosedLoop(
                self._applying,
                CheckConfig(rounds=self.apply_config.check_rounds),
                sampler=self.sampler,
                clock=self._clock,
                coordinator=self._coordinator,
                max_slowdown=None if plan.policy == "min-energy" else self.spec.max_slowdown,
                predicted=result.prediction,
                on_verdict=self._verdict,
            )
        self.apply_started_iteration = self.iteration
        if failure is not None:
            applying.stop(failure)
            self._disable(failure)  # the closed loop's exchange makes it job-wide
            return
        self._progress.say(f"applying the {plan.policy} plan from iteration {self.iteration}")

    def _ended_before_plan(self) -> None:
        """The ``with`` block ended (no exception) while profiling or awaiting the plan.

        Rank 0 says so in one warning line (how far the sweep got, how many iterations it
        needs) and writes what it has to ``out_dir``: ``summary.json`` and its own stage's rows
        of the clocks that ended (``profile.partial.csv``). No collective (the other ranks may
        be gone already), nothing raised: the training run itself went well.
        """
        profiling = self._profiling
        waiting = isinstance(self._phase, Waiting)
        if profiling is None or not (waiting or self._phase is profiling) or self._warned:
            return
        if self.rank != 0:
            if profiling.failed is not None:  # no agreement came to carry it to rank 0
                self._warned = True
                _warn_at_exit(f"powerlib: {profiling.failed}; the run ended before every rank knew")
            else:
                logger.debug("powerlib: the run ended before its plan; rank 0 says how far")
            return
        self._warned = True
        goal = "profile" if self.mode == "profile" else "plan"
        so_far = profiling.so_far()
        if waiting:
            got = f"it profiled every clock, but rank 0's {goal} had not arrived"
        elif so_far["warming_up"]:
            got = "it was still warming up"
        else:
            got = f"it profiled {so_far['clocks_profiled']} of {so_far['clocks']} clocks"
        message = (
            f"powerlib: the run ended after {self.iteration} iterations, before its {goal}: "
            f"{got}; a {goal} needs up to {so_far['iterations_needed']} iterations of "
            f"profiling ({so_far['warmup_iterations']} warm-up + {so_far['clocks']} clocks x up "
            f"to {so_far['max_iterations_per_clock']}): train longer, or profile fewer clocks "
            "(freqs_mhz) or iterations per clock (max_iterations_per_freq)"
        )
        if profiling.failed is not None:
            message += f"; {profiling.failed}"
        rows = []
        try:
            rows = profiling.partial_rows()
        except Exception as err:  # noqa: BLE001 - a finished run must not fail for its partial profile
            logger.debug("powerlib: no partial profile: %s", err)
        info = {
            "ended_before_plan": message.removeprefix("powerlib: "),
            "iterations": self.iteration,
            **{k: v for k, v in so_far.items() if k != "warming_up"},
            "partial_profile_stage": self.stage if rows else None,
        }
        if write_no_plan(self.spec.out_dir, info, rows):
            written = "its partial profile and summary.json are" if rows else "summary.json is"
            message += f"; {written} in {self.spec.out_dir}"
        _warn_at_exit(message)

    def _verdict(self, realized: Realized) -> None:
        """The closed loop's verdict (every rank gets rank 0's): keep, warn, or revert."""
        self.realized = realized
        if self.rank == 0 and self.spec.out_dir is not None:
            path = Path(self.spec.out_dir) / "summary.json"
            try:
                info = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
                info["measured"] = realized.to_json()
                path.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
            except (OSError, ValueError) as err:
                logger.warning("powerlib: could not add the measured figures to %s: %s", path, err)
        if realized.verdict == "reverted":
            self._disable(
                f"{realized.reason}; plan reverted, running at the baseline clocks "
                f"({realized.line()})",
                job_wide=True,
            )
            return
        if isinstance(self._phase, ClosedLoop):
            self._phase = self._phase.applying
        if self._failure is not None:  # failed after its windows went out: it stops alone
            self._stopped(f"{self._failure}; {_RESET_ALONE}")
        if realized.verdict == "shortfall" and self.rank == 0:
            logger.warning("powerlib: %s", realized.reason)
        self._progress.say(realized.line())

    def _fail_in_phase(self, reason: str) -> bool:
        """This rank failed: keep its phase if the job still expects it in a collective.

        Returns:
            True when the phase stays, marked failed, and carries the failure to the other ranks
            (the sweep's unhealthy vote, the plan's arrival, the closed loop's ``stopped``
            windows); False when no collective is owed and the rank stops alone.
        """
        phase = self._phase
        if isinstance(phase, ProfilePhase):
            phase.fail(reason)
            return True
        if isinstance(phase, Waiting) and self._plan_future is not None:
            return True  # the plan's arrival builds a stopped apply phase (_try_plan)
        if isinstance(phase, ClosedLoop) and phase.pending:
            phase.applying.stop(reason)
            return True
        return False
