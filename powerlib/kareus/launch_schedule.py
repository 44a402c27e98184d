"""One stage's Kareus plan, consumed one instruction at a time (:class:`PartitionSchedule`).

A Kareus plan (docs/kareus.md §3.1, §6.1 item 7) gives every instruction of a stage an execution
mode (``sequential`` or ``nanobatch``) and, when nanobatched, one
:class:`~powerlib.planning.plan.PartitionSetting` per partition type. The schedule follows the
training loop's instructions against the plan's order (the artifact's name check, docs/kareus.md
§3.2) and its step-end consistency check; a loop that runs another order, or another number of
instructions per iteration, switches it off for the rest of the run with one warning, and every
partition then takes the framework's default path. :mod:`powerlib.kareus.launch` drives it from
the session's hooks and launches the collectives.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence

from powerlib.errors import PlanError
from powerlib.planning.pipeline import InstructionKey
from powerlib.planning.plan import FrequencyPlan, PartitionSetting, PlannedInstruction

__all__ = ["PartitionSchedule", "warn_degraded"]

logger = logging.getLogger(__name__)


def warn_degraded(message: str) -> None:
    """Log and warn (``RuntimeWarning``), as the session does for a degraded feature."""
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _fmt(key: InstructionKey) -> str:
    stage, chunk, mb, kind = key
    return f"{kind} mb{mb}" + (f" chunk{chunk}" if chunk else "")


class PartitionSchedule:
    """One stage's Kareus plan, consumed one instruction at a time.

    Args:
        instructions: The stage's planned instructions in execution order (one iteration).
        source: Where the plan came from, for messages.
        warn: How a problem is reported (default: log and ``RuntimeWarning``).

    Raises:
        PlanError: No instructions, or instructions of several stages.
    """

    def __init__(
        self,
        instructions: Sequence[PlannedInstruction],
        *,
        source: str = "<plan>",
        warn: Callable[[str], None] = warn_degraded,
    ) -> None:
        planned = tuple(instructions)
        if not planned:
            raise PlanError(f"{source}: a partition schedule needs at least one instruction")
        stages = {p.instruction.stage for p in planned}
        if len(stages) != 1:
            raise PlanError(
                f"{source}: a partition schedule is one stage's, got stages {sorted(stages)}"
            )
        self.instructions = planned
        self.stage = planned[0].instruction.stage
        self.source = source
        self._warn = warn
        self._keys = [p.key for p in planned]
        self.position = 0  # instructions begun in this iteration
        self.iteration = 0  # completed (stepped) iterations
        self.current: PlannedInstruction | None = None
        self.disabled: str | None = None  # why the schedule was switched off
        self._missing: set[tuple[str, str]] = set()

    @classmethod
    def from_plan(cls, plan: FrequencyPlan, stage: int) -> PartitionSchedule:
        """``stage``'s schedule from a plan.

        Raises:
            PlanError: The plan has no such stage.
        """
        return cls(plan.stage(stage), source=plan.source)

    @property
    def active(self) -> bool:
        """False once a mismatch switched the schedule off (every partition: default path)."""
        return self.disabled is None

    @property
    def sm_counts(self) -> tuple[int, ...]:
        """Distinct SM counts of this stage's nanobatched instructions, ascending."""
        return tuple(sorted({s.sm_count for p in self.instructions for s in p.overlap.values()}))

    def begin(self, key: InstructionKey) -> PlannedInstruction | None:
        """The instruction ``key = (stage, chunk, microbatch, kind)`` starts.

        Returns:
            Its planned entry, or ``None`` when the schedule is off (now or before).
        """
        self.current = None
        if self.disabled is not None:
            return None
        pos = self.position
        if pos >= len(self._keys):
            self._disable(f"instruction {pos} {_fmt(key)} is beyond the plan's {len(self._keys)}")
            return None
        if key != self._keys[pos]:
            self._disable(
                f"instruction {pos} is {_fmt(key)}, the plan expects {_fmt(self._keys[pos])}"
            )
            return None
        self.position = pos + 1
        self.current = self.instructions[pos]
        return self.current

    def end(self) -> None:
        """The current instruction ends: :meth:`config` answers ``None`` until the next begins."""
        self.current = None

    def end_step(self) -> bool:
        """The iteration ended: check the plan was consumed exactly, then rewind.

        An iteration in which no instruction began (an evaluation step, whose hooks are skipped as
        in the artifact) is not checked.

        Returns:
            False if the iteration did not run the whole plan (the schedule is then off).
        """
        self.current = None
        ran, self.position = self.position, 0
        if self.disabled is not None:
            return False
        if ran == 0:
            return True
        self.iteration += 1
        if ran != len(self._keys):
            self._disable(f"the iteration ran {ran} instruction(s), the plan has {len(self._keys)}")
            return False
        return True

    def config(self, key: str) -> PartitionSetting | None:
        """Partition type ``key``'s setting in the current instruction, or ``None``: default path.

        ``None`` when no instruction is running, the schedule is off, the instruction is
        sequential, or the plan does not configure ``key`` (logged once per instruction kind and
        key: trail partitions, for one, keep the framework's default).
        """
        current = self.current
        if current is None or current.execution != "nanobatch":
            return None
        setting = current.overlap.get(key)
        if setting is None:
            seen = (current.instruction.kind, key)
            if seen not in self._missing:
                self._missing.add(seen)
                logger.info(
                    "%s: the plan has no setting for partition %r in %s instructions; it takes the "
                    "default path",
                    self.source,
                    key,
                    current.instruction.kind,
                )
        return setting

    def _disable(self, detail: str) -> None:
        self.disabled = detail
        self.current = None
        self._warn(
            f"powerlib: stage {self.stage}: the training loop does not run the overlap plan's "
            f"instruction order ({detail}); every partition takes the default path from now on"
        )
