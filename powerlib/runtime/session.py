"""The session: one ``with`` block around a training loop that profiles, plans and applies.

::

    with powerlib.optimize(num_stages=4, num_microbatches=8) as session:
        for batch in loader:
            for kind, mb in my_pipeline_order():          # whatever the loop runs
                with session.instruction(kind, microbatch=mb):
                    run(kind, mb)
            session.step()                                # end of one iteration

Modes (``mode``):

- ``profile``: warm-up, then a frequency sweep that records every instruction's time and
  energy; rank 0 merges the ranks' profiles and writes ``profile.csv``.
- ``plan``: rank 0 plans from a saved profile (``profile_path``), then the plan is applied.
- ``apply``: a saved plan (``plan_path``) is applied.
- ``auto`` (default): profile, plan, apply, in that order.

A :class:`Session` takes one :class:`~powerlib.runtime.session_config.SessionConfig`;
:func:`optimize` is the one adapter from the flat keywords users and integrations pass. The
session composes what a job needs and mixes nothing in: at the ``with`` line it joins the job
and claims its device (:mod:`powerlib.runtime.claim`: the control session, the frequency
controller, the sampler), then runs its :class:`~powerlib.runtime.flow.Flow`, the lifecycle
read top to bottom (profile, the plan arrives, the closed loop's verdict, apply or re-plan).
Its hooks hand every instruction to the instruction listeners and to the flow's current runner.
Every change goes through a :class:`~powerlib.control.ControlSession`, so it is journaled first
and restored on every exit path (normal exit, exception, SIGTERM/SIGHUP, atexit; a killed
process by the next session or ``powerlib restore``).

Instructions are keyed by ``(stage, chunk, microbatch, kind)``.

Refusals happen at the ``with`` line, before any change: a saved plan made for another workload
(stages, microbatches, schedule, chunks; :meth:`FrequencyPlan.check_workload
<powerlib.planning.plan.FrequencyPlan.check_workload>`), and a device another session already
holds (the session takes the device's lock when it is entered, so a second session on the same
device, in this process or another, gets :class:`~powerlib.errors.DeviceBusyError` there instead
of fighting the first one's clocks). The hooks refuse to run outside the ``with`` block. After
profiling, a profile that cannot resolve per-instruction energy, or a plan that would spend more
energy than all maximum clocks or run past the allowed slowdown, is not applied: rank 0 says why
in one warning line and every rank runs at the baseline clocks
(:mod:`powerlib.runtime.planning_step`).

The hooks (``begin``, ``end``, ``instruction``, ``start_iteration``, ``step``) never let a
device or measurement error out into the training loop (docs/real-gpu.md §3): it becomes one
:class:`~powerlib.runtime.phases.RankFailure` raised into the flow. Optional packages follow the
instructions through listeners (:meth:`Session.add_instruction_listener`,
:mod:`powerlib.runtime.listeners`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from powerlib.config import Settings, sessions_disabled
from powerlib.control import ControlSession
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError, PlanError, PowerlibError
from powerlib.measurement.sampler import DeviceSampler
from powerlib.planning.pipeline import InstructionKey
from powerlib.planning.plan import FrequencyPlan
from powerlib.runtime.claim import (
    Job,
    claim_device,
    join_job,
    open_for_control,
    open_for_measuring,
)
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.flow import Flow
from powerlib.runtime.listeners import InstructionListener, Listeners
from powerlib.runtime.phases import Idle, RankFailure, SessionPhase, instruction_kind
from powerlib.runtime.profile_phase import ProfilePhase
from powerlib.runtime.records import (
    NoPlan,
    Outcome,
    Planned,
    Prediction,
    Realized,
    ReplanRecord,
    SessionReport,
    SessionStatus,
)
from powerlib.runtime.session_config import Mode, SessionConfig, keywords_signature
from powerlib.runtime.sweep import ProfileRecorder

__all__ = ["Session", "active_sessions", "optimize"]

logger = logging.getLogger(__name__)

_ACTIVE_SESSIONS: weakref.WeakSet[Session] = weakref.WeakSet()


def active_sessions() -> list[Session]:
    """The sessions inside their ``with`` block in this process (the exporter publishes them)."""
    return list(_ACTIVE_SESSIONS)


class Session:
    """Profile -> plan -> apply around a training loop: ``with powerlib.optimize(...) as session``.

    Args:
        config: Everything the session is told (:class:`SessionConfig`); the flat keywords go
            through :func:`optimize`.

    Attributes:
        config: The configuration; ``set_layout`` states more of the workload's layout.
        iteration: Iterations stepped.
    """

    def __init__(self, config: SessionConfig) -> None:
        if not isinstance(config, SessionConfig):
            raise TypeError(
                "Session takes one SessionConfig; use powerlib.optimize(**keywords) for the "
                f"flat keywords, got {type(config).__name__}"
            )
        self.iteration = 0
        self._listeners = Listeners(config.run.listeners)
        self._flow = Flow(config, self._listeners, lambda: self.iteration)
        self._job: Job | None = None
        self._active = False  # inside the with block (the hooks refuse to run otherwise)
        self._started = False  # start_iteration ran for the current iteration
        self._closed_logged = False

    # -- what it is told, and what it did -------------------------------------------------------

    @property
    def config(self) -> SessionConfig:
        """The configuration (with the layout ``set_layout`` stated)."""
        return self._flow.config

    @property
    def mode(self) -> Mode:
        """``auto``, ``profile``, ``plan`` or ``apply``."""
        return self._flow.config.run.mode

    @property
    def phase(self) -> SessionPhase:
        """Where the session is (a :class:`SessionPhase`, equal to its string).

        ``not started``, ``profile``, ``awaiting-plan``, ``check``, ``apply``, ``done``,
        ``closed`` or ``disabled``.
        """
        return self._flow.runner.phase

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (-1 before the session is entered)."""
        return -1 if self._job is None else self._job.stage

    @property
    def rank(self) -> int:
        """This process's rank in the job (0 before the session is entered)."""
        return 0 if self._job is None else self._job.rank

    @property
    def device(self) -> Device | None:
        """This rank's device, once opened."""
        return None if self._job is None else self._job.device

    @property
    def control(self) -> ControlSession | None:
        """The control session every change goes through, once started."""
        return None if self._job is None else self._job.control

    @property
    def controller(self) -> FrequencyController | None:
        """The frequency controller, once started."""
        return None if self._job is None else self._job.controller

    @property
    def sampler(self) -> DeviceSampler | None:
        """Reads the device off the training thread (profile attribution, the closed loop)."""
        return None if self._job is None else self._job.sampler

    @property
    def plan(self) -> FrequencyPlan | None:
        """The plan being applied (the last re-plan switched to), once one is."""
        return self._flow.plan

    @property
    def outcome(self) -> Outcome | None:
        """What rank 0 sent at the end of profiling (the re-plan switched to, after one)."""
        return self._flow.outcome

    @property
    def prediction(self) -> Prediction | None:
        """The planner's figures for the plan rank 0 sent (replayed on the profile)."""
        outcome = self._flow.outcome
        return outcome.prediction if isinstance(outcome, (Planned, NoPlan)) else None

    @property
    def realized(self) -> Realized | None:
        """What the plan achieved, measured by the closed loop (rank 0 judged it)."""
        return self._flow.realized

    @property
    def replans(self) -> tuple[ReplanRecord, ...]:
        """Each re-plan this session switched to."""
        return tuple(self._flow.replans)

    @property
    def apply_started_iteration(self) -> int | None:
        """The iteration the plan arrived at, once one did."""
        return self._flow.apply_started_iteration

    @property
    def profiling(self) -> ProfilePhase | None:
        """The profile phase (its sweep and recorder), once the session profiles."""
        return self._flow.profiling

    @property
    def recorder(self) -> ProfileRecorder:
        """What profiling recorded (empty when the session did not profile)."""
        profiling = self._flow.profiling
        return profiling.recorder if profiling is not None else ProfileRecorder()

    @property
    def first_apply_requests(self) -> list[tuple[InstructionKey, float]]:
        """Every clock the first (checked) applied iteration requested, in order."""
        applying = self._flow.applying
        return applying.first_requests if applying is not None else []

    def iteration_budget(self) -> int:
        """The most iterations from the start until the plan is applied and judged.

        The sweep's most (every clock at its maximum), then the closed loop's rounds; a loop
        that runs this many iterations and then some sees the plan's verdict.
        """
        return self._flow.iteration_budget()

    def report(self) -> SessionReport:
        """What this session did (:meth:`SessionReport.to_json` is its JSON form)."""
        controller = self.controller
        measuring = self._flow.measuring
        profiling = self._flow.profiling
        plan = self._flow.plan
        return SessionReport(
            stage=self.stage,
            phase=self.phase,
            iterations=self.iteration,
            apply_started_iteration=self.apply_started_iteration,
            profiled_freqs_mhz=tuple(
                sorted({r.freq_mhz for r in self.recorder.rows(self.stage)}, reverse=True)
            ),
            measured_p_block_w=self.recorder.p_block_w,
            frequency_changes=0 if controller is None else len(controller.applied),
            plan=None if plan is None else dict(plan.summary),
            replans=self.replans,
            measured_latency_s=None if profiling is None else profiling.latency_s,
            realized=self.realized,
            predicted=self.prediction,
            disabled=None if measuring is None else measuring.measured(),
        )

    def status(self) -> SessionStatus:
        """What the session publishes now (the Prometheus exporter reads it)."""
        controller = self.controller
        return SessionStatus.of(
            self.stage,
            self._flow.outcome,
            None if controller is None else controller.last_requested,
            self._flow.realized,
        )

    # -- the with block ---------------------------------------------------------------------------

    def __enter__(self) -> Session:
        if self.phase is not SessionPhase.NOT_STARTED:
            raise InvalidArgumentError(
                "this session was already entered"
                + (" and has ended" if self.phase is SessionPhase.CLOSED else " and is running")
                + "; a session is entered once: make a new one with powerlib.optimize(...)"
            )
        run = self.config.run
        try:
            settings = run.settings or Settings.from_env()
            disabled = not run.enabled or sessions_disabled()
            self._job = job = join_job(run, self.config.workload.num_stages, settings)
            if disabled:
                open_for_measuring(job, run)
            else:
                open_for_control(job, run, threaded=self.config.apply.threaded)
            self._flow.start(job, disabled=disabled)
            if not disabled:
                assert job.control is not None and job.device is not None
                claim_device(job.control, job.device)
        except BaseException:
            self._close()
            raise
        self._active = True
        _ACTIVE_SESSIONS.add(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None:  # a short run: rank 0 says how far it got
                self._flow.ended_before_plan()
        finally:
            self._close()

    def _close(self) -> None:
        self._active = False
        _ACTIVE_SESSIONS.discard(self)
        self._listeners.close()
        self._flow.stop_replanning()
        job = self._job
        if job is not None and job.controller is not None:
            job.controller.close()
        if self._flow.profiling is not None:
            self._flow.profiling.close()
        if job is not None:
            job.close_work()  # a simulated GPU idles
            if job.sampler is not None:
                job.sampler.close()
            if job.control is not None:
                job.control.close()
            if job.own_backend is not None:
                job.own_backend.close()
                job.own_backend = None
        self._flow.closed()
        realized = self._flow.realized
        if realized is not None and self.rank == 0 and not self._closed_logged:
            self._closed_logged = True
            logger.info("powerlib: %s", realized.line())

    # -- what integrations call when they attach ------------------------------------------------

    @property
    def instruction_listeners(self) -> tuple[InstructionListener, ...]:
        """The listeners that follow this session's instructions, in the order they were added."""
        return tuple(self._listeners)

    def add_instruction_listener(self, listener: InstructionListener) -> None:
        """Let ``listener`` follow this session's instructions (:mod:`powerlib.runtime.listeners`).

        Call it on every rank at the same point, before the first instruction. If the session
        applies a plan already (a saved plan is applied when the session is entered), the
        listener gets it now: a listener that makes a collective for it makes it here. A saved
        plan with per-partition settings must find its listener when it is applied: add it
        before the ``with`` block, or pass ``listeners=``.

        Args:
            listener: Has ``plan_applied(plan, stage)``, ``begin(kind, microbatch, chunk)``,
                ``end()``, ``step()`` and ``close()``; Kareus's is
                :class:`powerlib.kareus.launch.LaunchControl` (``powerlib.kareus.launch.attach``).

        Raises:
            InvalidArgumentError: An instruction already ran, the session has ended, or the
                listener lacks a hook or was added already.
            PlanError: The listener refuses the plan being applied.
        """
        if self.phase is SessionPhase.CLOSED:
            raise InvalidArgumentError("add_instruction_listener: the session has ended")
        if self.iteration or self._flow.runner.position:
            raise InvalidArgumentError(
                "add_instruction_listener must be called before the first instruction"
            )
        self._listeners.add(listener)
        plan = self._flow.plan
        if plan is not None:
            try:
                listener.plan_applied(plan, self.stage)
            except BaseException:
                self._listeners.discard(listener)
                raise

    def set_layout(
        self,
        *,
        schedule: str | None = None,
        num_chunks: int | None = None,
        placement: str | None = None,
    ) -> None:
        """Describe the pipeline the hooks will see (integrations call it when they attach).

        Args:
            schedule: See :class:`~powerlib.runtime.session_config.WorkloadConfig`;
                ``recorded`` for orders with no built-in generator.
            num_chunks: Model chunks per stage.
            placement: ``looped`` or ``v``.

        Raises:
            InvalidArgumentError: An instruction already ran, or the layout is invalid.
            PlanError: The saved plan being applied was made for another layout (nothing was
                changed).
        """
        if self.iteration or self._flow.runner.position:
            raise InvalidArgumentError("set_layout must be called before the first instruction")
        try:
            config = self.config.with_layout(
                schedule=schedule, num_chunks=num_chunks, placement=placement
            )
        except PlanError as err:
            raise InvalidArgumentError(str(err)) from None
        self._flow.config = config
        plan = self._flow.plan
        if self.mode is Mode.APPLY and plan is not None:
            try:
                config.workload.check_saved_plan(plan)
            except PlanError:
                self._flow.withdraw()  # nothing was applied
                raise

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
        self._flow.replan(deadline_s)

    # -- the hooks ------------------------------------------------------------------------------

    def _refuse_outside(self, call: str) -> None:
        """Raise: a hook was called before ``__enter__`` or after ``__exit__``."""
        when = (
            "before it was entered" if self.phase is SessionPhase.NOT_STARTED else "after it ended"
        )
        raise InvalidArgumentError(
            f"session.{call}() was called {when}: call the session's hooks inside "
            "`with powerlib.optimize(...) as session:`"
        )

    def _hook_failed(self, hook: str, err: PowerlibError) -> None:
        """A hook met a device or measurement error: this rank fails; nothing is raised."""
        self._flow.fail(RankFailure.in_hook(self.stage, hook, err))

    def begin(self, kind: str, microbatch: int = 0, chunk: int = 0) -> None:
        """An instruction starts (call right before launching its work).

        A device or measurement error inside never reaches the caller: it stops powerlib on
        every rank with one warning, and training continues (docs/real-gpu.md §3).

        Raises:
            InvalidArgumentError: A bug in the calling code, the same on every rank, raised
                before any device work: called outside the session's ``with`` block, or an
                unknown ``kind``.
        """
        if not self._active:
            self._refuse_outside("begin")
        kind = instruction_kind(kind)  # on every rank and in every phase, before any device work
        runner = self._flow.runner
        if runner.position == 0 and (not self._started or runner.wants_start):
            self.start_iteration()  # (may wait for the other ranks: not the instruction's time)
        if self._job is not None:  # a simulated GPU starts running the instruction
            self._job.follow_work(kind)
        runner = self._flow.runner
        if not self._listeners and isinstance(runner, Idle):
            return
        try:
            self._listeners.begin(kind, microbatch, chunk)
            runner.begin(kind, microbatch, chunk)
        except PowerlibError as err:
            self._hook_failed("begin", err)

    def end(self) -> None:
        """The instruction started last ends (call after its work is issued).

        A device or measurement error inside never reaches the caller (see :meth:`begin`).

        Raises:
            InvalidArgumentError: Called outside the session's ``with`` block (a bug in the
                calling code).
        """
        if not self._active:
            self._refuse_outside("end")
        if self._job is not None:  # first: a simulated GPU's time may follow its clock
            self._job.follow_work(None)
        try:
            self._listeners.end()
            self._flow.runner.end()
        except PowerlibError as err:
            self._hook_failed("end", err)

    @contextlib.contextmanager
    def instruction(self, kind: str, microbatch: int = 0, chunk: int = 0) -> Iterator[None]:
        """``with session.instruction("forward", microbatch=3): ...`` = begin + end.

        A device or measurement error inside the hooks never reaches the caller (see
        :meth:`begin`); an exception of the block itself propagates unchanged.

        Raises:
            InvalidArgumentError: Used outside the session's ``with`` block, or an unknown
                ``kind`` (bugs in the calling code).
        """
        self.begin(kind, microbatch, chunk)
        try:
            yield
        finally:
            self.end()

    def start_iteration(self) -> None:
        """Prepare the next iteration (:meth:`step` and the first :meth:`begin` call it).

        Resolves what the ranks agreed at the last :meth:`step` and sets the clock for the
        iteration. Calling it again before the first instruction retries pending agreements
        (the emulator, driving every rank from one thread, relies on that). A device or
        measurement error inside never reaches the caller (see :meth:`begin`).

        Raises:
            InvalidArgumentError: Called outside the session's ``with`` block (a bug in the
                calling code).
        """
        if not self._active:
            self._refuse_outside("start_iteration")
        self._started = True
        try:
            self._flow.iteration_starts()
            self._flow.runner.start_iteration()
        except PowerlibError as err:
            self._hook_failed("start_iteration", err)

    def step(self) -> None:
        """One training iteration ended (after the optimizer step).

        A device or measurement error inside never reaches the caller (see :meth:`begin`);
        the iteration is counted whatever happens, so every rank stays at the same one.

        Raises:
            InvalidArgumentError: Called outside the session's ``with`` block (a bug in the
                calling code).
        """
        if not self._active:
            self._refuse_outside("step")
        if not self._started:
            self.start_iteration()
        try:
            self._flow.runner.step()
            self._listeners.step()
        except PowerlibError as err:
            self._hook_failed("step", err)
        self.iteration += 1
        # Agree and set the clock for the next iteration now, at the iteration boundary: a
        # collective inside the next begin hook could deadlock against a rank that waits in a
        # pipeline receive before its own first begin.
        self._started = False
        self.start_iteration()


def optimize(**keywords: Any) -> Session:
    """``with powerlib.optimize(num_stages=..., num_microbatches=...) as session:``.

    The one adapter from flat keywords to a :class:`Session`
    (:meth:`SessionConfig.from_keywords
    <powerlib.runtime.session_config.SessionConfig.from_keywords>`). Every keyword is one field
    of one part of the configuration, documented there with its default:
    :class:`~powerlib.runtime.session_config.WorkloadConfig` (``num_stages``,
    ``num_microbatches``, the layout), :class:`~powerlib.runtime.session_config.PolicyConfig`,
    :class:`~powerlib.runtime.sweep.SweepConfig`,
    :class:`~powerlib.runtime.session_config.ApplyConfig` and
    :class:`~powerlib.runtime.session_config.RunConfig` (``mode``, ``device``, ``out_dir``, ...).
    ``inspect.signature(optimize)`` lists them all.

    Raises:
        TypeError: An unknown keyword, or ``num_stages``/``num_microbatches`` missing.
        InvalidArgumentError: A bad option (a mode without its input file, bad sweep counts).
        PlanError: A bad planning option (an unknown policy, a deadline without T′).
    """
    return Session(SessionConfig.from_keywords(**keywords))


optimize.__signature__ = keywords_signature()  # type: ignore[attr-defined]
