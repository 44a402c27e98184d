"""Kareus's launch control: which partition runs how, and when its collective starts.

A Kareus plan (docs/kareus.md §3.1, §6.1 item 7) gives every instruction of a stage an execution mode
(``sequential`` or ``nanobatch``) and, when nanobatched, one :class:`PartitionSetting` per
partition type: the launch slot before whose first kernel the collective starts, the SM (CTA)
count of the collective and its block size. This module applies it the way the artifact's
runtime does (docs/kareus.md §3.2), through callbacks an integration places in its own code:

::

    control = powerlib.kareus.launch.attach(session)      # before `with session:`; every rank
    with session:
        with session.instruction("forward", microbatch=mb):
            for layer in layers:
                with control.partition("fwd_attn", launch=start_allreduce, group=tp_group) as part:
                    part.slot("norm_0");   x = norm(x)       # right before each slot's first kernel
                    part.slot("linear_0"); x = qkv(x)
                    part.slot("rope_0");   x = rope(x)
                    ...                                      # the collective is joined at exit

    def start_allreduce(group, setting):                     # called exactly once per partition
        return torch.distributed.all_reduce(buf, group=group, async_op=True)

**The session** knows nothing of Kareus: :class:`LaunchControl` is an instruction listener
(:mod:`powerlib.runtime.listeners`). :func:`attach` registers it (or pass
``listeners=[LaunchControl(...)]`` to ``powerlib.optimize``); the session then hands it every plan
it applies (:meth:`LaunchControl.plan_applied`) and calls its ``begin``/``end``/``step`` at its
own hooks. A plan with partition settings that no launch control takes is refused when it is
applied. Without a session, :meth:`LaunchControl.from_plan` and explicit ``begin``/``end``/``step``
calls do the same.

Partition keys are the plan's: ``fwd_attn``, ``bwd_qkv_rs``, ... (:mod:`powerlib.kareus.
partition`). A backward instruction with activation checkpointing configures the forward
partitions it recomputes separately, under ``recompute_<key>`` (``recompute_fwd_attn``): the
integration's recompute path asks for those keys.

The runtime calls ``launch(group, setting)`` exactly once per partition: when ``part.slot(name)``
announces the planned slot (the collective is enqueued after everything before that slot's first
kernel: on CUDA the communicator's stream waits for the compute stream at that point, which is the
artifact's event-gated launch), or at partition exit when there is nothing to overlap (no plan, a
sequential instruction, a partition type the plan does not configure, a ``None`` slot). At exit
the runtime waits on the handle ``launch`` returned (the end-of-partition join; on CUDA a
stream wait, not a CPU block). Integrations that schedule themselves ask
:meth:`LaunchControl.config`.

**Never crash the job** (docs/architecture.md §5): a problem with the plan at run time degrades to the
framework's default path with one warning, never an exception in the training loop:

- the loop runs another instruction order than the plan (checked at every instruction, like the
  artifact's name check) or a different number of instructions per iteration (checked at every
  :meth:`LaunchControl.step`, the step-end consistency check): the schedule is switched off for
  the rest of the run and every partition takes the default path
  (:class:`~powerlib.kareus.launch_schedule.PartitionSchedule`);
- a planned slot the integration never announces (a slot name the plan has but the code does
  not): the collective is launched at partition exit, with one warning per (type, slot);
- ``part.slot`` with a name that is not a slot name (``<group>_<index>``, e.g. ``rope_0``): one
  warning, the call is ignored.

**SM shares** come from SM-limited communicators (:class:`~powerlib.kareus.sm_groups.SMGroups`),
all created when the plan is loaded (:meth:`LaunchControl.load`).

Every rank of a group must run the same stage plan (tensor- and context-parallel ranks share a
stage), so they launch the same collectives on the same communicators in the same order, as NCCL
requires; the end-of-partition join is also the ``work.wait()`` torch asks for before another
communicator is used.

torch is not imported by this module.
"""

from __future__ import annotations

import re
import sys
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from powerlib.errors import InvalidArgumentError
from powerlib.kareus.launch_records import LaunchRecord, LaunchReport
from powerlib.kareus.launch_schedule import PartitionSchedule, warn_degraded
from powerlib.kareus.sm_groups import SMGroups
from powerlib.planning.pipeline import KINDS, InstructionKey
from powerlib.planning.plan import FrequencyPlan, PartitionSetting, PlannedInstruction
from powerlib.runtime.listeners import plan_has_partitions

__all__ = [
    "GroupRanks",
    "LaunchControl",
    "LaunchFn",
    "Partition",
    "active_control",
    "attach",
    "for_partition_plans",
    "tensor_parallel_ranks",
]

LaunchFn = Callable[[Any, "PartitionSetting | None"], Any]
"""``launch(group, setting) -> work | None``: enqueue one partition's collective on ``group``."""

GroupRanks = Sequence[Sequence[int]] | Callable[[], Sequence[Sequence[int]] | None] | None
"""Global ranks of every group the partitions' collectives run on (a zero-argument callable is
asked when a plan with partition settings is applied); ``None``: the whole world."""

