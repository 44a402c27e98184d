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

The hooks (``begin``, ``end``, ``instruction``, ``start_iteration``, ``step``; the
:class:`~powerlib.runtime.hooks.Hooks` half of the session) never let a device or measurement
error out into the training loop (docs/real-gpu.md §3); optional packages follow the
instructions through listeners (:meth:`Session.add_instruction_listener`,
:mod:`powerlib.runtime.listeners`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from powerlib.backend import Backend
from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError, PowerlibError
from powerlib.measurement.exporter_metrics import StageGauges, publish_stages
from powerlib.measurement.markers import Stamps, cuda_marker
from powerlib.measurement.reader import warn_no_device
from powerlib.measurement.sampler import DeviceSampler
from powerlib.planning.pipeline import InstructionKey
from powerlib.planning.plan import FrequencyPlan
from powerlib.profiling.sweep import ProfileRecorder
from powerlib.progress import Progress
from powerlib.registry import open_backend
from powerlib.runtime.apply_phase import ApplyConfig, ApplyPhase
from powerlib.runtime.closed_loop import MeasureOnly
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import Coordinator, Future, default_coordinator
from powerlib.runtime.hooks import Hooks
from powerlib.runtime.listeners import InstructionListener, Listeners
from powerlib.runtime.options import RunConfig, check_control, claim_device
from powerlib.runtime.phases import (
    CLOSED,
    NOT_STARTED,
    Idle,
    Phase,
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

__all__ = ["Session", "optimize"]

logger = logging.getLogger(__name__)

_LAYOUT = ("schedule", "num_chunks", "placement")

_ACTIVE_SESSIONS: weakref.WeakSet[Session] = weakref.WeakSet()


def active_sessions() -> list[Session]:
    """The sessions inside their ``with`` block in this process (the exporter publishes them)."""
    return list(_ACTIVE_SESSIONS)


def _stage_gauges() -> list[StageGauges]:
    """Each running session's saving (planned, measured) and clock, for the exporter (measurement.md §7)."""
    out = []
    for s in active_sessions():
        summary = s.outcome.summary if s.outcome is not None else None
        pct = ((summary or {}).get("realized") or {}).get("saving_percent")
        measured = s.realized if s.realized is not None and s.realized.rounds > 0 else None
        out.append(
            StageGauges(
                stage=s.stage,
                saving_ratio=pct / 100.0 if isinstance(pct, (int, float)) else None,
                sm_freq_mhz=s.controller.last_requested if s.controller is not None else None,
                measured_saving_ratio=None if measured is None else measured.saving_percent / 100.0,
                verdict=None if measured is None else measured.verdict,
            )
        )
    return out


publish_stages(_stage_gauges)


class Session(Hooks, PlanFlow):
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
        listeners: Instruction listeners to register before the session starts (see
            :meth:`add_instruction_listener`; Kareus:
            ``[powerlib.kareus.launch.LaunchControl(...)]``).
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
        listeners: Sequence[InstructionListener] = (),
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
            listeners=tuple(listeners),
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
        self._listeners = Listeners(run.listeners)
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
        try:
            if exc_type is None:  # a short run: rank 0 says how far it got (PlanFlow)
                self._ended_before_plan()
        finally:
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

    def _close(self) -> None:
        self._active = False
        _ACTIVE_SESSIONS.discard(self)
        self._listeners.close()
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
