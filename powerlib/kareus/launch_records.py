"""What Kareus's launch control did: one record per collective launch, and its report.

:class:`~powerlib.kareus.launch.LaunchControl` keeps a :class:`LaunchRecord` per partition it ran
(``control.records``) and sums them up in a :class:`LaunchReport` (``control.report()``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LaunchRecord", "LaunchReport"]


@dataclass(frozen=True, slots=True)
class LaunchRecord:
    """One partition's collective launch: what was planned and what happened.

    Attributes:
        iteration: Completed iterations of the schedule before this one (0 without a plan).
        position: The instruction's index in the stage's plan, or -1 outside a planned one.
        key: Partition type (``fwd_attn``, ...).
        planned_slot: The plan's launch slot, or ``None`` (no overlap / no setting).
        launched_at: The slot at which ``launch`` was called, or ``None``: at partition exit.
        sm_count: The requested SM count, or ``None`` (default path).
        block_size: The requested threads per CTA (recorded; NCCL cannot set it per group).
        enforced: An SM-limited NCCL communicator carried the collective.
        path: ``overlap`` (planned slot), ``no-overlap`` (a ``None`` slot), ``sequential``,
            ``no-setting`` (plan lacks the key), ``no-plan`` (no schedule, or it is off), or
            ``slot-not-reached`` (the planned slot was never announced).
    """

    iteration: int
    position: int
    key: str
    planned_slot: str | None
    launched_at: str | None
    sm_count: int | None
    block_size: int | None
    enforced: bool
    path: str

    def to_json(self) -> dict[str, object]:
        """The record as JSON data."""
        return {
            "iteration": self.iteration,
            "position": self.position,
            "key": self.key,
            "planned_slot": self.planned_slot,
            "launched_at": self.launched_at,
            "sm_count": self.sm_count,
            "block_size": self.block_size,
            "enforced": self.enforced,
            "path": self.path,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchReport:
    """What a launch control did (:meth:`~powerlib.kareus.launch.LaunchControl.report`).

    Attributes:
        loaded: A Kareus schedule was loaded.
        active: It is loaded and was not switched off.
        disabled: Why it was switched off (``None``: it was not, or none was loaded).
        iterations: Iterations the schedule completed.
        communicators: SM-limited communicators made.
        launches: Launch records kept.
        paths: Per launch path (:attr:`LaunchRecord.path`), how many launches took it.
        enforced: Launches an SM-limited communicator carried.
        requested_sm_counts: Per partition type, the distinct SM counts its launches requested.
    """

    loaded: bool
    active: bool
    disabled: str | None
    iterations: int
    communicators: int
    launches: int
    paths: dict[str, int]
    enforced: int
    requested_sm_counts: dict[str, list[int]]

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        return {
            "loaded": self.loaded,
            "active": self.active,
            "disabled": self.disabled,
            "iterations": self.iterations,
            "communicators": self.communicators,
            "launches": self.launches,
            "paths": dict(self.paths),
            "enforced": self.enforced,
            "requested_sm_counts": {k: list(v) for k, v in self.requested_sm_counts.items()},
        }
