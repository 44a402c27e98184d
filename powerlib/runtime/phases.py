"""The session's phases (:class:`SessionPhase`), what its hooks go to, and instruction kinds.

A session hands its instruction hooks to one :class:`Runner` at a time, the one its flow
(:mod:`powerlib.runtime.flow`) is at: the
:class:`~powerlib.runtime.profile_phase.ProfilePhase` while it profiles, :class:`Idle` in
:attr:`SessionPhase.AWAITING_PLAN` while rank 0 plans, the
:class:`~powerlib.runtime.apply_phase.ApplyPhase` (inside the
:class:`~powerlib.runtime.closed_loop.ClosedLoop` while it is checked) while a plan runs, and
:class:`Idle` before, after, or once it stopped managing the device. A rank whose device failed
keeps its runner, marked failed, for as long as the other ranks still expect it in a
collective (docs/real-gpu.md §3).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

from powerlib.errors import InvalidArgumentError
from powerlib.planning.pipeline import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD

__all__ = ["Awaiting", "Idle", "RankFailure", "Runner", "SessionPhase", "instruction_kind"]

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


class SessionPhase(str, enum.Enum):
    """Where a session is (``Session.phase``); each member equals its string for users."""

    NOT_STARTED = "not started"
    PROFILE = "profile"
    AWAITING_PLAN = "awaiting-plan"
    CHECK = "check"
    """The closed loop alternates all-max and plan windows (the plan is applied in between)."""
    APPLY = "apply"
    DONE = "done"
    """Nothing more to do: profile mode finished, or the session stopped managing the device."""
    CLOSED = "closed"
    DISABLED = "disabled"
    """``enabled=False``: the hooks measure every iteration, no device is changed."""

    def __str__(self) -> str:
        return self.value


def instruction_kind(kind: str) -> str:
    """The kind's canonical name (``F``, ``fwd`` ... are accepted).

    Raises:
        InvalidArgumentError: An unknown kind.
    """
    try:
        return _KINDS[kind]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            "instruction kind must be forward, backward, backward_input or backward_weight "
            f"(or F/B/I/W), got {kind!r}"
        ) from None


class RankFailure(Exception):
    """This rank stops managing its device: the one way a failure reaches the session's flow.

    Raised into the flow (:meth:`Flow.fail <powerlib.runtime.flow.Flow.fail>`) by the hooks (a
    device or measurement error inside one) and by the phases (a refused clock change, a read
    that raised, a loop off the plan's order); the flow handles it where it is
    (docs/real-gpu.md §3).

    Args:
        reason: One line: what failed, on which stage.
        off_order: The training loop does not run the plan's instruction order (the clocks
            were reset; the device did not fail).
    """

    def __init__(self, reason: str, *, off_order: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.off_order = off_order

    @classmethod
    def in_hook(cls, stage: int, hook: str, err: Exception) -> RankFailure:
        """A device or measurement error inside ``session.<hook>()`` (docs/real-gpu.md §3)."""
        return cls(f"stage {stage}: {type(err).__name__} in session.{hook}(): {err}")


class Runner(Protocol):
    """What the session hands its hooks to."""

    @property
    def phase(self) -> SessionPhase:
        """What ``Session.phase`` reports while this runner has the hooks."""
        ...

    @property
    def wants_start(self) -> bool:
        """The next ``begin`` must call ``start_iteration`` first (an agreement is pending)."""
        ...

    @property
    def position(self) -> int:
        """Instructions begun in this iteration."""
        ...

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """An instruction starts (``kind`` is canonical)."""
        ...

    def end(self) -> None:
        """The instruction begun last ends."""
        ...

    def step(self) -> None:
        """The iteration ended."""
        ...

    def start_iteration(self) -> None:
        """The next iteration is about to start: resolve what the ranks agreed."""
        ...


class Idle:
    """No phase runs the hooks: before the session, after it, or once it stopped managing."""

    wants_start = False
    position = 0

    def __init__(self, phase: SessionPhase) -> None:
        self.phase = phase

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """Nothing to do."""

    def end(self) -> None:
        """Nothing to do."""

    def step(self) -> None:
        """Nothing to do."""

    def start_iteration(self) -> None:
        """Nothing to do."""


class Awaiting(Idle):
    """Rank 0's outcome is on its way: every iteration start asks for it again (``tick``)."""

    wants_start = True

    def __init__(self, tick: Callable[[], None]) -> None:
        super().__init__(SessionPhase.AWAITING_PLAN)
        self._tick = tick

    def start_iteration(self) -> None:
        """Ask whether the outcome has arrived."""
        self._tick()