_SLOT_NAME = re.compile(r"^[a-z][a-z0-9]*_[0-9]+$")

_CURRENT: list[LaunchControl] = []
"""The launch controls sessions applied plans to and have not closed, innermost last."""


# --------------------------------------------------------------------------------------------
# The launch-point API
# --------------------------------------------------------------------------------------------


class Partition:
    """One running partition (made by :meth:`LaunchControl.partition`; a context manager).

    Attributes:
        key: Partition type.
        setting: The plan's setting, or ``None`` (default path).
        handle: What ``launch`` returned, once it ran.
    """

    def __init__(
        self,
        control: LaunchControl,
        key: str,
        launch: LaunchFn,
        group: Any,
        setting: PartitionSetting | None,
        path: str,
    ) -> None:
        self._control = control
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
            self._control._warn_once(
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
                self._control._warn_once(
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
            group, enforced = self._control.groups.lookup(self._group, setting.sm_count)
        self._control._record(self.key, setting, at, enforced, path)
        self.handle = self._launch(group, setting)


class LaunchControl:
    """Applies one stage's Kareus plan: per-instruction settings and partition launch points.

    Without a schedule (no plan yet, a Perseus plan, or after a mismatch) every partition takes
    the default path: ``launch(group, None)`` at partition exit, on the integration's group.

    As a session's instruction listener (:func:`attach`), it takes every plan the session
    applies (:meth:`plan_applied`) and follows its instructions; it is then what
    :func:`active_control` returns until the session closes.

    Args:
        schedule: The stage's schedule, or ``None``.
        group_ranks: For plans a session applies: global ranks of every group the partitions'
            collectives run on, the same lists on every rank (every tensor/context-parallel
            group of the job), or a zero-argument callable that returns them (asked when a plan
            with partition settings is applied, on every rank); default: the whole world.
        groups: The SM-limited communicators (default: a fresh :class:`SMGroups`).
        record_limit: How many launch records to keep (oldest dropped first).
        warn: How problems are reported (default: log and ``RuntimeWarning``, once each).
    """

    def __init__(
        self,
        schedule: PartitionSchedule | None = None,
        *,
        group_ranks: GroupRanks = None,
        groups: SMGroups | None = None,
        record_limit: int = 100_000,
        warn: Callable[[str], None] = warn_degraded,
    ) -> None:
        self.group_ranks = group_ranks
        self._warn = warn
        self._warned: set[Any] = set()
        self.schedule = schedule
        self.groups = groups if groups is not None else SMGroups(warn=self._warn_message)
        self.records: deque[LaunchRecord] = deque(maxlen=record_limit)
        self._stage: int | None = None if schedule is None else schedule.stage
        self.loaded_group_ranks: list[list[int]] | None = None
        """The groups the loaded plan's communicators were made on (``None``: the world)."""

    @classmethod
    def from_plan(
        cls,
        plan: FrequencyPlan,
        stage: int,
        *,
        group_ranks: Sequence[Sequence[int]] | None = None,
        groups: SMGroups | None = None,
    ) -> LaunchControl:
        """A :class:`LaunchControl` for ``stage`` of ``plan``, its communicators prepared.

        Collective on NCCL: every rank of the job calls it at the same point (see :meth:`load`).
        """
        control = cls(groups=groups)
        control.load(plan, stage, group_ranks=group_ranks)
        return control

    def load(
        self,
        plan: FrequencyPlan,
        stage: int,
        *,
        group_ranks: Sequence[Sequence[int]] | None = None,
    ) -> bool:
        """Take ``stage``'s schedule from ``plan`` if it is a Kareus plan; prepare communicators.

        On NCCL this creates one communicator per (group, SM count) from the distinct SM counts of
        *every* stage, so every rank of the job must call it at the same point with the same
        ``group_ranks`` (``new_group`` is collective over the whole job).

        Args:
            plan: The plan (all stages).
            stage: This rank's stage.
            group_ranks: Global ranks of every group the partitions' collectives run on (every
                tensor/context-parallel group of the job); default: the whole world.

        Returns:
            True if the plan is a Kareus plan (nanobatched instructions somewhere).

        Raises:
            PlanError: The plan has no such stage.
        """
        schedule = PartitionSchedule.from_plan(plan, stage)  # validates the stage first
        if not plan_has_partitions(plan):
            self.schedule = None
            return False
        schedule._warn = self._warn_message
        self.schedule = schedule
        self._stage = stage
        counts = {s.sm_count for st in plan.stages for p in st for s in p.overlap.values()}
        self.groups.prepare(counts, group_ranks)
        self.loaded_group_ranks = None if group_ranks is None else [list(g) for g in group_ranks]
        return True

    # -- as a session's instruction listener --------------------------------------------------

    def plan_applied(self, plan: FrequencyPlan, stage: int) -> bool:
        """A session applies ``plan`` to ``stage``: :meth:`load` it with :attr:`group_ranks`.

        The session calls it on every rank at the same point (the plan's arrival, or
        :func:`attach` to a session that applies one already).

        Returns:
            True if the plan is a Kareus plan (this control carries out its partitions).

        Raises:
            PlanError: The plan has no such stage.
        """
        ranks = self.group_ranks
        if callable(ranks) and plan_has_partitions(plan):
            ranks = ranks()
        taken = self.load(plan, stage, group_ranks=None if callable(ranks) else ranks)
        if not any(other is self for other in _CURRENT):
            _CURRENT.append(self)
        return taken

    def close(self) -> None:
        """The session ended: this control is no longer :func:`active_control` (idempotent)."""
        _CURRENT[:] = [other for other in _CURRENT if other is not self]

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
        """The iteration ends: the step-end consistency check (:meth:`PartitionSchedule.end_step`).

        Returns:
            False if the schedule is (now) off.
        """
        return True if self.schedule is None else self.schedule.end_step()

    def config(self, key: str) -> PartitionSetting | None:
        """Partition type ``key``'s setting in the running instruction, or ``None``: default path."""
        return None if self.schedule is None else self.schedule.config(key)

    # -- partitions ---------------------------------------------------------------------------

    def partition(self, key: str, launch: LaunchFn, *, group: Any = None) -> Partition:
        """One execution of partition type ``key``: ``with control.partition(...) as part:``.

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

    def report(self) -> LaunchReport:
        """What the launch control did (:meth:`LaunchReport.to_json`: as JSON data)."""
        schedule = self.schedule
        paths: dict[str, int] = {}
        for r in self.records:
            paths[r.path] = paths.get(r.path, 0) + 1
        return LaunchReport(
            loaded=schedule is not None,
            active=self.active,
            disabled=None if schedule is None else schedule.disabled,
            iterations=0 if schedule is None else schedule.iteration,
            communicators=len(self.groups.groups),
            launches=len(self.records),
            paths=paths,
            enforced=sum(r.enforced for r in self.records),
            requested_sm_counts=self.requested_sm_counts(),
        )

    def _warn_message(self, message: str) -> None:
        self._warn(message)

    def _warn_once(self, what: Any, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self._warn(message)


def attach(session: Any, *, group_ranks: GroupRanks = None) -> LaunchControl:
    """Kareus's launch control on ``session``: it follows the session's instructions and plans.

    Call it on every rank at the same point, before the ``with`` block when the session applies
    a saved Kareus plan (the session refuses such a plan if nothing takes its partition
    settings when it is applied), or at least before the first instruction. A session that
    already has a launch control keeps it: that one is returned.

    Args:
        session: A :class:`powerlib.Session` (anything with ``add_instruction_listener``).
        group_ranks: See :class:`LaunchControl` (in Megatron:
            :func:`tensor_parallel_ranks`).

    Returns:
        The :class:`LaunchControl` (``partition``, ``config``, ``records``, ``report``).

    Raises:
        InvalidArgumentError: The session has run an instruction already, or has ended.
        PlanError: The plan the session applies has no part for this rank's stage.
    """
    for listener in session.instruction_listeners:
        if isinstance(listener, LaunchControl):
            return listener
    control = LaunchControl(group_ranks=group_ranks)
    session.add_instruction_listener(control)
    return control


def for_partition_plans() -> LaunchControl:
    """The launch control a session adds itself for a Kareus plan nothing else took.

    Registered as the entry point ``powerlib.instruction_listeners:partitions``
    (:func:`powerlib.runtime.listeners.registered_listener`): a session that applies a plan with
    partition settings needs no :func:`attach`. Its collectives' groups are Megatron's
    tensor-parallel groups when Megatron's parallel state is up, else the whole world.
    """
    return LaunchControl(group_ranks=_job_groups)


def _job_groups() -> list[list[int]] | None:
    state = sys.modules.get("megatron.core.parallel_state")
    if state is None or not state.model_parallel_is_initialized():
        return None
    return tensor_parallel_ranks()


def tensor_parallel_ranks() -> list[list[int]]:
    """The global ranks of every tensor-parallel group of the job (the same lists on every rank).

    A Kareus plan's SM-limited NCCL communicators are made per group the partitions' collectives
    run on; in Megatron those are the tensor-parallel groups: the registered launch control
    (:func:`powerlib.kareus.launch.for_partition_plans`) asks this once Megatron is initialised.
    Collective: every rank calls it (one ``all_gather_object``); needs Megatron's parallel state.
    """
    import torch.distributed as dist  # noqa: PLC0415 - torch only where Megatron runs
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron only, once it runs

    mine = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(int(r) for r in mine))
    return [list(g) for g in sorted({tuple(g) for g in every})]


def active_control() -> LaunchControl | None:
    """The launch control of the innermost open session that applied a plan to it, or ``None``.

    What :func:`powerlib.kareus.megatron.nanobatch_layer_spec`'s layers follow by default.
    """
    return _CURRENT[-1] if _CURRENT else None
