"""The session: one ``with`` block around a training loop that profiles, plans and applies.

::

    with powerlib.optimize(num_stages=4, num_microbatches=8) as session:
        for batch in loader:
            for kind, mb in my_pipeline_order():          # whatever the loop runs
                with session.instruction(kind, microbatch=mb):
                    run(kind, mb)
            session.step()                                # end of one iteration

Phases (``mode``):

- ``profile``: warm-up, then a frequency sweep from high to low (``powerlib.profiling.sweep``);
  every instruction's time (after a device sync) and energy (counter delta, or integrated power)
  is recorded; rank 0 merges the ranks' profiles and writes ``profile.csv``; clocks are released.
- ``plan``: rank 0 plans from a saved profile (``profile_path``), then the plan is applied.
- ``apply``: a saved plan (``plan_path``) is applied.
- ``auto`` (default): profile, plan, apply, in that order.

In the apply phase the begin hook hands the planned frequency of the instruction to a per-device
:class:`~powerlib.runtime.controller.FrequencyController` and returns; the first applied
iteration is checked against the plan's instruction order, and a mismatch warns once, resets the
clocks and leaves training alone. Every change goes through a
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

A Kareus overlap plan (instructions with ``execution``/``overlap`` fields) also loads
:attr:`Session.overlap` (:class:`~powerlib.runtime.launch_control.Overlap`) for this rank's stage when
the plan arrives: the session's instruction hooks drive it, so an integration asks
``session.overlap.config(key)`` or wraps partitions in ``session.overlap.partition(...)`` and gets
the running instruction's settings. Its instruction-order check is its own: a loop that does not
follow the plan sends every partition down the default path, whatever the clocks do.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.device import Backend, Device
from powerlib.errors import DeviceBusyError, InvalidArgumentError, PlanError, PowerlibError
from powerlib.planning.pipeline import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from powerlib.planning.plan import FrequencyPlan
from powerlib.profiling.meter import EnergyMeter
from powerlib.profiling.sweep import FrequencySweep, ProfileRecorder, SweepConfig
from powerlib.registry import open_backend
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import Coordinator, Future, default_coordinator
from powerlib.runtime.launch_control import Overlap, plan_has_overlap
from powerlib.runtime.planning_step import (
    PlanningOutcome,
    PlanSpec,
    make_plan,
    rows_to_payload,
    write_profile,
)

__all__ = ["MODES", "Session", "optimize"]

logger = logging.getLogger(__name__)

MODES = ("auto", "profile", "plan", "apply")

_KINDS = {
    FORWARD: FORWARD,
    BACKWARD: BACKWARD,
    BACKWARD_INPUT: BACKWARD_INPUT,
    BACKWARD_WEIGHT: BACKWARD_WEIGHT,
    "F": FORWARD,
    "B": BACKWARD,
    "I": BACKWARD_INPUT,
    "W": BACKWARD_WEIGHT,
    "f": FORWARD,
    "b": BACKWARD,
    "i": BACKWARD_INPUT,
    "w": BACKWARD_WEIGHT,
    "fwd": FORWARD,
    "bwd": BACKWARD,
}

# phases
_NOT_STARTED = "not started"
_PROFILE = "profile"
_AWAIT = "awaiting-plan"
_APPLY = "apply"
_DONE = "done"  # nothing more to do (profile mode finished, or disabled after a problem)
_CLOSED = "closed"


def _kind(kind: str) -> str:
    try:
        return _KINDS[kind]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            "instruction kind must be forward, backward, backward_input or backward_weight "
            f"(or F/B/I/W), got {kind!r}"
        ) from None


def _default_sync() -> Callable[[], None]:
    """``torch.cuda.synchronize`` when torch is already imported and CUDA is initialised."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.synchronize
    return lambda: None


