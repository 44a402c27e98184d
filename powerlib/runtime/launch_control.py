"""The runtime side of Kareus overlap plans: which partition runs how, and when its collective starts.

A Kareus plan (docs/kareus.md §3.1, §6.1 item 7) gives every instruction of a stage an execution mode
(``sequential`` or ``nanobatch``) and, when nanobatched, one :class:`PartitionSetting` per
partition type: the launch slot before whose first kernel the collective starts, the SM (CTA)
count of the collective and its block size. This module applies it the way the artifact's
runtime does (docs/kareus.md §3.2), through callbacks an integration places in its own code:

::

    overlap = session.overlap                      # or Overlap.from_plan(plan, stage)
    with session.instruction("forward", microbatch=mb):
        for layer in layers:
            with overlap.partition("fwd_attn", launch=start_allreduce, group=tp_group) as part:
                part.slot("norm_0");   x = norm(x)           # right before each slot's first kernel
                part.slot("linear_0"); x = qkv(x)
                part.slot("rope_0");   x = rope(x)
                ...                                          # the collective is joined at exit

    def start_allreduce(group, setting):                     # called exactly once per partition
        return torch.distributed.all_reduce(buf, group=group, async_op=True)

Partition keys are the plan's: ``fwd_attn``, ``bwd_qkv_rs``, ... (:mod:`powerlib.planning.kareus.
partition`). A backward instruction with activation checkpointing configures the forward
partitions it recomputes separately, under ``recompute_<key>`` (``recompute_fwd_attn``): the
integration's recompute path asks for those keys.

The runtime calls ``launch(group, setting)`` exactly once per partition: when ``part.slot(name)``
announces the planned slot (the collective is enqueued after everything before that slot's first
kernel: on CUDA the communicator's stream waits for the compute stream at that point, which is the
artifact's event-gated launch), or at partition exit when there is nothing to overlap (no plan, a
sequential instruction, a partition type the plan does not configure, a ``None`` slot). At exit
the runtime waits on the handle ``launch`` returned (the end-of-partition join; on CUDA a
stream wait, not a CPU block). Integrations that schedule themselves ask :meth:`Overlap.config`.

**Never crash the job** (docs/architecture.md §5): a problem with the plan at run time degrades to the
framework's default path with one warning, never an exception in the training loop:

- the loop runs another instruction order than the plan (checked at every instruction, like the
  artifact's name check) or a different number of instructions per iteration (checked at every
  :meth:`Overlap.step`, the step-end consistency check): the schedule is switched off for the
  rest of the run and every partition takes the default path;
- a planned slot the integration never announces (a slot name the plan has but the code does
  not): the collective is launched at partition exit, with one warning per (type, slot);
- ``part.slot`` with a name that is not a slot name (``<group>_<index>``, e.g. ``rope_0``): one
  warning, the call is ignored.

**SM shares** come from SM-limited communicators (:class:`~powerlib.runtime.sm_groups.SMGroups`,
:mod:`powerlib.runtime.sm_groups`), all created when the plan is loaded (:meth:`Overlap.load`).

Every rank of a group must run the same stage plan (tensor- and context-parallel ranks share a
stage), so they launch the same collectives on the same communicators in the same order, as NCCL
requires; the end-of-partition join is also the ``work.wait()`` torch asks for before another
communicator is used.

torch is not imported by this module.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from powerlib.errors import InvalidArgumentError, PlanError
from powerlib.planning.pipeline import KINDS, InstructionKey
from powerlib.planning.plan import FrequencyPlan, PartitionSetting, PlannedInstruction
from powerlib.runtime.sm_groups import SMGroups, nccl_options

__all__ = [
    "LaunchFn",
    "LaunchRecord",
    "Overlap",
    "OverlapSchedule",
    "Partition",
    "SMGroups",
    "nccl_options",
    "plan_has_overlap",
]

logger = logging.getLogger(__name__)

LaunchFn = Callable[[Any, "PartitionSetting | None"], Any]
"""``launch(group, setting) -> work | None``: enqueue one partition's collective on ``group``."""

