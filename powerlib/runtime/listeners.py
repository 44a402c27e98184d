"""Instruction listeners: optional code that follows the session's instructions.

The session's hooks drive its own phase (profile, apply). An optional package that must know
which instruction runs, Kareus's launch control (:mod:`powerlib.kareus.launch`, docs/kareus.md
§3.2: per partition, where its collective starts and on how many SMs), registers a listener with
the session instead of the session importing it: :meth:`Session.add_instruction_listener
<powerlib.runtime.session.Session.add_instruction_listener>`, or the session's ``listeners=``
keyword (docs/architecture.md §1: ``kareus -> runtime``, never the reverse). A listener
gets:

- ``plan_applied(plan, stage)``: the session applies ``plan`` to this rank's ``stage`` (when the
  plan arrives, at a re-plan's switch, or at once when the listener is added to a session that
  already applies one). It returns True when it takes the plan's partition settings. The call
  comes at the same point on every rank, so a listener may make a collective there (Kareus
  creates its SM-limited NCCL communicators).
- ``begin(kind, microbatch, chunk)``, ``end()``, ``step()``: at the session's hooks, before its
  phase sees them, in every phase (a reverted plan resets the clocks; the listener decides what
  it keeps doing).
- ``close()``: the session ended.

**Partition settings** are data of the plan (:class:`~powerlib.planning.plan.PlannedInstruction`:
``execution`` ``nanobatch`` and a launch slot and SM count per partition type, docs/kareus.md
§3.1), which the core cannot carry out. A plan that has them must be taken by a listener when it
is applied. Kareus registers itself for them: when no listener of the session takes a plan's
partition settings, the session asks the entry point ``partitions`` of the group
:data:`ENTRY_POINT_GROUP` (``powerlib.kareus.launch:for_partition_plans`` in powerlib's own
metadata; a plug-in may register another) for one (:func:`registered_listener`), adds it and
hands it the plan. Only if none takes it is the plan refused (:func:`unclaimed_partitions`), at
the ``with`` line for a saved plan (before any change), and never by raising inside the
training loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

from powerlib.errors import InvalidArgumentError, PlanError
from powerlib.planning.plan import FrequencyPlan

__all__ = [
    "ENTRY_POINT_GROUP",
    "InstructionListener",
    "Listeners",
    "plan_has_partitions",
    "registered_listener",
    "unclaimed_partitions",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "powerlib.instruction_listeners"
"""Entry points whose name is a plan feature (``partitions``) and whose value makes a listener."""


class InstructionListener(Protocol):
    """What the session calls on a listener (see the module doc)."""

    def plan_applied(self, plan: FrequencyPlan, stage: int) -> bool:
        """``plan`` is applied to ``stage``: True when the listener takes its partition settings."""
        ...

    def begin(self, kind: str, microbatch: int, chunk: int) -> object:
        """An instruction starts (``kind`` already checked by the session)."""
        ...

    def end(self) -> object:
        """The instruction started last ends."""
        ...

    def step(self) -> object:
        """The iteration ends."""
        ...

    def close(self) -> object:
        """The session ended."""
        ...


def plan_has_partitions(plan: FrequencyPlan) -> bool:
    """Whether any instruction of any stage runs nanobatched, with partition settings."""
    return any(p.execution == "nanobatch" for stage in plan.stages for p in stage)


def registered_listener(feature: str) -> InstructionListener | None:
    """A new listener from the package registered for ``feature`` of a plan, or ``None``.

    Looked up by name in the entry-point group :data:`ENTRY_POINT_GROUP` (no module is named
    here: the core never imports Kareus). A registration that fails to load or build is logged
    and counts as none: the plan is then refused, the job is never stopped.
    """
    from importlib import metadata  # noqa: PLC0415 - only for a plan that needs it (13 ms)

    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name != feature:
            continue
        try:
            return entry.load()()  # type: ignore[no-any-return]
        except Exception as err:  # noqa: BLE001 - a broken plug-in refuses the plan, not the job
            logger.warning(
                "powerlib: the %s listener %s failed to load: %s", feature, entry.value, err
            )
            return None
    return None


def unclaimed_partitions(plan: FrequencyPlan) -> str:
    """The one line a session refuses a plan with when no listener takes its partition settings."""
    return (
        f"{plan.source}: the plan sets per-partition launch points and SM counts (a Kareus plan), "
        "but nothing on this session carries them out: no listener took them and none is "
        f"registered under the entry point {ENTRY_POINT_GROUP}:partitions (is powerlib installed "
        "with pip, not only on the path?); attach one before the plan is applied "
        "(powerlib.kareus.launch.attach(session))"
    )


class Listeners:
    """The session's listeners, called in the order they were added.

    Args:
        listeners: The first ones (the session's ``listeners=`` keyword).

    Raises:
        InvalidArgumentError: The same listener twice.
    """

    def __init__(self, listeners: Iterable[InstructionListener] = ()) -> None:
        self._all: list[InstructionListener] = []
        for listener in listeners:
            self.add(listener)

    def __bool__(self) -> bool:
        return bool(self._all)

    def __iter__(self) -> Iterator[InstructionListener]:
        return iter(tuple(self._all))

    def add(self, listener: InstructionListener) -> None:
        """One more listener (it gets no plan here: the session hands it the one it applies).

        Raises:
            InvalidArgumentError: ``listener`` lacks a hook, or was added already.
        """
        missing = [
            name
            for name in ("plan_applied", "begin", "end", "step", "close")
            if not callable(getattr(listener, name, None))
        ]
        if missing:
            raise InvalidArgumentError(
                f"an instruction listener needs {', '.join(missing)}(); "
                f"{type(listener).__name__} has none"
            )
        if any(listener is other for other in self._all):
            raise InvalidArgumentError("this instruction listener was added to the session already")
        self._all.append(listener)

    def discard(self, listener: InstructionListener) -> None:
        """Forget ``listener`` (if it is here)."""
        self._all = [other for other in self._all if other is not listener]

    def plan_applied(self, plan: FrequencyPlan, stage: int) -> bool:
        """Hand every listener ``plan``: True when one of them takes its partition settings."""
        taken = False
        for listener in tuple(self._all):
            taken = bool(listener.plan_applied(plan, stage)) or taken
        return taken

    def hand_plan(self, plan: FrequencyPlan, stage: int) -> None:
        """Hand ``plan`` to the listeners; one must take its partition settings.

        When none of them takes them, the listener registered for ``partitions`` (Kareus's
        launch control, docs/architecture.md §1) is added and handed the plan. Every rank takes
        the same path at the same point: a listener may make a collective.

        Raises:
            PlanError: The plan has partition settings and nothing takes them.
        """
        if self.plan_applied(plan, stage) or not plan_has_partitions(plan):
            return
        listener = registered_listener("partitions")
        if listener is not None:
            self.add(listener)
            if listener.plan_applied(plan, stage):
                return
        raise PlanError(unclaimed_partitions(plan))

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """An instruction starts."""
        for listener in self._all:
            listener.begin(kind, microbatch, chunk)

    def end(self) -> None:
        """The instruction started last ends."""
        for listener in self._all:
            listener.end()

    def step(self) -> None:
        """The iteration ends."""
        for listener in self._all:
            listener.step()

    def close(self) -> None:
        """The session ended: every listener hears it, whatever one of them raises."""
        for listener in tuple(self._all):
            try:
                listener.close()
            except Exception as err:  # noqa: BLE001 - closing the session never fails here
                logger.warning("powerlib: closing %s failed: %s", type(listener).__name__, err)
