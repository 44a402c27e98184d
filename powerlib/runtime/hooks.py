"""The session's hooks: what the training loop and the integrations call inside the block.

:class:`Hooks` is the half of :class:`~powerlib.runtime.session.Session` the training loop talks
to (the session keeps the lifecycle, :class:`~powerlib.runtime.plan_flow.PlanFlow` the moves
from phase to phase; the session mixes both in, so these methods read its attributes):
``begin``, ``end``, ``instruction``, ``start_iteration`` and ``step`` around every instruction
and iteration, each handed to the instruction listeners (:mod:`powerlib.runtime.listeners`) and
then to the phase that runs; ``set_layout`` and ``add_instruction_listener``, which integrations
call when they attach; and what a failure inside a hook does.

The hooks never let a :class:`~powerlib.errors.PowerlibError` out into the training loop: a
device, driver or measurement error inside one (an energy or clock read, a refused or failed
clock change) resets this rank's clocks and stops powerlib job-wide, through the next collective
the ranks share (a failed rank keeps joining them, with a flag that stops every rank at the same
point), with one warning; training continues (docs/real-gpu.md §3). They still raise
:class:`~powerlib.errors.InvalidArgumentError` for a bug in the calling code that is the same on
every rank, before any device work: a hook called outside the ``with`` block, an unknown
instruction kind.

Optional packages follow the instructions through listeners: :meth:`Hooks.add_instruction_listener`
(or the session's ``listeners=``) registers one. Kareus's launch control is one
(``powerlib.kareus.launch.attach(session)``); a plan with per-partition settings that no listener
takes is refused when it is applied (at the ``with`` line for a saved plan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from typing import Any

from powerlib.errors import InvalidArgumentError, PlanError, PowerlibError
from powerlib.planning.plan import FrequencyPlan
from powerlib.runtime.apply_phase import ApplyPhase
from powerlib.runtime.closed_loop import ClosedLoop
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.listeners import InstructionListener, Listeners
from powerlib.runtime.phases import CLOSED, DONE, NOT_STARTED, Idle, Phase, instruction_kind
from powerlib.runtime.planning_step import PlanSpec
from powerlib.runtime.replan import Replanning

__all__ = ["Hooks"]

logger = logging.getLogger("powerlib.runtime.session")


class Hooks:
    """The training loop's side of the session (mixed into it; see the module doc)."""

    # The session's attributes these methods read (Session._setup sets every one).
    _phase: Phase
    _listeners: Listeners
    _active: bool
    _started: bool
    _warned: bool
    _failure: str | None
    _layout_given: set[str]
    _applying: ApplyPhase | None
    _replanning: Replanning | None
    plan: FrequencyPlan | None
    controller: FrequencyController | None
    spec: PlanSpec
    mode: str
    stage: int
    rank: int
    iteration: int

    def _refuse_outside(self, call: str) -> None:
        """Raise: a hook was called before ``__enter__`` or after ``__exit__``."""
        when = "before it was entered" if self.phase == NOT_STARTED else "after it ended"
        raise InvalidArgumentError(
            f"session.{call}() was called {when}: call the session's hooks inside "
            "`with powerlib.optimize(...) as session:`"
        )

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
        if self.phase == CLOSED:
            raise InvalidArgumentError("add_instruction_listener: the session has ended")
        if self.iteration or self._phase.position:
            raise InvalidArgumentError(
                "add_instruction_listener must be called before the first instruction"
            )
        self._listeners.add(listener)
        if self.plan is not None:
            try:
                listener.plan_applied(self.plan, self.stage)
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
        if not self._listeners and isinstance(phase, Idle):
            return
        try:
            self._listeners.begin(kind, microbatch, chunk)
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
            self._listeners.end()
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
            self._listeners.step()
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
                the others log it (DEBUG). Otherwise it is this rank's own failure (a refused or
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
            if self._fail_in_phase(reason):  # rank 0's one warning will name the reason
                logger.debug("powerlib: %s; every rank stops at the next agreement", reason)
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

        One ``RuntimeWarning`` line (``logging.captureWarnings`` turns it into a log record):
        for a job-wide reason on rank 0 only, the other ranks log it at DEBUG.

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
            # One line per job: a warning, not also a log record (frameworks that log at INFO
            # through the root logger, Megatron-LM's, would print both, and every other rank's).
            if job_wide and self.rank != 0:
                logger.debug(message)
                return
            warnings.warn(message, RuntimeWarning, stacklevel=3)