_SLOT_NAME = re.compile(r"^[a-z][a-z0-9]*_[0-9]+$")


def _warn(message: str) -> None:
    """Log and warn (``RuntimeWarning``), as the session does for a degraded feature."""
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _fmt(key: InstructionKey) -> str:
    stage, chunk, mb, kind = key
    return f"{kind} mb{mb}" + (f" chunk{chunk}" if chunk else "")


def plan_has_overlap(plan: FrequencyPlan) -> bool:
    """Whether any instruction of any stage is nanobatched (a Kareus overlap plan)."""
    return any(p.execution == "nanobatch" for stage in plan.stages for p in stage)


# --------------------------------------------------------------------------------------------
# The schedule: per instruction, its execution mode and partition settings
# --------------------------------------------------------------------------------------------


class OverlapSchedule:
    """One stage's overlap plan, consumed one instruction at a time.

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
        warn: Callable[[str], None] = _warn,
    ) -> None:
        planned = tuple(instructions)
        if not planned:
            raise PlanError(f"{source}: an overlap schedule needs at least one instruction")
        stages = {p.instruction.stage for p in planned}
        if len(stages) != 1:
            raise PlanError(
                f"{source}: an overlap schedule is one stage's, got stages {sorted(stages)}"
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
    def from_plan(cls, plan: FrequencyPlan, stage: int) -> OverlapSchedule:
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


# --------------------------------------------------------------------------------------------
# The launch-point API
# --------------------------------------------------------------------------------------------


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

    def to_json(self) -> dict[str, Any]:
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


class Partition:
    """One running partition (made by :meth:`Overlap.partition`; use it as a context manager).

    Attributes:
        key: Partition type.
        setting: The plan's setting, or ``None`` (default path).
        handle: What ``launch`` returned, once it ran.
    """

    def __init__(
        self,
        overlap: Overlap,
        key: str,
        launch: LaunchFn,
        group: Any,
        setting: PartitionSetting | None,
        path: str,
    ) -> None:
        self._overlap = overlap
        self.key = key
        self._launch = launch
        self._group = group
        self.setting = setting
        self._path = path
        self._target = setting.slot if setting is not None and path == "overlap" else None
        self._launched = False
        self._open = False
        self.handle: Any = None

    @property
    def launched(self) -> bool:
        """Whether the collective was launched."""
        return self._launched

    @property
    def planned_slot(self) -> str | None:
        """The slot the collective launches at, or ``None``: at exit."""
        return self._target

    def slot(self, name: str) -> None:
        """The first kernel of launch slot ``name`` is about to be enqueued.

        Launches the collective if ``name`` is the planned slot (and it has not launched yet).
        A name that is not a slot name (``<group>_<index>``) is ignored with one warning.
        """
        if not isinstance(name, str) or not _SLOT_NAME.match(name):
            self._overlap._warn_once(
                ("badslot", repr(name)),
                f"powerlib: part.slot({name!r}) in partition {self.key!r} is not a launch slot "
                "name like 'rope_0'; ignored",
            )
            return
        if self._open and not self._launched and name == self._target:
            self._do_launch(name, self._path)

    def __enter__(self) -> Partition:
        self._open = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        if exc_type is not None:
            return  # the body failed: launch nothing more, join nothing (the error propagates)
        if not self._launched:
            path = self._path
            if self._target is not None:
                path = "slot-not-reached"
                self._overlap._warn_once(
                    ("unreached", self.key, self._target),
                    f"powerlib: partition {self.key!r} never announced its planned launch slot "
                    f"{self._target!r}; its collective runs after the compute",
                )
            self._do_launch(None, path)
        wait = getattr(self.handle, "wait", None)
        if callable(wait):
            wait()  # the end-of-partition join

    def _do_launch(self, at: str | None, path: str) -> None:
        self._launched = True
        setting = self.setting
        group, enforced = self._group, False
        if at is not None and setting is not None:
            group, enforced = self._overlap.groups.lookup(self._group, setting.sm_count)
        self._overlap._record(self.key, setting, at, enforced, path)
        self.handle = self._launch(group, setting)


class Overlap:
    """Applies one stage's overlap plan: per-instruction settings and partition launch points.

    Without a schedule (no plan yet, a Perseus plan, or after a mismatch) every partition takes
    the default path: ``launch(group, None)`` at partition exit, on the integration's group.

    Args:
        schedule: The stage's schedule, or ``None``.
        groups: The SM-limited communicators (default: a fresh :class:`SMGroups`).
        record_limit: How many launch records to keep (oldest dropped first).
        warn: How problems are reported (default: log and ``RuntimeWarning``, once each).
    """

    def __init__(
        self,
        schedule: OverlapSchedule | None = None,
        *,
        groups: SMGroups | None = None,
        record_limit: int = 100_000,
        warn: Callable[[str], None] = _warn,
    ) -> None:
        self._warn = warn
        self._warned: set[Any] = set()
        self.schedule = schedule
        self.groups = groups if groups is not None else SMGroups(warn=self._warn_message)
        self.records: deque[LaunchRecord] = deque(maxlen=record_limit)
        self._stage: int | None = None if schedule is None else schedule.stage

    @classmethod
    def from_plan(
        cls,
        plan: FrequencyPlan,
        stage: int,
        *,
        group_ranks: Sequence[Sequence[int]] | None = None,
        groups: SMGroups | None = None,
    ) -> Overlap:
        """An :class:`Overlap` for ``stage`` of ``plan``, its communicators prepared.

        Collective on NCCL: every rank of the job calls it at the same point (see :meth:`load`).
        """
        overlap = cls(groups=groups)
        overlap.load(plan, stage, group_ranks=group_ranks)
        return overlap

    def load(
        self,
        plan: FrequencyPlan,
        stage: int,
        *,
        group_ranks: Sequence[Sequence[int]] | None = None,
    ) -> bool:
        """Take ``stage``'s schedule from ``plan`` if it is an overlap plan; prepare communicators.

        On NCCL this creates one communicator per (group, SM count) from the distinct SM counts of
        *every* stage, so every rank of the job must call it at the same point with the same
        ``group_ranks`` (``new_group`` is collective over the whole job).

        Args:
            plan: The plan (all stages).
            stage: This rank's stage.
            group_ranks: Global ranks of every group the overlapped collectives run on (every
                tensor/context-parallel group of the job); default: the whole world.

        Returns:
            True if the plan is an overlap plan (nanobatched instructions somewhere).

        Raises:
            PlanError: The plan has no such stage.
        """
        schedule = OverlapSchedule.from_plan(plan, stage)  # validates the stage first
        if not plan_has_overlap(plan):
            self.schedule = None
            return False
        schedule._warn = self._warn_message
        self.schedule = schedule
        self._stage = stage
        counts = {s.sm_count for st in plan.stages for p in st for s in p.overlap.values()}
        self.groups.prepare(counts, group_ranks)
        return True

    # -- per-instruction hooks ----------------------------------------------------------------

    @property
    def active(self) -> bool:
        """A schedule is loaded and has not been switched off."""
        return self.schedule is not None and self.schedule.active

    @property
    def current(self) -> PlannedInstruction | None:
        """The running instruction's plan entry, or ``None``."""
        return None if self.schedule is None else self.schedule.current

    @property
    def nanobatch(self) -> bool:
        """Whether the running instruction is planned as two overlapped nanobatches."""
        current = self.current
        return current is not None and current.execution == "nanobatch"

    def begin(self, kind: str, microbatch: int = 0, chunk: int = 0) -> None:
        """An instruction starts (a :class:`~powerlib.runtime.session.Session` calls it for you).

        Args:
            kind: ``forward``, ``backward``, ``backward_input`` or ``backward_weight``.
            microbatch: Its microbatch.
            chunk: Its model chunk.

        Raises:
            InvalidArgumentError: ``kind`` is not one of those (a bug in the caller).
        """
        if self.schedule is None:
            return
        if kind not in KINDS:
            raise InvalidArgumentError(
                f"instruction kind must be one of {', '.join(KINDS)}, got {kind!r}"
            )
        self.schedule.begin(InstructionKey(self.schedule.stage, chunk, microbatch, kind))

    def end(self) -> None:
        """The current instruction ends."""
        if self.schedule is not None:
            self.schedule.end()

    def step(self) -> bool:
        """The iteration ends: the step-end consistency check (see :meth:`OverlapSchedule.end_step`).

        Returns:
            False if the schedule is (now) off.
        """
        return True if self.schedule is None else self.schedule.end_step()

    def config(self, key: str) -> PartitionSetting | None:
        """Partition type ``key``'s setting in the running instruction, or ``None``: default path."""
        return None if self.schedule is None else self.schedule.config(key)

    # -- partitions ---------------------------------------------------------------------------

    def partition(self, key: str, launch: LaunchFn, *, group: Any = None) -> Partition:
        """One execution of partition type ``key``: ``with overlap.partition(...) as part:``.

        Args:
            key: Partition type (``fwd_attn``, ``bwd_qkv_rs``, ...).
            launch: ``launch(group, setting)`` enqueues the collective on ``group`` (the
                SM-limited communicator when one applies, else ``group`` below) and returns an
                async work handle (``torch.distributed.Work``) or ``None``. Called exactly once.
            group: The collective's process group (``None``: the default group).
        """
        schedule = self.schedule
        if schedule is None or not schedule.active:
            setting, path = None, "no-plan"
        elif schedule.current is None or schedule.current.execution != "nanobatch":
            setting, path = None, "sequential" if schedule.current is not None else "no-plan"
        else:
            setting = schedule.config(key)
            if setting is None:
                path = "no-setting"
            elif setting.slot is None:
                path = "no-overlap"
            else:
                path = "overlap"
        return Partition(self, key, launch, group, setting, path)

    # -- records ------------------------------------------------------------------------------

    def _record(
        self, key: str, setting: PartitionSetting | None, at: str | None, enforced: bool, path: str
    ) -> None:
        schedule = self.schedule
        position = -1
        iteration = 0
        if schedule is not None:
            iteration = schedule.iteration
            if schedule.current is not None:
                position = schedule.position - 1
        self.records.append(
            LaunchRecord(
                iteration=iteration,
                position=position,
                key=key,
                planned_slot=None if setting is None else setting.slot,
                launched_at=at,
                sm_count=None if setting is None else setting.sm_count,
                block_size=None if setting is None else setting.block_size,
                enforced=enforced,
                path=path,
            )
        )

    def requested_sm_counts(self) -> dict[str, list[int]]:
        """Per partition type, the distinct SM counts its launches requested (kept records)."""
        out: dict[str, set[int]] = {}
        for r in self.records:
            if r.sm_count is not None:
                out.setdefault(r.key, set()).add(r.sm_count)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def report(self) -> dict[str, Any]:
        """What the overlap runtime did, as JSON data."""
        schedule = self.schedule
        paths: dict[str, int] = {}
        for r in self.records:
            paths[r.path] = paths.get(r.path, 0) + 1
        return {
            "loaded": schedule is not None,
            "active": self.active,
            "disabled": None if schedule is None else schedule.disabled,
            "iterations": 0 if schedule is None else schedule.iteration,
            "communicators": len(self.groups.groups),
            "launches": len(self.records),
            "paths": paths,
            "enforced": sum(r.enforced for r in self.records),
            "requested_sm_counts": self.requested_sm_counts(),
        }

    def _warn_message(self, message: str) -> None:
        self._warn(message)

    def _warn_once(self, what: Any, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self._warn(message)
