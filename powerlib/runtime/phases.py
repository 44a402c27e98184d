"""What the session hands its instruction hooks to, and the names of instruction kinds.

A session runs one phase object at a time (:class:`Phase`): the
:class:`~powerlib.runtime.profile_phase.ProfilePhase` while it profiles, :class:`Waiting` while
rank 0 plans, the :class:`~powerlib.runtime.apply_phase.ApplyPhase` while a plan runs, and
:class:`Idle` before, after, or once it stopped managing the device. A rank whose device failed
keeps its phase object, marked failed, for as long as the other ranks still expect it in a
collective (docs/real-gpu.md §3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from powerlib.errors import InvalidArgumentError
from powerlib.planning.pipeline import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD

__all__ = ["CLOSED", "DONE", "NOT_STARTED", "Idle", "Phase", "Waiting", "instruction_kind"]

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

# what ``Session.phase`` says when no phase object runs the hooks
NOT_STARTED = "not started"
DONE = "done"  # nothing more to do (profile mode finished, or disabled after a problem)
CLOSED = "closed"


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


class Phase(Protocol):
    """What the session hands its hooks to."""

    @property
    def phase(self) -> str:
        """What ``Session.phase`` reports while this phase runs."""
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

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """Nothing to do."""

    def end(self) -> None:
        """Nothing to do."""

    def step(self) -> None:
        """Nothing to do."""

    def start_iteration(self) -> None:
        """Nothing to do."""


class Waiting(Idle):
    """Rank 0's planning outcome is on its way: every iteration start asks for it again."""

    wants_start = True

    def __init__(self, retry: Callable[[], None]) -> None:
        super().__init__("awaiting-plan")
        self._retry = retry

    def start_iteration(self) -> None:
        """Ask the coordinator whether the outcome has arrived."""
        self._retry()