class Session:
    """Profile -> plan -> apply around a training loop. Use :func:`optimize` to make one.

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
        device: The device (index, id or :class:`Device`); default ``LOCAL_RANK`` or 0.
        policy: ``fastest`` (no slowdown), ``deadline`` or ``min-energy``.
        deadline_s: Straggler iteration time T′ for ``deadline``.
        deadline_ratio: T′ as a multiple of the all-max iteration time.
        argmin: The paper's emulation rule for ``deadline``.
        max_slowdown: Realized-slowdown guard for ``fastest`` and ``deadline`` (fraction;
            default 0.1 %).
        switch_latency_s: Clock-change latency the guard plans for (default 5 ms).
        p_block_w: Blocking power; default: measured between instructions while profiling.
        unit_time_s: Planner time unit; default: from the profile.
        profile_path: The profile to plan from (``plan`` mode).
        plan_path: The plan to apply (``apply`` mode).
        out_dir: Where rank 0 writes profile, frontier, plan and summary; ``None``: nowhere.
        freqs_mhz: Profile candidates; default: every supported clock from the top down.
        warmup_iterations: Discarded iterations at the highest frequency.
        settle_iterations: Discarded iterations after each clock change.
        iterations_per_freq: Measured iterations per frequency.
        stop_after_rises: Stop the sweep after this many frequencies of rising energy.
        coordinator: How ranks agree; default ``torch.distributed`` if initialised, else alone.
        clock: Time source in seconds; default ``time.perf_counter``.
        sync: Waits for the device before a time is read; default ``torch.cuda.synchronize``
            when CUDA is in use, else nothing.
        threaded: Apply frequencies on a controller thread (default) or inline (emulator).
        progress: Print progress to stderr; default on rank 0 only.
        guardian: Start the watchdog process that restores the device if this process is killed.
        prefetch: In the apply phase, request the next instruction's clock when one ends, so the
            switch overlaps the wait between instructions (after the order check).
        plot: Rank 0 also draws ``frontier.png`` in ``out_dir`` (``plot`` extra).
        overlap_groups: For overlap plans on NCCL: the global ranks of every group the overlapped
            collectives run on (every tensor/context-parallel group of the job, the same lists on
            every rank); default: the whole world. See :mod:`powerlib.runtime.launch_control`.
        settings: Settings; default from the environment.
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
        switch_latency_s: float = 0.005,
        p_block_w: float | None = None,
        unit_time_s: float | None = None,
        profile_path: str | Path | None = None,
        plan_path: str | Path | None = None,
        out_dir: str | Path | None = "powerlib-out",
        freqs_mhz: Sequence[float] | None = None,
        warmup_iterations: int = 2,
        settle_iterations: int = 1,
        iterations_per_freq: int = 2,
        stop_after_rises: int = 3,
        coordinator: Coordinator | None = None,
        clock: Callable[[], float] | None = None,
        sync: Callable[[], None] | None = None,
        threaded: bool = True,
        progress: bool | None = None,
        guardian: bool = False,
        prefetch: bool = True,
        plot: bool = False,
        overlap_groups: Sequence[Sequence[int]] | None = None,
        settings: Settings | None = None,
    ) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "plan" and profile_path is None:
            raise InvalidArgumentError("mode 'plan' needs profile_path (a saved profile)")
        if mode == "apply" and plan_path is None:
            raise InvalidArgumentError("mode 'apply' needs plan_path (a saved plan)")
        self.mode = mode
        self._coordinator = coordinator
        self._settings = settings
        self._backend_arg = backend
        self._device_arg = device
        self._stage_arg = stage
        self._profile_path = profile_path
        self._plan_path = plan_path
        self._clock = clock or time.perf_counter
        self._sync_arg = sync
        self._threaded = threaded
        self._progress_arg = progress
        self._guardian = guardian
        self._prefetch = prefetch
        self._sweep_args = {
            "warmup_iterations": warmup_iterations,
            "settle_iterations": settle_iterations,
            "iterations_per_freq": iterations_per_freq,
            "stop_after_rises": stop_after_rises,
        }
        self._freqs_arg = freqs_mhz
        layout = {"schedule": schedule, "num_chunks": num_chunks, "placement": placement}
        self._layout_given = {name for name, value in layout.items() if value is not None}
        self.spec = PlanSpec(
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
        SweepConfig(freqs_mhz=freqs_mhz or (1.0,), **self._sweep_args)  # validate early
        # set up in __enter__
        self.stage = -1
        self.device: Device | None = None
        self.control: ControlSession | None = None
        self.controller: FrequencyController | None = None
        self.plan: FrequencyPlan | None = None
        self.phase = _NOT_STARTED
        self._active = False  # inside the with block (the hooks refuse to run otherwise)
        self.rank = 0
        self.iteration = 0
        self.recorder = ProfileRecorder()
        self._sample_counts: dict[tuple[str, float], int] = {}
        self._own_backend: Backend | None = None
        self._idle_power_w: float | None = None
        self._meter: EnergyMeter | None = None
        self._sweep: FrequencySweep | None = None
        self._sync: Callable[[], None] = lambda: None
        self._pos = 0
        self._started = False
        self._open: tuple[str, float, float] | None = None
        self._last_end: tuple[float, float] | None = None
        self._iter_energy = 0.0
        self._vote: Future | None = None
        self._plan_future: Future | None = None
        self._locked: float | None = None
        self._freqs: dict[tuple[int, int, int, str], float] = {}
        self._expected: list[tuple[int, int, int, str]] = []
        self._checking = False
        self._warned = False
        self.first_apply_requests: list[tuple[tuple[int, int, int, str], float]] = []
        self._order_now: list[tuple[int, int, str]] = []
        self._recorded_order: list[tuple[int, int, str]] = []
        self.apply_started_iteration: int | None = None
        self.outcome: PlanningOutcome | None = None
        """What rank 0 sent at the end of profiling (plan, planner summary, or why none)."""
        self._overlap_groups = overlap_groups
        self.overlap = Overlap()
        """Overlap plans' runtime (:mod:`powerlib.runtime.launch_control`); inactive without one."""

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Session:
        if self.phase is not _NOT_STARTED:
            raise InvalidArgumentError(
                "this session was already entered"
                + (" and has ended" if self.phase is _CLOSED else " and is running")
                + "; a session is entered once: make a new one with powerlib.optimize(...)"
            )
        try:
            self._open_session()
            self._claim_device()
        except BaseException:
            self._close()
            raise
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()

    def _open_session(self) -> None:
        settings = self._settings or Settings.from_env()
        coordinator = self._coordinator or default_coordinator()
        self._coordinator = coordinator
        self.rank = coordinator.rank
        if self._stage_arg is None:
            if coordinator.world_size != self.spec.num_stages:
                raise InvalidArgumentError(
                    f"{coordinator.world_size} rank(s) but {self.spec.num_stages} stage(s): "
                    "pass stage= (this rank's pipeline stage)"
                )
            self.stage = coordinator.rank
        else:
            self.stage = self._stage_arg
        if not 0 <= self.stage < self.spec.num_stages:
            raise InvalidArgumentError(
                f"stage {self.stage} is out of range for {self.spec.num_stages} stage(s)"
            )
        self._progress = self.rank == 0 if self._progress_arg is None else self._progress_arg
        backend = self._backend_arg
        if not isinstance(backend, Backend):
            backend = open_backend(backend, settings)
            self._own_backend = backend
        if isinstance(self._device_arg, Device):
            self.device = self._device_arg
        else:
            selector = self._device_arg
            if selector is None:
                selector = settings.local_rank or 0
            self.device = backend.device(selector)
        self._idle_power_w = self.device.read_state().power_w  # before any change
        self.control = ControlSession(backend, guardian=self._guardian).start()
        self.controller = FrequencyController(
            self.control, self.device, threaded=self._threaded, clock=self._clock
        )
        self._sync = self._sync_arg or _default_sync()
        if self.mode in ("auto", "profile"):
            supported = self.device.info.supported_sm_freqs_mhz
            if not supported:
                raise InvalidArgumentError(
                    f"{self.device.info.name} cannot lock its SM clock, so it cannot be profiled",
                    device=self.device.device_id,
                )
            freqs = tuple(self._freqs_arg) if self._freqs_arg else tuple(supported)
            config = SweepConfig(freqs_mhz=freqs, **self._sweep_args)
            for f in config.freqs_mhz:
                self.device.validate_sm_clocks(f)
            self._meter = EnergyMeter(self.device, clock=self._clock)
            self._sweep = FrequencySweep(config)
            self.phase = _PROFILE
            self._say(
                f"profiling {len(config.freqs_mhz)} frequencies, {config.freqs_mhz[0]:g}"
                f"-{config.freqs_mhz[-1]:g} MHz, up to {config.max_iterations} iterations"
                + (" (energy integrated from power)" if self._meter.integrated else "")
            )
        else:
            payload: dict[str, Any] = {"stage": self.stage}
            if self.mode == "plan":
                payload["profile_path"] = str(self._profile_path)
            else:
                payload["plan_path"] = str(self._plan_path)
            future = coordinator.exchange(payload, self._plan_fn)
            self.phase = _AWAIT
            self._plan_future = future
            self._try_plan(strict=True)  # a bad plan or profile fails here, before any change

    def _claim_device(self) -> None:
        """Take the device's lock now, so a second session on it fails at its ``with`` line.

        The lock comes with the first change the session journals; without this, that would
        be the first clock change inside a hook, where a busy device can only degrade the
        session (and another session's clocks would be reset under it). Resetting the SM
        clocks is that first change: the baseline every mode starts from, restored at exit.
        Only :class:`DeviceBusyError` is raised; a driver that refuses the reset is left to
        the first clock change, which warns once and leaves training alone.

        Raises:
            DeviceBusyError: Another session, in this process or another, holds the device.
        """
        assert self.control is not None and self.device is not None
        if not self.control.backend.persistent:
            return  # nothing is journaled or locked (the emulator)
        try:
            self.control.reset_sm_clocks(self.device)
        except DeviceBusyError:
            raise
        except PowerlibError as err:
            logger.info("could not reset the clocks of %s at the start: %s", self.device, err)

    def _refuse_outside(self, call: str) -> None:
        """Raise: a hook was called before ``__enter__`` or after ``__exit__``."""
        when = "before it was entered" if self.phase is _NOT_STARTED else "after it ended"
        raise InvalidArgumentError(
            f"session.{call}() was called {when}: call the session's hooks inside "
            "`with powerlib.optimize(...) as session:`"
        )

    def _close(self) -> None:
        self._active = False
        if self.controller is not None:
            self.controller.close()
        if self._meter is not None:
            self._meter.close()
        if self.control is not None:
            self.control.close()
        if self._own_backend is not None:
            self._own_backend.close()
            self._own_backend = None
        if self.phase is not _NOT_STARTED:
            self.phase = _CLOSED

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
        if self.iteration or self._pos:
            raise InvalidArgumentError("set_layout must be called before the first instruction")
        import dataclasses  # noqa: PLC0415

        changes = {"schedule": schedule, "num_chunks": num_chunks, "placement": placement}
        given: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
        try:
            self.spec = dataclasses.replace(self.spec, **given)
        except PlanError as err:
            raise InvalidArgumentError(str(err)) from None
        self._layout_given |= set(given)
        if self.mode == "apply" and self.plan is not None:
            try:
                self._check_workload(self.plan)
            except PlanError:
                self.plan, self.phase, self._checking = None, _DONE, False  # nothing was applied
                raise

    # -- hooks -----------------------------------------------------------------------------------

    def begin(self, kind: str, microbatch: int = 0, chunk: int = 0) -> None:
        """An instruction starts (call right before launching its work).

        Raises:
            InvalidArgumentError: Called outside the session's ``with`` block, or an unknown
                ``kind``.
        """
        if not self._active:
            self._refuse_outside("begin")
        if self._pos == 0 and (not self._started or self._vote is not None or self.phase is _AWAIT):
            self.start_iteration()
        if self.overlap.schedule is not None:
            self.overlap.begin(_kind(kind), microbatch, chunk)
        phase = self.phase
        if phase is _APPLY:
            key = (self.stage, chunk, microbatch, _kind(kind))
            if self._checking:
                self._check(key)
                if self.phase is not _APPLY:
                    return
            freq = self._freqs.get(key)
            if freq is not None:
                self._request(freq)
            self._pos += 1
        elif phase is _PROFILE:
            self._sync()
            t = self._clock()
            e = self._meter.read_j(t)  # type: ignore[union-attr]
            if self._last_end is not None:
                self.recorder.add_gap(t - self._last_end[0], e - self._last_end[1])
            self._open = (_kind(kind), t, e)
            self._order_now.append((chunk, microbatch, self._open[0]))
            self._pos += 1

    def end(self) -> None:
        """The instruction started last ends (call after its work is issued).

        Raises:
            InvalidArgumentError: Called outside the session's ``with`` block.
        """
        if not self._active:
            self._refuse_outside("end")
        self.overlap.end()
        if self.phase is _APPLY:
            if self._prefetch and not self._checking:
                # Ask for the next instruction's clock now: the switch (milliseconds on real
                # drivers) overlaps the wait for the next instruction's input.
                expected = self._expected
                nxt = expected[self._pos] if self._pos < len(expected) else expected[0]
                self._request(self._freqs[nxt])
            return
        if self.phase is not _PROFILE or self._open is None:
            return
        self._sync()
        t = self._clock()
        e = self._meter.read_j(t)  # type: ignore[union-attr]
        kind, t0, e0 = self._open
        self._open = None
        self._last_end = (t, e)
        assert self._sweep is not None
        if self._sweep.measuring:
            freq = self._sweep.freq_mhz
            self.recorder.add(kind, freq, t - t0, e - e0)
            self._sample_counts[(kind, freq)] = self._sample_counts.get((kind, freq), 0) + 1
            self._iter_energy += e - e0

    def _request(self, freq_mhz: float) -> None:
        """Hand a clock to the controller; a repeat of the last request costs nothing."""
        controller = self.controller
        if freq_mhz != controller.last_requested:  # type: ignore[union-attr]
            self._sync()  # the new clock must not land on the previous instruction's work
            controller.request(freq_mhz)  # type: ignore[union-attr]

    @contextlib.contextmanager
    def instruction(self, kind: str, microbatch: int = 0, chunk: int = 0) -> Iterator[None]:
        """``with session.instruction("forward", microbatch=3): ...`` = begin + end.

        Raises:
            InvalidArgumentError: Used outside the session's ``with`` block.
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
        (the emulator, driving every rank from one thread, relies on that).

        Raises:
            InvalidArgumentError: Called outside the session's ``with`` block.
        """
        if not self._active:
            self._refuse_outside("start_iteration")
        self._started = True
        if self.phase is _PROFILE:
            self._advance_sweep()
        if self.phase is _AWAIT:
            self._try_plan(strict=False)

    def step(self) -> None:
        """One training iteration ended (after the optimizer step).

        Raises:
            InvalidArgumentError: Called outside the session's ``with`` block.
        """
        if not self._active:
            self._refuse_outside("step")
        if not self._started:
            self.start_iteration()
        phase = self.phase
        if phase is _APPLY and self._checking:
            if self._pos != len(self._expected):
                self._mismatch(
                    f"the iteration ran {self._pos} instruction(s), the plan has {len(self._expected)}"
                )
            self._checking = False
        elif phase is _PROFILE:
            sweep = self._sweep
            assert sweep is not None
            self._recorded_order, self._order_now = self._order_now, []
            if sweep.measuring:
                self.recorder.add_iteration(sweep.freq_mhz, self._iter_energy)
            if sweep.block_complete_after_this():
                stop = False
                rules = sweep.config.stop_after_rises
                if not sweep.warming_up and rules:
                    rises = self.recorder.energy_rose(sweep.config.freqs_mhz, sweep.freq_mhz)
                    stop = rises >= rules
                self._vote = self._coordinator.all_agree(stop)  # type: ignore[union-attr]
            else:
                sweep.advance()
        self.overlap.step()
        self._iter_energy = 0.0
        self._pos = 0
        self._open = None
        self._last_end = None
        self.iteration += 1
        # Agree and set the clock for the next iteration now, at the iteration boundary: a
        # collective inside the next begin hook could deadlock against a rank that waits in a
        # pipeline receive before its own first begin.
        self._started = False
        self.start_iteration()

    # -- phases ----------------------------------------------------------------------------------

    def _advance_sweep(self) -> None:
        sweep = self._sweep
        assert sweep is not None and self.device is not None
        if self._vote is not None:
            stop = self._vote()
            if stop is None:
                return  # not every rank has voted yet; retried by the next call
            self._vote = None
            before = sweep.freq_mhz
            sweep.advance(bool(stop))
            if sweep.finished:
                if stop:
                    self._say(
                        f"energy per iteration rose for {sweep.config.stop_after_rises} "
                        f"frequencies in a row (down to {before:g} MHz); sweep stopped"
                    )
                self._finish_profile()
                return
            num, total = sweep.position
            self._say(f"profiling at {sweep.freq_mhz:g} MHz ({num}/{total})")
        if self._locked != sweep.freq_mhz:
            if not self.control.apply_sm_clocks(self.device, sweep.freq_mhz):  # type: ignore[union-attr]
                self._disable("the device refused a clock change while profiling")
                return
            self._locked = sweep.freq_mhz

    def _finish_profile(self) -> None:
        assert self.device is not None and self.control is not None
        self.control.reset_sm_clocks(self.device)
        self._locked = None
        payload = {
            "stage": self.stage,
            "rows": rows_to_payload(self.recorder.rows(self.stage)),
            "gap_time_s": self.recorder.gap_time_s,
            "gap_energy_j": self.recorder.gap_energy_j,
            "order": [list(k) for k in self._recorded_order],  # what the loop really ran
            "idle_power_w": self._idle_power_w,
            # how finely the energy counter moved, for the planner's resolution check
            "counter": self._meter.resolution().to_json() if self._meter is not None else None,
            "samples": [[k, f, n] for (k, f), n in self._sample_counts.items()],
        }
        plan_fn = self._profile_only_fn if self.mode == "profile" else self._plan_fn
        self._plan_future = self._coordinator.exchange(payload, plan_fn)  # type: ignore[union-attr]
        self.phase = _AWAIT
        self._try_plan(strict=False)

    def _plan_fn(self, payloads: list[dict[str, Any]]) -> PlanningOutcome:
        return make_plan(self._spec_with_progress(), payloads)

    def _profile_only_fn(self, payloads: list[dict[str, Any]]) -> PlanningOutcome:
        return write_profile(self._spec_with_progress(), payloads)

    def _spec_with_progress(self) -> PlanSpec:
        import dataclasses  # noqa: PLC0415

        return dataclasses.replace(self.spec, progress=self._progress)

    def _try_plan(self, *, strict: bool) -> None:
        assert self._plan_future is not None
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
            self.phase = _DONE
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
        try:
            if self.mode == "apply":
                self._check_workload(plan)
            elif plan.num_stages != self.spec.num_stages:  # pragma: no cover - made for the job
                raise PlanError(
                    f"{plan.source}: the plan has {plan.num_stages} stages, the session has "
                    f"{self.spec.num_stages}"
                )
            if plan_has_overlap(plan):
                # Before any per-rank check: on NCCL this creates communicators, a collective
                # every rank must join at the same point.
                self.overlap.load(plan, self.stage, group_ranks=self._overlap_groups)
            plan.check_frequencies(self.device.info.supported_sm_freqs_mhz, self.stage)  # type: ignore[union-attr]
        except PlanError as err:
            if strict:
                raise
            self._disable(f"the plan cannot be applied: {err}")
            return
        self.plan = plan
        stage_plan = plan.stage(self.stage)
        self._expected = [p.key for p in stage_plan]
        self._freqs = dict(zip(self._expected, (p.freq_mhz for p in stage_plan)))
        self._checking = True
        self.phase = _APPLY
        self.apply_started_iteration = self.iteration
        self._say(
            f"applying the {plan.policy} plan from iteration {self.iteration}"
        )

    def _check_workload(self, plan: FrequencyPlan) -> None:
        """A saved plan must be for this session's workload (the layout where it was given)."""
        spec, given = self.spec, self._layout_given
        plan.check_workload(
            num_stages=spec.num_stages,
            num_microbatches=spec.num_microbatches,
            schedule=spec.schedule if "schedule" in given else None,
            num_chunks=spec.num_chunks if "num_chunks" in given else None,
            placement=spec.placement if "placement" in given else None,
        )

    def _check(self, key: tuple[int, int, int, str]) -> None:
        pos = self._pos
        if pos >= len(self._expected):
            self._mismatch(
                f"instruction {pos} {_fmt(key)} is beyond the plan's {len(self._expected)}"
            )
        elif key != self._expected[pos]:
            self._mismatch(
                f"instruction {pos} is {_fmt(key)}, the plan expects {_fmt(self._expected[pos])}"
            )
        else:
            self.first_apply_requests.append((key, self._freqs[key]))

    def _mismatch(self, detail: str) -> None:
        self._disable(
            f"stage {self.stage}: the training loop does not run the plan's instruction order "
            f"({detail}); clocks reset, training continues unmanaged"
        )

    def _disable(self, reason: str, *, job_wide: bool = False) -> None:
        """Stop managing the device: clocks reset, one warning.

        Args:
            reason: One line.
            job_wide: Every rank gets the same reason (rank 0's planning verdict): only rank 0
                warns, the others log it.
        """
        self.phase = _DONE
        self._checking = False
        if self.controller is not None:
            self.controller.reset()
        if not self._warned:
            self._warned = True
            message = f"powerlib: {reason}"
            if job_wide and self.rank != 0:
                logger.info(message)
                return
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _say(self, message: str) -> None:
        if self._progress:
            print(f"powerlib: {message}", file=sys.stderr, flush=True)

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
            "overlap": self.overlap.report() if self.overlap.schedule is not None else None,
        }


def _fmt(key: tuple[int, int, int, str]) -> str:
    stage, chunk, mb, kind = key
    return f"{kind} mb{mb}" + (f" chunk{chunk}" if chunk else "")


def optimize(**kwargs: Any) -> Session:
    """``with powerlib.optimize(num_stages=..., num_microbatches=...) as session:``.

    Takes the keyword arguments of :class:`Session`.
    """
    return Session(**kwargs)
