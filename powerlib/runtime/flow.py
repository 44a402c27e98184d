"""The job's lifecycle, top to bottom: profile, the plan arrives, the verdict, apply or re-plan.

:meth:`Flow._lifecycle` is the whole story of one session, as one generator (in the style of
zeus's ``FrequencyScheduler._run``)::

    profile  ->  the plan arrives  ->  the closed loop's verdict  ->  apply (or re-plan)  ->  done

It yields the :class:`~powerlib.runtime.phases.Runner` the session's hooks go to at each point
(the profile phase, an idle runner while rank 0 plans, the closed loop around the apply phase,
the apply phase) and is resumed by what happens to the job: the sweep finished
(:class:`Profiled`), an iteration starts while something is pending (:class:`Tick`: the plan's
arrival, a re-plan), the verdict arrived (:class:`Judged`), a saved plan no longer fits the
layout an integration stated (:class:`Withdrawn`).

A rank failure is one exception, :class:`~powerlib.runtime.phases.RankFailure`, thrown into the
flow where it waits (:meth:`Flow.fail`) and handled in one place (:meth:`Flow._failed`): this
rank stops managing its device at once; while the job still expects it in a collective (the
sweep's votes, the plan's arrival, the closed loop's exchange) it keeps its place there and the
failure rides on that collective, so every rank stops at the same point and rank 0 warns once
for the job (docs/real-gpu.md §3); with no collective left it stops alone and warns. A rank's
loop that does not run the plan's order is the same exception, marked ``off_order``.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor

from powerlib.errors import InvalidArgumentError, PlanError, PowerlibError
from powerlib.measurement.markers import Stamps
from powerlib.planning.plan import FrequencyPlan
from powerlib.runtime.apply_phase import ApplyPhase
from powerlib.runtime.claim import Job
from powerlib.runtime.closed_loop import CheckConfig, ClosedLoop, Judge, MeasureOnly
from powerlib.runtime.coordination import Future
from powerlib.runtime.events import Event, Judged, Profiled, Tick, Withdrawn
from powerlib.runtime.listeners import Listeners
from powerlib.runtime.phases import Awaiting, Idle, RankFailure, Runner, SessionPhase
from powerlib.runtime.planning_step import KeptFrontier, add_measured, judge_model, rank0_turn
from powerlib.runtime.power_budget_step import apply_power_limit
from powerlib.runtime.profile_phase import ProfilePhase
from powerlib.runtime.records import (
    NoPlan,
    Outcome,
    Payload,
    Planned,
    Prediction,
    ProfileOnly,
    ProfilePayload,
    Realized,
    ReplanRecord,
    SavedPlan,
    SavedProfile,
    StopPayload,
)
from powerlib.runtime.replan import PendingReplan
from powerlib.runtime.session_config import Mode, SessionConfig
from powerlib.runtime.short_run import say_ended_before_plan, say_ended_in_check

__all__ = ["Flow", "Judged", "Profiled", "Tick", "Withdrawn"]  # the events: runtime/events.py

logger = logging.getLogger("powerlib.runtime.session")

_RESET_ALONE = (
    "this rank's GPU was reset to its baseline clocks and powerlib leaves it alone; "
    "training continues"
)
"""How a rank that failed with no collective left to carry it says what it did."""


Steps = Generator[Runner, Event, None]


class Flow:
    """One session's lifecycle and what it produced (the session reads these attributes).

    Args:
        config: The session's configuration (``set_layout`` may state more of the layout
            until the first instruction).
        listeners: The session's instruction listeners.
        iteration: This rank's current iteration.

    Attributes:
        runner: Where the session's hooks go now.
        plan: The plan being applied, once one is.
        outcome: What rank 0 sent (the re-plan switched to, after one).
        realized: What the closed loop measured, once its verdict arrived.
        replans: Each re-plan switched to.
        apply_started_iteration: The iteration the plan arrived at.
        failure: This rank's own failure (the first), once it has one.
        profiling: The profile phase, once the session profiles.
        applying: The plan's apply phase, once a plan is applied.
        measuring: A disabled session's measurement.
    """

    def __init__(
        self, config: SessionConfig, listeners: Listeners, iteration: Callable[[], int]
    ) -> None:
        self.config = config
        self.runner: Runner = Idle(SessionPhase.NOT_STARTED)
        self.plan: FrequencyPlan | None = None
        self.outcome: Outcome | None = None
        self.realized: Realized | None = None
        self.replans: list[ReplanRecord] = []
        self.apply_started_iteration: int | None = None
        self.failure: str | None = None
        self.warned = False
        self.profiling: ProfilePhase | None = None
        self.applying: ApplyPhase | None = None
        self.measuring: MeasureOnly | None = None
        self._listeners = listeners
        self._iteration = iteration
        self._job: Job | None = None
        self._steps: Steps | None = None
        self._kept: KeptFrontier | None = None
        self._pending: PendingReplan | None = None
        self._planner_thread: ThreadPoolExecutor | None = None

    # -- the lifecycle, top to bottom -----------------------------------------------------------

    def _lifecycle(self, job: Job, *, disabled: bool) -> Steps:
        """The job: profile -> the plan arrives -> the verdict -> apply or re-plan -> done."""
        if disabled:  # measure every iteration, change nothing
            self.measuring = MeasureOnly(job.sampler, job.clock)
            self.runner = self.measuring
            job.progress.say("disabled: measuring only, no device is changed")
            yield from self._until_the_end()
        mode = self.config.run.mode
        if mode.profiles:
            payload = yield from self._profile(job)  # 1. profile
            future, strict = job.coordinator.exchange(payload, self._rank0_turn), False
        else:  # a saved profile or plan: a bad one fails at the with line
            saved = self._saved_input(job)
            future, strict = job.coordinator.exchange(saved, self._rank0_turn), True
        outcome, strict = yield from self._arrival(future, strict=strict)  # 2. the plan arrives
        loop = None if outcome is None else self._arrived(job, outcome, strict=strict)
        if loop is not None:
            yield from self._check(job, loop)  # 3. the closed loop's verdict
        yield from self._until_the_end()  # 4. apply, or re-plan, until the with block ends

    def _profile(self, job: Job) -> Generator[Runner, Event, ProfilePayload | StopPayload]:
        """Sweep the clocks; every rank keeps voting, a failed one marked unhealthy."""
        assert job.device is not None and job.controller is not None
        assert job.sampler is not None
        self.profiling = profiling = ProfilePhase(
            self.config.sweep,
            stage=job.stage,
            device=job.device,
            controller=job.controller,
            sampler=job.sampler,
            stamps=Stamps(job.clock, job.controller.marker),
            coordinator=job.coordinator,
            clock=job.clock,
            idle_power_w=job.idle_power_w,
            progress=job.progress,
            on_finished=lambda payload: self.send(Profiled(payload)),
            on_failure=self.fail,
            num_stages=self.config.workload.num_stages,
        )
        self.runner = profiling
        while True:
            try:
                event = yield self.runner
            except RankFailure as failure:
                self._failed(failure, owed=True)  # the sweep's vote carries it
                profiling.fail(failure.reason)
                continue
            if isinstance(event, Profiled):
                return event.payload

    def _arrival(
        self, future: Future[Outcome], *, strict: bool
    ) -> Generator[Runner, Event, tuple[Outcome | None, bool]]:
        """Ask for rank 0's outcome at every iteration start until it arrives.

        ``strict``: a planning error raises (at the ``with`` line), on the first ask only.
        """
        self.runner = Awaiting(lambda: self.send(Tick()))
        while True:
            try:
                outcome = future()
            except PlanError as err:
                if strict:
                    raise
                self._stop_job_wide(f"planning failed: {err}")
                return None, strict
            if outcome is not None:
                return outcome, strict
            strict = False
            while True:
                try:
                    event = yield self.runner
                except RankFailure as failure:
                    self._failed(failure, owed=True)  # the arrival builds a stopped apply phase
                    continue
                if isinstance(event, Tick):
                    break

    def _arrived(self, job: Job, outcome: Outcome, *, strict: bool) -> ClosedLoop | None:
        """What rank 0 sent: apply the plan (in its closed loop), or stop with the reason."""
        self.outcome = outcome
        if isinstance(outcome, ProfileOnly):
            self.runner = Idle(SessionPhase.DONE)
            if outcome.reason:
                self._stop_job_wide(f"{outcome.reason}; no profile written")
            return None
        if isinstance(outcome, NoPlan):  # rank 0 refused to plan, or refused the plan it made
            self._stop_job_wide(
                f"{outcome.reason}; running at the baseline clocks, no plan applied"
            )
            return None
        if not isinstance(outcome, Planned):  # pragma: no cover - the exchanges are in step
            self._stop_job_wide(f"rank 0 sent {type(outcome).__name__} instead of a plan")
            return None
        return self._start_applying(job, outcome.plan, outcome.prediction, strict=strict)

    def _start_applying(
        self, job: Job, plan: FrequencyPlan, prediction: Prediction | None, *, strict: bool
    ) -> ClosedLoop | None:
        """Check ``plan`` here, hand it to the controller and wrap it in the closed loop."""
        assert job.device is not None and job.controller is not None
        failure = self.failure  # this rank failed while the plan was on its way
        workload = self.config.workload
        try:
            if self.config.run.mode is Mode.APPLY:
                workload.check_saved_plan(plan)
            elif plan.num_stages != workload.num_stages:  # pragma: no cover - made for the job
                raise PlanError(
                    f"{plan.source}: the plan has {plan.num_stages} stages, the session has "
                    f"{workload.num_stages}"
                )
            self._accept(job, plan)
        except PowerlibError as err:
            if strict:
                raise
            # This rank alone may not apply it: it still joins the closed loop, stopped.
            failure = failure or f"stage {job.stage}: the plan cannot be applied: {err}"
        try:
            applying = self._apply_phase(job, plan)
        except PowerlibError as err:  # the plan has no part for this stage: so on every rank
            self._stop_job_wide(f"the plan cannot be applied: {err}")
            return None
        self.plan = plan
        self.runner = self.applying = applying
        loop = None
        rounds = 0 if plan.power_limits_w else self.config.apply.check_rounds  # power_budget_step
        if rounds and job.sampler is not None:
            config = CheckConfig(rounds=rounds)
            judge = None
            if job.rank == 0:
                judge = Judge(
                    config,
                    max_slowdown=None
                    if plan.policy == "min-energy"
                    else self.config.policy.max_slowdown,
                    predicted=prediction,
                    model=judge_model(self.config, self._kept, plan),
                    held_by_reference=plan.policy == "deadline",
                )
            self.runner = loop = ClosedLoop(
                applying,
                config,
                sampler=job.sampler,
                stamps=Stamps(job.clock, job.controller.marker),
                coordinator=job.coordinator,
                judge=judge,
                latency_s=None if self.profiling is None else self.profiling.landing_s,
                on_verdict=lambda realized: self.send(Judged(realized)),
            )
        self.apply_started_iteration = self._iteration()
        if failure is not None:
            applying.stop(failure)
            self._failed(RankFailure(failure), owed=loop is not None)  # the loop's exchange
            return loop
        job.progress.say(f"applying the {plan.policy} plan from iteration {self._iteration()}")
        return loop

    def _check(self, job: Job, loop: ClosedLoop) -> Steps:
        """Alternate all-max and plan windows until rank 0's verdict arrives."""
        while True:
            try:
                event = yield self.runner
                if isinstance(event, Judged):
                    self._judged(job, loop, event.realized)
                    return
                if isinstance(event, Withdrawn) or (
                    isinstance(event, Tick) and self._switch_if_replanned(job)
                ):
                    return
            except RankFailure as failure:
                self._failed(failure, owed=True)  # it sends its windows as stopped
                if not failure.off_order:
                    loop.applying.stop(failure.reason)

    def _judged(self, job: Job, loop: ClosedLoop, realized: Realized) -> None:
        """The verdict (every rank gets rank 0's): keep, warn, or revert."""
        self.realized = realized
        if job.rank == 0:
            add_measured(self.config.run.out_dir, realized)
        loop.close()
        if realized.verdict in ("reverted", "inconclusive"):
            what = "reverted" if realized.verdict == "reverted" else "withdrawn (not shown to save)"
            self._stop_job_wide(
                f"{realized.reason}; plan {what}, running at the baseline clocks "
                f"({realized.line()})"
            )
            return
        self.runner = loop.applying
        if self.failure is not None:  # failed after its windows went out: it stops alone
            self.runner = Idle(SessionPhase.DONE)
            self._warn(f"{self.failure}; {_RESET_ALONE}", job_wide=False)
        if realized.verdict == "shortfall" and job.rank == 0:
            logger.warning("powerlib: %s", realized.reason)
        job.progress.say(realized.line())

    def _until_the_end(self) -> Steps:
        """Apply the plan (or run at the baseline), switching to re-plans as they arrive."""
        while True:
            try:
                event = yield self.runner
                if isinstance(event, Tick) and self._job is not None:
                    self._switch_if_replanned(self._job)
            except RankFailure as failure:
                self._failed(failure, owed=False)  # no collective left: it stops alone

    # -- what drives it (the session's hooks) ---------------------------------------------------

    def start(self, job: Job, *, disabled: bool) -> None:
        """Run the flow up to its first wait (at the ``with`` line).

        Raises:
            PowerlibError: A saved plan or profile that cannot be used, a device that cannot
                be profiled (nothing was changed).
        """
        self._job = job
        self._steps = self._lifecycle(job, disabled=disabled)
        self.runner = next(self._steps)

    def send(self, event: Event) -> None:
        """Something the flow waits for happened."""
        if self._steps is not None:
            self.runner = self._steps.send(event)

    def fail(self, failure: RankFailure) -> None:
        """This rank fails: raised into the flow where it waits (the one way in)."""
        steps = self._steps
        if steps is None or inspect.getgeneratorstate(steps) == inspect.GEN_CLOSED:  # a bug
            self._failed(failure, owed=False)
            return
        self.runner = steps.throw(failure)

    def iteration_starts(self) -> None:
        """At an iteration boundary: a pending re-plan may switch now (every rank votes)."""
        if self._pending is not None and self.applying is not None:
            self.send(Tick())

    def withdraw(self) -> None:
        """The saved plan does not fit the stated layout: apply nothing (nothing was yet)."""
        self.plan, self.applying = None, None
        self.runner = Idle(SessionPhase.DONE)
        self.send(Withdrawn())

    # -- failures and warnings: one place --------------------------------------------------------

    def _failed(self, failure: RankFailure, *, owed: bool) -> None:
        """The one handler of a rank failure: this rank stops managing its device.

        Args:
            failure: What failed.
            owed: The job still expects this rank in a collective (the sweep's votes, the plan's
                arrival, the closed loop's exchange): the runner stays, the failure rides on
                that collective and rank 0 warns once for the job. Otherwise this rank stops
                alone: clocks reset, one warning.
        """
        controller = None if self._job is None else self._job.controller
        if failure.off_order:  # its loop does not run the plan's order (clocks already reset)
            if not owed:
                self.runner = Idle(SessionPhase.DONE)
            self._warn(failure.reason, job_wide=False)
            return
        if self.failure is None:
            self.failure = failure.reason
            if controller is not None:
                controller.stop()
        if owed:  # rank 0's one warning will name the reason
            logger.debug("powerlib: %s; every rank stops at the next agreement", failure.reason)
            return
        if controller is not None:
            controller.reset()
        self.runner = Idle(SessionPhase.DONE)
        self._warn(f"{failure.reason}; {_RESET_ALONE}", job_wide=False)

    def _stop_job_wide(self, reason: str) -> None:
        """Every rank stops with rank 0's reason (its planning verdict, the closed loop's)."""
        if self._job is not None and self._job.controller is not None:
            self._job.controller.reset()
        self.runner = Idle(SessionPhase.DONE)
        self._warn(reason, job_wide=True)

    def _warn(self, reason: str, *, job_wide: bool) -> None:
        """One ``RuntimeWarning`` line per job (``logging.captureWarnings`` logs it).

        A job-wide reason warns on rank 0 only; the other ranks log it at DEBUG. A warning, not
        also a log record: frameworks that log at INFO through the root logger (Megatron-LM)
        would print both, and every other rank's.
        """
        if self.warned:
            return
        self.warned = True
        message = f"powerlib: {reason}"
        if job_wide and self._job is not None and self._job.rank != 0:
            logger.debug(message)
            return
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    # -- rank 0's turn in the exchanges ----------------------------------------------------------

    def _saved_input(self, job: Job) -> SavedProfile | SavedPlan:
        run = self.config.run
        if run.mode is Mode.PLAN:
            assert run.profile_path is not None
            return SavedProfile(stage=job.stage, path=run.profile_path)
        assert run.plan_path is not None
        return SavedPlan(stage=job.stage, path=run.plan_path)

    def _rank0_turn(self, payloads: list[Payload]) -> Outcome:
        progress = self._job is not None and self._job.progress.enabled
        return rank0_turn(self.config, payloads, progress=progress, keep=self._keep)

    def _keep(self, kept: KeptFrontier) -> None:
        self._kept = kept

    # -- plans: applying one, re-planning ---------------------------------------------------------

    def _accept(self, job: Job, plan: FrequencyPlan) -> None:
        """Hand ``plan`` to the listeners, then check its clocks on this rank's device.

        The listeners first, before any per-rank check: one may make a collective for the plan
        (Kareus creates its NCCL communicators), which every rank must join at the same point.

        Raises:
            PlanError: A listener refuses it, the device lacks a clock, or a limit is refused.
        """
        assert job.device is not None
        self._listeners.hand_plan(plan, job.stage)
        plan.check_frequencies(job.device.info.supported_sm_freqs_mhz, job.stage)
        apply_power_limit(job, plan)  # a power-budget plan's limit (docs/perseus.md §7)

    def _apply_phase(self, job: Job, plan: FrequencyPlan) -> ApplyPhase:
        """This rank's stage of ``plan``, through the session's controller."""
        assert job.controller is not None
        return ApplyPhase.for_session(
            plan, job.stage, job.controller, self.config.apply, self.profiling, on_stop=self.fail
        )

    def replan(self, deadline_s: float) -> None:
        """Start re-planning for ``deadline_s`` (see ``Session.replan``).

        Raises:
            InvalidArgumentError: No plan this session made is applied, a re-plan is pending,
                or rank 0 kept no frontier.
        """
        job = self._job
        if job is None or self.applying is None or not self.config.run.mode.plans:
            raise InvalidArgumentError(
                "replan: the session applies no plan it made itself (re-planning needs the "
                "frontier of mode 'auto' or 'plan')"
            )
        if self._pending is not None:
            raise InvalidArgumentError(
                f"replan: the re-plan for {self._pending.deadline_s:g} s is still pending"
            )
        if job.rank == 0 and self._kept is None:
            raise InvalidArgumentError("replan: rank 0 kept no frontier to re-plan from")
        if job.rank == 0 and self._planner_thread is None:
            self._planner_thread = ThreadPoolExecutor(1, thread_name_prefix="powerlib-replan")
        self._pending = PendingReplan(
            job.coordinator,
            float(deadline_s),
            self._kept if job.rank == 0 else None,
            self._planner_thread,
            self._iteration,
        )
        job.progress.say(
            f"re-planning for a {deadline_s:g} s iteration (rank 0, in the background)"
        )

    @property
    def pending_replan(self) -> PendingReplan | None:
        """The re-plan on its way, or ``None``."""
        return self._pending

    def _switch_if_replanned(self, job: Job) -> bool:
        """At an iteration boundary: switch to the re-plan if every rank has it now.

        Raises:
            RankFailure: Applying it failed on this rank (as in a hook).
        """
        try:
            return self._switch(job)
        except PowerlibError as err:
            raise RankFailure.in_hook(job.stage, "start_iteration", err) from err

    def _switch(self, job: Job) -> bool:
        pending = self._pending
        if pending is None:
            return False
        deadline_s = pending.deadline_s
        settled, outcome = pending.take(failed=self.failure is not None)
        if settled:
            self._pending = None
        if outcome is None:
            return False
        plan = outcome.plan
        try:
            self._accept(job, plan)  # every rank at the same boundary
        except PlanError as err:
            logger.warning("powerlib: the re-plan for %g s cannot be applied: %s", deadline_s, err)
            return False
        applying = self._apply_phase(job, plan)
        self.plan, self.outcome = plan, outcome
        self.runner = self.applying = applying
        prediction = outcome.prediction
        saving = None if prediction is None else prediction.saving_percent
        self.replans.append(
            ReplanRecord(
                iteration=self._iteration(),
                deadline_s=deadline_s,
                policy=plan.policy,
                realized_saving_percent=saving,
            )
        )
        job.progress.say(
            f"switched to the plan for {deadline_s:g} s at iteration {self._iteration()}"
            + ("" if saving is None else f" (saves {saving:.2f} % replayed on the profile)")
        )
        return True

    # -- the end ---------------------------------------------------------------------------------

    def iteration_budget(self) -> int:
        """The most iterations until the plan is applied and judged: the sweep's, the check's."""
        sweep = 0 if self.profiling is None else self.profiling.sweep.config.max_iterations
        # the check's windows are exchanged at its exchange_iteration; the verdict lands one later
        return sweep + CheckConfig(rounds=self.config.apply.check_rounds).most_iterations

    def stop_replanning(self) -> None:
        """The session ends: a re-plan not yet solved never is."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._planner_thread is not None:
            self._planner_thread.shutdown(wait=False, cancel_futures=True)
            self._planner_thread = None

    def closed(self) -> None:
        """The ``with`` block ended (if it started)."""
        if self._steps is not None:
            self._steps.close()
        if self.runner.phase is not SessionPhase.NOT_STARTED:
            self.runner = Idle(SessionPhase.CLOSED)

    def ended_before_plan(self) -> None:
        """The ``with`` block ended (no exception) before a plan, or before its verdict.

        Rank 0 says how far it got, once (:mod:`powerlib.runtime.short_run`): how far the sweep
        got, or that the closed loop's check ended unjudged (``unfinished``, every rank's report).
        """
        profiling, job = self.profiling, self._job
        if isinstance(self.runner, ClosedLoop) and self.runner.pending and job is not None:
            self.runner.close()
            if not self.warned and self.realized is None:
                self.realized = say_ended_in_check(
                    rank=job.rank,
                    iterations_left=self.runner.iterations_left,
                    out_dir=self.config.run.out_dir,
                )
                self.warned = True
            return
        waiting = isinstance(self.runner, Awaiting)
        if profiling is None or job is None or not (waiting or self.runner is profiling):
            return
        if self.warned:
            return
        self.warned = (
            say_ended_before_plan(
                profiling,
                rank=job.rank,
                stage=job.stage,
                iterations=self._iteration(),
                waiting=waiting,
                goal="profile" if self.config.run.mode is Mode.PROFILE else "plan",
                out_dir=self.config.run.out_dir,
            )
            or job.rank == 0
        )
