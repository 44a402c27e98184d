"""The session: one ``with`` block around a training loop that profiles, plans and applies.

::

    with powerlib.optimize(num_stages=4, num_microbatches=8) as session:
        for batch in loader:
            for kind, mb in my_pipeline_order():          # whatever the loop runs
                with session.instruction(kind, microbatch=mb):
                    run(kind, mb)
            session.step()                                # end of one iteration

Phases (``mode``):

- ``profile``: warm-up, then a frequency sweep from high to low that records every instruction's
  time and energy; rank 0 merges the ranks' profiles and writes ``profile.csv``.
- ``plan``: rank 0 plans from a saved profile (``profile_path``), then the plan is applied.
- ``apply``: a saved plan (``plan_path``) is applied.
- ``auto`` (default): profile, plan, apply, in that order.

The session owns the lifecycle (the ``with`` block, the device, its lock, the control session,
the coordinator) and hands its hooks to the phase that runs: a
:class:`~powerlib.runtime.profile_phase.ProfilePhase` while it profiles, then an
:class:`~powerlib.runtime.apply_phase.ApplyPhase`, whose begin hook hands the planned frequency
of the instruction to a per-device :class:`~powerlib.runtime.controller.FrequencyController` and
returns; the first applied iteration is checked against the plan's instruction order, and a
mismatch warns once, resets the clocks and leaves training alone. Every change goes through a
:class:`~powerlib.control.ControlSession`, so it is journaled first and restored on every exit
path (normal exit, exception, SIGTERM/SIGHUP, atexit; a killed process by the next session or
``powerlib restore``).

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
:class:`~powerlib.errors.PowerlibError` out into the training loop: a device, driver or
measurement error inside one (an energy or clock read, a refused or failed clock change) resets
this rank's clocks and stops powerlib job-wide, through the next collective the ranks share (a
failed rank keeps joining them, with a flag that stops every rank at the same point), with one
warning; training continues (docs/real-gpu.md §3). They still raise
:class:`~powerlib.errors.InvalidArgumentError` for a bug in the calling code that is the same on
every rank, before any device work: a hook called outside the ``with`` block, an unknown
instruction kind.

A Kareus overlap plan (instructions with ``execution``/``overlap`` fields) also loads
:attr:`Session.overlap` (:class:`~powerlib.runtime.launch_control.Overlap`) for this rank's stage when
the plan arrives: the session's instruction hooks drive it, so an integration asks
``session.overlap.config(key)`` or wraps partitions in ``session.overlap.partition(...)`` and gets
the running instruction's settings. Its instruction-order check is its own: a loop that does not
follow the plan sends every partition down the default path, whatever the clocks do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.device import Backend, Device
from powerlib.errors import InvalidArgumentError, PlanError, PowerlibError
from powerlib.measurement.markers import Stamps, cuda_marker
from powerlib.measurement.measure import warn_no_device
from powerlib.measurement.sampler import DeviceSampler
from powerlib.planning.plan import FrequencyPlan
from powerlib.profiling.sweep import ProfileRecorder
from powerlib.progress import Progress
from powerlib.registry import open_backend
from powerlib.runtime.apply_phase import ApplyConfig, ApplyPhase, InstructionKey
from powerlib.runtime.closed_loop import ClosedLoop, MeasureOnly
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import Coordinator, Future, default_coordinator
from powerlib.runtime.launch_control import Overlap
from powerlib.runtime.options import MODES, RunConfig, check_control, claim_device
from powerlib.runtime.phases import (
    CLOSED,
    DONE,
    NOT_STARTED,
    Idle,
    Phase,
    instruction_kind,
)
from powerlib.runtime.plan_flow import PlanFlow
from powerlib.runtime.planning_step import (
    PlanningOutcome,
    PlanSpec,
    Replanner,
)
from powerlib.runtime.profile_phase import ProfileConfig, ProfilePhase
from powerlib.runtime.records import Realized
from powerlib.runtime.replan import Replanning

__all__ = ["MODES", "ApplyConfig", "ProfileConfig", "RunConfig", "Session", "optimize"]

logger = logging.getLogger(__name__)

_LAYOUT = ("schedule", "num_chunks", "placement")

_ACTIVE_SESSIONS: weakref.WeakSet[Session] = weakref.WeakSet()


def active_sessions() -> list[Session]:
    """The sessions inside their ``with`` block in this process (the exporter publishes them)."""
    return list(_ACTIVE_SESSIONS)


class Session(PlanFlow):
    """Profile -> plan -> apply around a training loop: ``with powerlib.optimize(...) as session``.

    ``powerlib.optimize`` is this class (:data:`optimize`); :meth:`from_config` takes the same
    settings as configuration objects.

    Args:
        num_stages: Pipeline stages of the job.
        num_microbatches: Microbatches per iteration.
        mode: ``auto``, ``profile``, ``plan`` or ``apply``.
        stage: This rank's pipeline stage; default: the rank, when there is one rank per stage.
        schedule: ``1f1b`` (default), ``gpipe``, ``interleaved``, or ``recorded`` (plan only on
            the order the hooks record while profiling: zero-bubble and V schedules).
        num_chunks: Model chunks per stage (interleaved, V schedules); default 1.
        placement: ``looped`` (default) or ``v``: which model pieces a stage's chunks hold (see
            :mod:`powerlib.planning.pipeline`). Integrations set schedule, chunks and placement
            through :meth:`set_layout` when they know them. A saved plan (``apply`` mode) is
            checked against the ones given here or through :meth:`set_layout`.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        device: The device (index, id or :class:`Device`); default this process's CUDA device,
            else ``LOCAL_RANK`` among the visible ones (docs/real-gpu.md §4).
        policy: ``fastest`` (no slowdown), ``deadline`` or ``min-energy``.
        deadline_s: Straggler iteration time T′ for ``deadline``.
        deadline_ratio: T′ as a multiple of the all-max iteration time.
        argmin: The paper's emulation rule for ``deadline``.
        max_slowdown: Realized-slowdown guard for ``fastest`` and ``deadline`` (fraction;
            default 0.1 %).
        switch_latency_s: Clock-change latency the guard plans for; default: measured while
            warming up (5 ms when it cannot be measured).
        p_block_w: Blocking power; default: measured between instructions while profiling.
        unit_time_s: Planner time unit; default: from the profile.
        profile_path: The profile to plan from (``plan`` mode).
        plan_path: The plan to apply (``apply`` mode).
        out_dir: Where rank 0 writes profile, frontier, plan and summary; ``None``: nowhere.
        freqs_mhz: Profile candidates; default: every supported clock from the top down.
        warmup_iterations: Discarded iterations at the highest frequency (the clock-change
            latency is measured there).
        settle_iterations: Discarded iterations after each clock change (default 0: the
            measured window starts when the new clock is seen to land).
        iterations_per_freq: Measured iterations per frequency, at least.
        max_iterations_per_freq: Measured iterations per frequency, at most; a clock's block
            ends as soon as its energy resolves to ``target_error``.
        target_error: Relative half-width of the 95 % interval every profile row must reach.
        stop_after_rises: End the coarse pass after this many clocks of rising energy.
        coordinator: How ranks agree; default ``torch.distributed`` if initialised, else alone.
        clock: Time source in seconds; default ``time.perf_counter``.
        sync: Waits for the device before a time is read; default ``torch.cuda.synchronize``
            once CUDA is initialised, else nothing (decided at each call, docs/real-gpu.md §4).
        threaded: Apply frequencies on a controller thread (default) or inline (emulator).
        progress: Print progress to stderr; default on rank 0 only.
        guardian: Start the watchdog process that restores the device if this process is
            killed; default: on when the backend changes devices directly and persistently (real
            hardware, not the agent; docs/real-gpu.md §6).
        prefetch: In the apply phase, request the next instruction's clock when one ends, so the
            switch overlaps the wait between instructions (after the order check).
        plot: Rank 0 also draws ``frontier.png`` in ``out_dir`` (``plot`` extra).
        overlap_groups: For overlap plans on NCCL: the global ranks of every group the overlapped
            collectives run on (every tensor/context-parallel group of the job, the same lists on
            every rank); default: the whole world. See :mod:`powerlib.runtime.launch_control`.
        settings: Settings; default from the environment.
        enabled: ``False`` (or ``POWERLIB_DISABLE=1``): the same hooks, every iteration timed
            and metered, no device changed and no lock taken (the A side of an A/B run).
        check_rounds: Rounds of interleaved all-max and plan windows measured after a plan
            arrives (:mod:`powerlib.runtime.closed_loop`): the saving the session reports is
            measured, and a plan that misses is reverted. 0: no check.
        force: Take a GPU whose clocks someone else locked although the driver cannot read that
            lock back (its restore then unlocks; docs/real-gpu.md §1); default: refuse it.

    Raises:
        InvalidArgumentError: A bad option (a mode without its input file, bad sweep counts).
        PlanError: A bad planning option (an unknown policy, a deadline without T′).
    """

    def __init__(
        self,
        *,
        num_stages: int,
        num_microbatches: int,
        mode: str = "auto",
        stage: int | None = None,
        schedule: str | None = None,
        num_chunks: int | None = None,
        placement: str | None = None,
        backend: Backend | str | None = None,
        device: int | str | Device | None = None,
        policy: str = "fastest",
        deadline_s: float | None = None,
        deadline_ratio: float | None = None,
        argmin: bool = False,
        max_slowdown: float = 0.001,
        switch_latency_s: float | None = None,
        p_block_w: float | None = None,
        unit_time_s: float | None = None,
        profile_path: str | Path | None = None,
        plan_path: str | Path | None = None,
        out_dir: str | Path | None = "powerlib-out",
        freqs_mhz: Sequence[float] | None = None,
        warmup_iterations: int = 2,
        settle_iterations: int = 0,
        iterations_per_freq: int = 1,
        max_iterations_per_freq: int = 4,
        target_error: float = 0.02,
        stop_after_rises: int = 2,
        coordinator: Coordinator | None = None,
        clock: Callable[[], float] | None = None,
        sync: Callable[[], None] | None = None,
        threaded: bool = True,
        progress: bool | None = None,
        guardian: bool | None = None,
        prefetch: bool = True,
        plot: bool = False,
        overlap_groups: Sequence[Sequence[int]] | None = None,
        settings: Settings | None = None,
        enabled: bool = True,
        force: bool = False,
        check_rounds: int = 3,
    ) -> None:
        run = RunConfig(
            mode=mode,
            stage=stage,
            backend=backend,
            device=device,
            profile_path=profile_path,
            plan_path=plan_path,
            coordinator=coordinator,
            clock=clock,
            sync=sync,
            progress=progress,
            guardian=guardian,
            overlap_groups=overlap_groups,
            settings=settings,
            enabled=enabled,
            force=force,
        )
        spec = PlanSpec(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule="1f1b" if schedule is None else schedule,
            num_chunks=1 if num_chunks is None else num_chunks,
            placement="looped" if placement is None else placement,
            policy=policy,
            deadline_s=deadline_s,
            deadline_ratio=deadline_ratio,
            argmin=argmin,
            max_slowdown=max_slowdown,
            switch_latency_s=switch_latency_s,
            p_block_w=p_block_w,
            unit_time_s=unit_time_s,
            out_dir=None if out_dir is None else Path(out_dir),
            plot=plot,
        )
        profile = ProfileConfig(
            freqs_mhz=None if freqs_mhz is None else tuple(freqs_mhz),
            warmup_iterations=warmup_iterations,
            settle_iterations=settle_iterations,
            iterations_per_freq=iterations_per_freq,
            max_iterations_per_freq=max_iterations_per_freq,
            target_error=target_error,
            stop_after_rises=stop_after_rises,
        )
        layout = {"schedule": schedule, "num_chunks": num_chunks, "placement": placement}
        self._setup(
            spec,
            profile,
            ApplyConfig(prefetch=prefetch, threaded=threaded, check_rounds=check_rounds),
            run,
            layout_given={name for name, value in layout.items() if value is not None},
        )

    @classmethod
    def from_config(
        cls,
        spec: PlanSpec,
        *,
        profile: ProfileConfig | None = None,
        apply: ApplyConfig | None = None,
        run: RunConfig | None = None,
    ) -> Session:
        """A session from configuration objects instead of the flat keywords.

        Args:
            spec: The workload and the planning choices. Its layout (schedule, chunks,
                placement) counts as given: a saved plan must match it.
            profile: How to profile; default: :class:`ProfileConfig`'s defaults.
            apply: How to apply a plan; default: :class:`ApplyConfig`'s defaults.
            run: How the session runs (mode, device, ranks); default: :class:`RunConfig`'s.
        """
        session = cls.__new__(cls)
        session._setup(
            spec,
            profile or ProfileConfig(),
            apply or ApplyConfig(),
            run or RunConfig(),
            layout_given=set(_LAYOUT),
        )
        return session

    def _setup(
        self,
        spec: PlanSpec,
        profile: ProfileConfig,
        apply: ApplyConfig,
        run: RunConfig,
        *,
        layout_given: set[str],
    ) -> None:
        """Every attribute, in one place (what ``__enter__`` opens starts as ``None``)."""
        self.mode = run.mode
        self.spec = spec
        self.profile_config = profile
        self.apply_config = apply
        self.run_config = run
        self._layout_given = layout_given
        self._coordinator = run.coordinator
        self._clock = run.clock or time.perf_counter
        # what __enter__ opens
        self.stage = -1
        self.rank = 0
        self.device: Device | None = None
        self.control: ControlSession | None = None
        self.controller: FrequencyController | None = None
        self.sampler: DeviceSampler | None = None
        """Reads the device off the training thread (profile attribution, the closed loop)."""
        self._own_backend: Backend | None = None
        self._progress = Progress(False)
        # what the phases did
        self._phase: Phase = Idle(NOT_STARTED)
        self._profiling: ProfilePhase | None = None
        self._applying: ApplyPhase | None = None
        self._plan_future: Future | None = None
        self._active = False  # inside the with block (the hooks refuse to run otherwise)
        self._started = False  # start_iteration ran for the current iteration
        self._warned = False
        self.iteration = 0
        self.plan: FrequencyPlan | None = None
        self.apply_started_iteration: int | None = None
        self.outcome: PlanningOutcome | None = None
        """What rank 0 sent at the end of profiling (plan, planner summary, or why none)."""
        self.overlap = Overlap()
        """Overlap plans' runtime (:mod:`powerlib.runtime.launch_control`); inactive without one."""
        self._replanner: Replanner | None = None
        self._replanning: Replanning | None = None
        self._planner_thread: ThreadPoolExecutor | None = None
        self.replans: list[dict[str, Any]] = []
        """Each re-plan this session switched to: iteration, deadline, policy, saving."""
        self.realized: Realized | None = None
        """What the plan achieved, measured by the closed loop (rank 0 judged it)."""
        self._measuring: MeasureOnly | None = None
        self._closed_logged = False

    @property
    def phase(self) -> str:
        """``not started``, ``profile``, ``awaiting-plan``, ``apply``, ``done`` or ``closed``."""
        return self._phase.phase

    @property
    def profiling(self) -> ProfilePhase | None:
        """The profile phase (its sweep and recorder), once the session profiles."""
        return self._profiling

    @property
    def recorder(self) -> ProfileRecorder:
        """What profiling recorded (empty when the session did not profile)."""
        return self._profiling.recorder if self._profiling is not None else ProfileRecorder()

    @property
    def first_apply_requests(self) -> list[tuple[InstructionKey, float]]:
        """Every clock the first (checked) applied iteration requested, in order."""
        return self._applying.first_requests if self._applying is not None else []

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Session:
        if self.phase != NOT_STARTED:
            raise InvalidArgumentError(
                "this session was already entered"
                + (" and has ended" if self.phase == CLOSED else " and is running")
                + "; a session is entered once: make a new one with powerlib.optimize(...)"
            )
        try:
            if self.run_config.disabled:
                self._open_disabled()
            else:
                self._open_session()
                assert self.control is not None and self.device is not None
                claim_device(self.control, self.device)
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
        self._close()

    def _open_session(self) -> None:
        run = self.run_config
        settings = run.settings or Settings.from_env()
        coordinator = self._join_job()
        backend, device = self._open_device(settings)
        check_control(backend, device)  # one line, before any lock or journal (real-gpu.md §5)
        idle_power_w = device.read_state().power_w  # before any change
        self.control = control = ControlSession(
            backend, guardian=run.guardian, force=run.force, warn=False
        ).start()
        self.controller = FrequencyController(
            control, device, threaded=self.apply_config.threaded, clock=self._clock
        )
        # On a GPU, clock changes wait for a marker on the stream (no synchronize in a hook).
        self.controller.marker = cuda_marker("auto")
        self.sampler = DeviceSampler(device, clock=self._clock)
        if self.mode in ("auto", "profile"):
            self._profiling = ProfilePhase(
                self.profile_config,
                stage=self.stage,
                device=device,
                controller=self.controller,
                sampler=self.sampler,
                stamps=Stamps(self._clock, self.controller.marker),
                coordinator=coordinator,
                clock=self._clock,
                idle_power_w=idle_power_w,
                progress=self._progress,
                on_finished=self._profiled,
                on_refused=self._disable,
            )
            self._phase = self._profiling
            return
        payload: dict[str, Any] = {"stage": self.stage}
        if self.mode == "plan":
            payload["profile_path"] = str(run.profile_path)
        else:
            payload["plan_path"] = str(run.plan_path)
        # a bad plan or profile fails here, before any change
        self._await(coordinator.exchange(payload, self._plan_fn), strict=True)

    def _join_job(self) -> Coordinator:
        """The job's coordinator, this rank, its stage and its progress channel."""
        run = self.run_config
        coordinator = self._coordinator or default_coordinator()
        self._coordinator = coordinator
        self.rank = coordinator.rank
        self.stage = run.resolve_stage(coordinator, self.spec.num_stages)
        self._progress = Progress(self.rank == 0 if run.progress is None else run.progress)
        return coordinator

    def _open_device(self, settings: Settings) -> tuple[Backend, Device]:
        """The backend (opened here unless given) and this rank's device."""
        run = self.run_config
        backend = run.backend
        if not isinstance(backend, Backend):
            backend = open_backend(backend, settings)
            self._own_backend = backend
        self.device = run.select_device(backend, settings)  # docs/real-gpu.md §4
        return backend, self.device

    def _open_disabled(self) -> None:
        """``enabled=False``: read the device if it can be read; change nothing, lock nothing."""
        run = self.run_config
        settings = run.settings or Settings.from_env()
        self._join_job()
        try:
            _, device = self._open_device(settings)
            self.sampler = DeviceSampler(device, clock=self._clock)
        except PowerlibError as err:
            # only what was named explicitly fails: measuring never breaks training (§7)
            opened = isinstance(run.backend, Backend) or self._own_backend is not None
            named = isinstance(run.backend, Backend) or (run.backend or settings.backend) != "auto"
            if (named and not opened) or (opened and run.device is not None):
                raise
            warn_no_device(f"disabled session: {err}")
        self._measuring = MeasureOnly(self.sampler, self._clock)
        self._phase = self._measuring
        self._progress.say("disabled: measuring only, no device is changed")

    def _refuse_outside(self, call: str) -> None:
        """Raise: a hook was called before ``__enter__`` or after ``__exit__``."""
        when = "before it was entered" if self.phase == NOT_STARTED else "after it ended"
        raise InvalidArgumentError(
            f"session.{call}() was called {when}: call the session's hooks inside "
            "`with powerlib.optimize(...) as session:`"
        )

    def _close(self) -> None:
        self._active = False
        _ACTIVE_SESSIONS.discard(self)
        if self._replanning is not None:
            self._replanning.cancel()
            self._replanning = None
        if self._planner_thread is not None:
            self._planner_thread.shutdown(wait=False, cancel_futures=True)
            self._planner_thread = None
        if self.controller is not None:
            self.controller.close()
        if self._profiling is not None:
            self._profiling.close()
        if self.sampler is not None:
            self.sampler.close()
        if self.control is not None:
            self.control.close()
        if self._own_backend is not None:
            self._own_backend.close()
            self._own_backend = None
        if self.phase != NOT_STARTED:
            self._phase = Idle(CLOSED)
        if self.realized is not None and self.rank == 0 and not self._closed_logged:
            self._closed_logged = True
            logger.info("powerlib: %s", self.realized.line())

    def set_layout(
        self,
        *,
        schedule: str | None = None,
        num_chunks: int | None = None,
        placement: str | None = None,
    ) -> None:
        """Describe the pipeline the hooks will see (integrations call it when they attach).

        Args:
            schedule: See :class:`Session`; ``recorded`` for orders with no built-in generator.
            num_chunks: Model chunks per stage.
            placement: ``looped`` or ``v``.

        Raises:
            InvalidArgumentError: An instruction already ran, or the layout is invalid.
            PlanError: The saved plan being applied was made for another layout (nothing was
                changed).
        """
        if self.iteration or self._phase.position:
            raise InvalidArgumentError("set_layout must be called before the first instruction")
        changes = {"schedule": schedule, "num_chunks": num_chunks, "placement": placement}
        given: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
        try:
            self.spec = dataclasses.replace(self.spec, **given)
        except PlanError as err:
            raise InvalidArgumentError(str(err)) from None
        self._layout_given |= set(given)
        if self.mode == "apply" and self.plan is not None:
            try:
                self.spec.check_saved_plan(self.plan, self._layout_given)
            except PlanError:
                self.plan, self._applying = None, None  # nothing was applied
                self._phase = Idle(DONE)
                raise

    # -- hooks -----------------------------------------------------------------------------------

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
        if self._phase.position == 0 and (not self._started or self._phase.wants_start):
            self.start_iteration()
        phase = self._phase
        if self.overlap.schedule is None and isinstance(phase, Idle):
            return
        try:
            if self.overlap.schedule is not None:
                self.overlap.begin(kind, microbatch, chunk)
            phase.begin(kind, microbatch, chunk)
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
        try:
            self.overlap.end()
            self._phase.end()
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
            if self._replanning is not None and self._applying is not None:
                self._switch_replanned()
            self._phase.start_iteration()
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
            self._phase.step()
            self.overlap.step()
        except PowerlibError as err:
            self._hook_failed("step", err)
        self.iteration += 1
        # Agree and set the clock for the next iteration now, at the iteration boundary: a
        # collective inside the next begin hook could deadlock against a rank that waits in a
        # pipeline receive before its own first begin.
        self._started = False
        self.start_iteration()

    def _hook_failed(self, hook: str, err: PowerlibError) -> None:
        """A hook met a device or measurement error: this rank fails; nothing is raised."""
        self._disable(f"stage {self.stage}: {type(err).__name__} in session.{hook}(): {err}")

    def _disable(self, reason: str, *, job_wide: bool = False) -> None:
        """Stop managing the device: clocks reset, one warning.

        Args:
            reason: One line.
            job_wide: Every rank gets the same reason (rank 0's planning verdict, the closed
                loop's, or a failure a rank reported through a collective): only rank 0 warns,
                the others log it. Otherwise it is this rank's own failure (a refused or
                failed clock change, an error in a hook): the controller stops (clocks reset,
                no more requests); while the job still expects this rank in a collective (the
                sweep's votes, the plan's arrival, the closed loop's exchange) the phase stays,
                marked failed, and the failure stops every rank there with rank 0's one warning
                (docs/real-gpu.md §3); with none left, this rank stops alone and warns.
        """
        if not job_wide:
            if self._failure is None:
                self._failure = reason
                if self.controller is not None:
                    self.controller.stop()
            if self._fail_in_phase(reason):
                logger.info("powerlib: %s; every rank stops at the next agreement", reason)
                return
            reason = (
                f"{reason}; this rank's GPU was reset to its baseline clocks and powerlib "
                "leaves it alone; training continues"
            )
        if self.controller is not None:
            self.controller.reset()
        self._stopped(reason, job_wide=job_wide)

    def _stopped(self, reason: str, *, job_wide: bool = False) -> None:
        """The session manages nothing more (the clocks are already reset); warn once.

        While the closed loop still measures, the phase stays: the other ranks will gather
        every rank's windows, so this rank keeps counting iterations and sends its part (as
        stopped), and the verdict reverts the plan everywhere (no rank waits in a collective
        this one skipped). A failure (:meth:`_disable`) keeps the profile sweep and the plan's
        arrival the same way.
        """
        if not (isinstance(self._phase, ClosedLoop) and self._phase.pending):
            self._phase = Idle(DONE)
        if not self._warned:
            self._warned = True
            message = f"powerlib: {reason}"
            if job_wide and self.rank != 0:
                logger.info(message)
                return
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def report(self) -> dict[str, Any]:
        """What this session did, as JSON data."""
        applied = self.controller.applied if self.controller is not None else []
        return {
            "stage": self.stage,
            "phase": self.phase,
            "iterations": self.iteration,
            "apply_started_iteration": self.apply_started_iteration,
            "profiled_freqs_mhz": sorted(
                {r.freq_mhz for r in self.recorder.rows(self.stage)}, reverse=True
            ),
            "measured_p_block_w": self.recorder.p_block_w,
            "frequency_changes": len(applied),
            "plan": None if self.plan is None else dict(self.plan.summary),
            "replans": list(self.replans),
            "overlap": self.overlap.report() if self.overlap.schedule is not None else None,
            "measured_latency_s": None if self._profiling is None else self._profiling.latency_s,
            "realized": None if self.realized is None else self.realized.to_json(),
            "predicted": None
            if self.outcome is None or self.outcome.prediction is None
            else self.outcome.prediction.to_json(),
            "disabled": None if self._measuring is None else self._measuring.measured(),
        }


optimize = Session
"""``with powerlib.optimize(num_stages=..., num_microbatches=...) as session:`` makes a
:class:`Session` (its keywords are documented there)."""
