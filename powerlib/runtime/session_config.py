"""What a session is told: one nested, typed configuration (:class:`SessionConfig`).

A session takes one :class:`SessionConfig` (``Session(config)``), whose parts each declare their
fields and defaults once:

- :class:`WorkloadConfig`: the pipeline (stages, microbatches, and the layout where stated);
- :class:`PolicyConfig`: how rank 0 chooses the plan;
- :class:`~powerlib.runtime.sweep.SweepConfig`: how the session profiles;
- :class:`ApplyConfig`: how it applies a plan and checks what the plan achieves;
- :class:`RunConfig`: how it runs (mode, device, ranks, files, progress).

Every part checks itself when it is made, before any device is opened, with the errors the
session has always raised there. ``powerlib.optimize(**keywords)`` is the one place the flat
keywords users and integrations pass map onto these parts (:meth:`SessionConfig.from_keywords`):
each keyword is the name of exactly one field.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from powerlib.backend import Backend
from powerlib.config import Settings
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError, PlanError
from powerlib.planning.choice import check_policy
from powerlib.planning.pipeline import PLACEMENTS
from powerlib.planning.plan import RECORDED, FrequencyPlan
from powerlib.planning.schedules import build_schedule
from powerlib.runtime.coordination import Coordinator
from powerlib.runtime.listeners import InstructionListener
from powerlib.runtime.sweep import SweepConfig

__all__ = [
    "DEFAULT_SWITCH_LATENCY_S",
    "ApplyConfig",
    "Layout",
    "LazyCudaSync",
    "Mode",
    "PolicyConfig",
    "RunConfig",
    "SessionConfig",
    "WorkloadConfig",
]

DEFAULT_SWITCH_LATENCY_S = 0.005
"""The clock-change latency the guard assumes when nothing measured it."""


class Mode(str, enum.Enum):
    """What a session does: ``auto`` (profile, plan, apply), ``profile``, ``plan``, ``apply``."""

    AUTO = "auto"
    PROFILE = "profile"
    PLAN = "plan"
    APPLY = "apply"

    def __str__(self) -> str:
        return self.value

    @property
    def profiles(self) -> bool:
        """The session profiles the job (``auto``, ``profile``)."""
        return self in (Mode.AUTO, Mode.PROFILE)

    @property
    def plans(self) -> bool:
        """Rank 0 plans, and keeps the frontier to re-plan from (``auto``, ``plan``)."""
        return self in (Mode.AUTO, Mode.PLAN)


class Layout(NamedTuple):
    """Which order the pipeline runs and which model pieces a stage holds (the defaults here)."""

    schedule: str = "1f1b"
    num_chunks: int = 1
    placement: str = "looped"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadConfig:
    """The pipeline the hooks will see (the same on every rank).

    Attributes:
        num_stages: Pipeline stages of the job.
        num_microbatches: Microbatches per iteration.
        schedule: ``1f1b``, ``gpipe``, ``interleaved``, or ``recorded`` (plan only on the order
            the hooks record while profiling: zero-bubble and V schedules); ``None``: not
            stated (``1f1b``).
        num_chunks: Model chunks per stage (interleaved, V schedules); ``None``: not stated (1).
        placement: ``looped`` or ``v``: which model pieces a stage's chunks hold (see
            :mod:`powerlib.planning.pipeline`); ``None``: not stated (``looped``).
            Integrations state schedule, chunks and placement through ``Session.set_layout``
            when they know them. A saved plan is checked against the stated ones only: the
            others are defaults, and a saved plan may have its own.

    Raises:
        PlanError: An unknown placement or schedule, a V placement without two chunks, or
            counts the schedule cannot be built for.
    """

    num_stages: int
    num_microbatches: int
    schedule: str | None = None
    num_chunks: int | None = None
    placement: str | None = None

    def __post_init__(self) -> None:
        layout = self.layout
        if layout.placement not in PLACEMENTS:
            raise PlanError(
                f"unknown placement {layout.placement!r}; choose one of {', '.join(PLACEMENTS)}"
            )
        if layout.placement == "v" and layout.num_chunks != 2:
            raise PlanError(f"the v placement needs num_chunks=2, got {layout.num_chunks}")
        if layout.schedule != RECORDED:
            build_schedule(
                layout.schedule, self.num_stages, self.num_microbatches, layout.num_chunks
            )

    @property
    def layout(self) -> Layout:
        """The layout the planner uses: what was stated, the defaults for the rest."""
        default = Layout()
        return Layout(
            schedule=default.schedule if self.schedule is None else self.schedule,
            num_chunks=default.num_chunks if self.num_chunks is None else self.num_chunks,
            placement=default.placement if self.placement is None else self.placement,
        )

    def check_saved_plan(self, plan: FrequencyPlan) -> None:
        """A saved plan must be for this workload (schedule, chunks, placement where stated).

        Raises:
            PlanError: The plan was made for another workload.
        """
        plan.check_workload(
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            schedule=self.schedule,
            num_chunks=self.num_chunks,
            placement=self.placement,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """How rank 0 chooses the plan (:func:`powerlib.planning.choice.choose`).

    Attributes:
        policy: ``fastest`` (no slowdown), ``deadline``, ``min-energy``, or ``power-budget``:
            per-GPU power limits and clocks that minimize the iteration time inside a budget
            (docs/perseus.md §7), set through the control session and restored at exit; a
            GPU's limit at the session's start (an administrator's or the facility's) is never
            raised.
        budget_w: ``power-budget``: what the job's GPUs' limits may sum to, in watts (one
            node's GPUs on a single-node job).
        budget_fraction: ``power-budget``: the budget as a share (0 < f <= 1) of the limits
            the job's GPUs have when the session starts (0.8: 80 %); give this or ``budget_w``.
        deadline_s: Straggler iteration time T′ for ``deadline``.
        deadline_ratio: T′ as a multiple of the all-max iteration time (a straggler factor),
            for ``deadline`` when ``deadline_s`` is not given.
        argmin: The paper's emulation rule for ``deadline`` (see ``Frontier.select``).
        max_slowdown: Realized-slowdown guard for ``fastest`` (against all-max) and
            ``deadline`` (against T′), as a fraction (default 0.1 %).
        switch_latency_s: Clock-change latency the guard plans for; ``None``: the latency the
            ranks measured while warming up (the slowest rank's), else
            :data:`DEFAULT_SWITCH_LATENCY_S`.
        p_block_w: Blocking power; ``None``: measured between instructions while profiling.
        unit_time_s: Planner time unit τ; ``None``: from the profile.

    Raises:
        PlanError: An unknown policy, a negative or non-finite guard, a deadline without T′, a
            ratio below 1, a time unit that is not a positive number, ``power-budget``
            without exactly one good budget, or a budget with another policy.
    """

    policy: str = "fastest"
    budget_w: float | None = None
    budget_fraction: float | None = None
    deadline_s: float | None = None
    deadline_ratio: float | None = None
    argmin: bool = False
    max_slowdown: float = 0.001
    switch_latency_s: float | None = None
    p_block_w: float | None = None
    unit_time_s: float | None = None

    def __post_init__(self) -> None:
        check_policy(
            self.policy,
            max_slowdown=self.max_slowdown,
            switch_latency_s=DEFAULT_SWITCH_LATENCY_S
            if self.switch_latency_s is None
            else self.switch_latency_s,
            budget_w=self.budget_w,
            budget_fraction=self.budget_fraction,
        )
        if self.policy == "deadline" and self.deadline_s is None and self.deadline_ratio is None:
            raise PlanError("the deadline policy needs deadline_s or deadline_ratio")
        if self.deadline_ratio is not None and not (
            math.isfinite(self.deadline_ratio) and self.deadline_ratio >= 1.0
        ):
            raise PlanError(f"deadline_ratio must be >= 1, got {self.deadline_ratio}")
        # refused here, at the with line, not by the solver on rank 0 after the whole sweep
        if self.unit_time_s is not None and not (
            math.isfinite(self.unit_time_s) and self.unit_time_s > 0
        ):
            raise PlanError(
                f"unit_time_s must be a positive time in seconds, got {self.unit_time_s}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyConfig:
    """How the session applies a plan.

    Attributes:
        prefetch: In the apply phase, request the next instruction's clock when one ends, so
            the switch overlaps the wait between instructions (after the order check).
        threaded: Apply frequencies on a controller thread (default) or inline (emulator).
        check_rounds: Rounds of interleaved all-max and plan windows measured after a plan
            arrives (:mod:`powerlib.runtime.closed_loop`): the saving the session reports is
            measured, and a plan that misses is reverted. 0: no check.
        request_ahead: In the apply phase, request a switch to a higher clock ahead, by the
            clock-change latency the session measured while profiling, so that it lands when
            the instruction starts (docs/runtime.md "Requesting clocks ahead"); no effect
            without that measurement (a session that did not profile).
    """

    prefetch: bool = True
    threaded: bool = True
    check_rounds: int = 3
    request_ahead: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """How a session runs: what it does, on which device, with which ranks, where it writes.

    Attributes:
        mode: ``auto`` (profile, plan, apply), ``profile``, ``plan`` (from ``profile_path``)
            or ``apply`` (``plan_path``).
        stage: This rank's pipeline stage; default: the rank, when there is one rank per stage.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        device: The device (index, id or :class:`Device`); default this process's CUDA device,
            else ``LOCAL_RANK`` among the visible ones (docs/real-gpu.md §4).
        profile_path: The profile to plan from (``plan`` mode); in ``apply`` mode, the profile
            the saved plan was made from: the closed loop then measures it paired (§9 of
            docs/measurement.md), not only against the interleaved windows.
        plan_path: The plan to apply (``apply`` mode).
        out_dir: Where rank 0 writes profile, frontier, plan and summary; ``None``: nowhere.
        plot: Rank 0 also draws ``frontier.png`` in ``out_dir`` (``plot`` extra).
        coordinator: How ranks agree; default ``torch.distributed`` if initialised, else alone.
        clock: Time source in seconds; default ``time.perf_counter``.
        sync: Waits for the device before a time is read; default ``torch.cuda.synchronize``
            once CUDA is initialised, else nothing (decided at each call, docs/real-gpu.md §4).
        progress: Print progress to stderr; default on rank 0 only.
        guardian: Start the watchdog process that restores the device if this process is
            killed; default: on when the backend changes devices directly and persistently (real
            hardware, not the agent; docs/real-gpu.md §6).
        listeners: Instruction listeners to register before the session starts (see
            ``Session.add_instruction_listener``; Kareus:
            ``[powerlib.kareus.launch.LaunchControl(...)]``).
        settings: Settings; default from the environment.
        enabled: ``False`` (or ``POWERLIB_DISABLE=1``, :attr:`Settings.disabled
            <powerlib.config.Settings.disabled>`): the same hooks, every iteration timed and
            metered, no device changed and no lock taken (the A side of an A/B run).
        force: Take a GPU whose clocks someone else locked although the driver cannot read that
            lock back (its restore then unlocks; docs/real-gpu.md §1); default: refuse it.

    Raises:
        InvalidArgumentError: An unknown mode, or one that lacks its input file.
    """

    mode: Mode = Mode.AUTO
    stage: int | None = None
    backend: Backend | str | None = None
    device: int | str | Device | None = None
    profile_path: Path | None = None
    plan_path: Path | None = None
    out_dir: Path | None = Path("powerlib-out")
    plot: bool = False
    coordinator: Coordinator | None = None
    clock: Callable[[], float] | None = None
    sync: Callable[[], None] | None = None
    progress: bool | None = None
    guardian: bool | None = None
    listeners: tuple[InstructionListener, ...] = ()
    settings: Settings | None = None
    enabled: bool = True
    force: bool = False

    def __post_init__(self) -> None:
        modes = [m.value for m in Mode]
        if self.mode not in modes:
            raise InvalidArgumentError(f"mode must be one of {', '.join(modes)}, got {self.mode!r}")
        object.__setattr__(self, "mode", Mode(self.mode))
        for name in ("profile_path", "plan_path", "out_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        object.__setattr__(self, "listeners", tuple(self.listeners))
        if self.mode is Mode.PLAN and self.profile_path is None:
            raise InvalidArgumentError("mode 'plan' needs profile_path (a saved profile)")
        if self.mode is Mode.APPLY and self.plan_path is None:
            raise InvalidArgumentError("mode 'apply' needs plan_path (a saved plan)")

    def resolve_stage(self, coordinator: Coordinator, num_stages: int) -> int:
        """:attr:`stage`, or the coordinator's rank when every rank is one stage.

        Raises:
            InvalidArgumentError: No stage given and the ranks are not the stages, or the stage
                is out of range.
        """
        stage = self.stage
        if stage is None:
            if coordinator.world_size != num_stages:
                raise InvalidArgumentError(
                    f"{coordinator.world_size} rank(s) but {num_stages} stage(s): "
                    "pass stage= (this rank's pipeline stage)"
                )
            stage = coordinator.rank
        if not 0 <= stage < num_stages:
            raise InvalidArgumentError(f"stage {stage} is out of range for {num_stages} stage(s)")
        return stage

    def resolve_sync(self) -> Callable[[], None]:
        """:attr:`sync`, or a wait that is ``torch.cuda.synchronize`` once CUDA is initialised.

        The default is decided at each call, not here: a session entered before the model
        moves to the GPU still waits for kernels later (docs/real-gpu.md §4).
        """
        if self.sync is not None:
            return self.sync
        return LazyCudaSync()


class LazyCudaSync:
    """``torch.cuda.synchronize`` once CUDA is initialised, nothing before (docs/real-gpu.md §4).

    Never imports torch (a CPU job does not have it); each call before CUDA is up costs a
    dictionary look-up and one ``is_initialized()``, and the synchronize is kept from then on.
    """

    def __init__(self) -> None:
        self._sync: Callable[[], None] | None = None

    def __call__(self) -> None:
        """Wait for the device when CUDA is up; return at once before."""
        sync = self._sync
        if sync is None:
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_initialized():
                return
            sync = self._sync = torch.cuda.synchronize
        sync()


_Part = TypeVar(
    "_Part", "RunConfig", "PolicyConfig", "WorkloadConfig", "SweepConfig", "ApplyConfig"
)

_PARTS: tuple[tuple[str, type[Any]], ...] = (
    ("run", RunConfig),
    ("policy", PolicyConfig),
    ("workload", WorkloadConfig),
    ("sweep", SweepConfig),
    ("apply", ApplyConfig),
)
"""Each part of the configuration, in the order the adapter builds (and checks) them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionConfig:
    """Everything a session is told, in five parts (see the module doc).

    Attributes:
        workload: The pipeline.
        policy: How rank 0 chooses the plan.
        sweep: How the session profiles.
        apply: How it applies a plan and checks what the plan achieves.
        run: How it runs.
    """

    workload: WorkloadConfig
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    apply: ApplyConfig = field(default_factory=ApplyConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @classmethod
    def from_keywords(cls, **keywords: Any) -> SessionConfig:
        """The configuration from ``powerlib.optimize``'s flat keywords (the one adapter).

        Every keyword is the name of one field of one part (:func:`keywords` lists them);
        ``freqs_mhz`` may be any sequence (empty: every supported clock), paths may be strings.

        Raises:
            TypeError: An unknown keyword, or ``num_stages``/``num_microbatches`` missing.
            InvalidArgumentError: A bad option (a mode without its input file, bad sweep counts).
            PlanError: A bad planning option (an unknown policy, a deadline without T′).
        """
        unknown = sorted(set(keywords) - {name for name, _, _ in keywords_of_parts()})
        if unknown:
            raise TypeError(f"optimize() got unexpected keyword argument(s) {', '.join(unknown)}")
        if keywords.get("freqs_mhz") is not None:
            keywords["freqs_mhz"] = tuple(keywords["freqs_mhz"]) or None
        # in _PARTS's order: the same part's error comes first as before
        return cls(**{name: _part(kind, keywords) for name, kind in _PARTS})

    def with_layout(
        self,
        *,
        schedule: str | None = None,
        num_chunks: int | None = None,
        placement: str | None = None,
    ) -> SessionConfig:
        """This configuration with more of the layout stated (``Session.set_layout``).

        What is ``None`` here keeps what was stated before.

        Raises:
            PlanError: The layout is invalid.
        """
        w = self.workload
        workload = dataclasses.replace(
            w,
            schedule=w.schedule if schedule is None else schedule,
            num_chunks=w.num_chunks if num_chunks is None else num_chunks,
            placement=w.placement if placement is None else placement,
        )
        return dataclasses.replace(self, workload=workload)


def _part(kind: type[_Part], keywords: Mapping[str, Any]) -> _Part:
    """The part ``kind`` from the keywords that name its fields (checked as it is made)."""
    names = {f.name for f in dataclasses.fields(kind)}
    try:
        return kind(**{name: value for name, value in keywords.items() if name in names})
    except TypeError as err:  # a required field (the workload's counts) is missing
        raise TypeError(f"optimize() {str(err).partition(' ')[2]}") from None


def keywords_of_parts() -> Iterator[tuple[str, str, dataclasses.Field[Any]]]:
    """Every flat keyword: ``(name, part, field)``, part by part as :class:`SessionConfig` has them."""
    kinds = dict(_PARTS)
    for part in dataclasses.fields(SessionConfig):
        for f in dataclasses.fields(kinds[part.name]):
            yield f.name, part.name, f


def keywords_signature() -> inspect.Signature:
    """``optimize``'s signature: one keyword-only parameter per field, with its default."""
    params = []
    for name, _, f in keywords_of_parts():
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type
            )  # fmt: skip
        )
    return inspect.Signature(params)
