"""The events that resume a session's lifecycle (:class:`powerlib.runtime.flow.Flow`)."""

from __future__ import annotations

from dataclasses import dataclass

from powerlib.runtime.records import ProfilePayload, Realized, StopPayload

__all__ = ["Event", "Judged", "Profiled", "Tick", "Withdrawn"]


@dataclass(frozen=True, slots=True)
class Tick:
    """An iteration starts while the flow waits for something (the plan, a re-plan)."""


@dataclass(frozen=True, slots=True)
class Profiled:
    """The sweep ended: what this rank sends rank 0."""

    payload: ProfilePayload | StopPayload


@dataclass(frozen=True, slots=True)
class Judged:
    """The closed loop's verdict arrived (rank 0 judged every rank's windows)."""

    realized: Realized


@dataclass(frozen=True, slots=True)
class Withdrawn:
    """The saved plan does not fit the layout an integration stated: nothing is applied."""


Event = Tick | Profiled | Judged | Withdrawn
