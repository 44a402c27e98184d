"""From a profile to the iteration time-energy frontier, plans and the all-max baseline.

Energy accounting (reference docs/perseus.md §1.4): with ``P_block`` the power a GPU draws while it
waits, ``E_iter = Σ_v ẽ_v + N · P_block · T`` where ``ẽ_v = e_v - P_block · q_v · τ`` is the
effective energy the solver minimises. Each frontier point reports both.

:func:`compute_frontier` takes the workload (a profile or per-instruction candidates, a
schedule) and :class:`FrontierSettings` (τ, ``P_block``, the solver's knobs). The walk's work
limit is checked first (:mod:`powerlib.planning.perseus.work`); the points come from the walk or
the direct solve (:mod:`powerlib.planning.perseus.points`); plans are replayed on the measured
profile by :mod:`powerlib.planning.perseus.replay`, through :attr:`Frontier.model`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from powerlib.errors import PlanError
from powerlib.planning.names import POLICIES, POWER_BUDGET, SOLVERS
from powerlib.planning.perseus import guard
from powerlib.planning.perseus.cost_model import build_cost_model
from powerlib.planning.perseus.direct import direct_available
from powerlib.planning.perseus.frequency_options import Option, prepare_options
from powerlib.planning.perseus.noise import TimeNoise
from powerlib.planning.perseus.points import (
    FrontierPoint,
    Wanted,
    deadline_quant,
    direct_points,
    walk_points,
)
from powerlib.planning.perseus.replay import ReplayModel, critical_path_s, replay_options
from powerlib.planning.perseus.solver import PhillipsDessouky
from powerlib.planning.perseus.sources import OptionSource
from powerlib.planning.perseus.work import DEFAULT_MAX_WORK, check_quantum
from powerlib.planning.pipeline import KINDS, Instruction, PipelineDAG, Schedule, build_dag
from powerlib.planning.plan import FrequencyPlan, PartitionSetting, PlannedInstruction
from powerlib.planning.profile import Profile

__all__ = [
    "Baseline",
    "Frontier",
    "FrontierSettings",
    "check_solver",
    "compute_frontier",
    "resolve_solver",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontierSettings:
    """How a frontier is solved: the energy model's constants and the solver's knobs.

    The workload itself (the profile or candidates, the schedule) is passed on its own to
    :func:`compute_frontier`; these are what ``powerlib plan``'s options set, and the plan
    file records the first four (its ``workload``).

    Attributes:
        unit_time_s: The time quantum τ.
        p_block_w: Power while blocked (waiting), charged to idle time (docs/perseus.md §1.4).
        order: Pareto filter before or after subtracting blocking energy
            (:data:`~powerlib.planning.perseus.frequency_options.ORDERS`).
        cost_model: ``exp`` (the paper's exponential fit) or ``convex``.
        solver: ``walk`` (every point, Phillips-Dessouky), ``direct`` (only the points of
            :class:`~powerlib.planning.perseus.points.Wanted`, one linear program each; needs
            ``highspy``, extra ``fast``) or ``auto`` (direct where highspy is installed). A
            solved frontier records the one that ran.
        max_work: Refuse a frontier estimated past this many instruction-steps
            (:class:`~powerlib.planning.perseus.work.WorkEstimate`: the walk's, or the direct
            solve's exact program size) before it is solved; ``None``: no limit.
        direct_solver: What solves the direct points: ``auto`` (the compiled flow where it is
            built, else HiGHS) or ``highs`` (:func:`~powerlib.planning.perseus.work.direct_kind`).
        pruning: How options are pruned
            (:data:`~powerlib.planning.perseus.frequency_options.PRUNINGS`): ``weak`` dominance
            (default) or the SOSP'24 ``artifact``'s strict one (reproduces its frontiers).
    """

    unit_time_s: float
    p_block_w: float
    order: str = "filter-then-subtract"
    cost_model: str = "exp"
    solver: str = "walk"
    max_work: int | None = DEFAULT_MAX_WORK
    direct_solver: str = "auto"
    pruning: str = "weak"


@dataclass(frozen=True, slots=True, kw_only=True)
class Baseline:
    """Every instruction at its stage's maximum frequency (measured times and energies).

    Attributes:
        time_s: Iteration time (critical path of the measured max-frequency times).
        energy_j: Energy at that time, blocking power included.
    """

    time_s: float
    energy_j: float


@dataclass(frozen=True, slots=True)
class Frontier:
    """The whole frontier of one workload, slowest point first, with what is needed for plans."""

    points: tuple[FrontierPoint, ...]
    dag: PipelineDAG
    schedule_name: str
    num_microbatches: int
    num_chunks: int
    options: dict[tuple[int, str], list[Option]]
    settings: FrontierSettings
    baseline_busy: dict[int, tuple[float, float]]  # stage -> (busy time, energy) at max frequency
    measured: dict[tuple[int, str], dict[float, tuple[float, float]]] = field(default_factory=dict)
    """(stage, kind) -> frequency -> measured (time_s, energy_j), every profiled frequency."""
    placement: str = "looped"
    """How each stage's model chunks map onto the model (``looped`` or ``v``)."""
    reference_times: dict[tuple[int, str], float] | None = None
    """(stage, kind) -> the baseline's time per instruction, when the baseline is not the
    fastest option (Kareus: sequential execution at the maximum clock)."""
    complete: bool = True
    """Whether :attr:`points` holds every quantum from ``T_max - 1`` down to ``T_min`` (the
    walk); a direct solve holds only the points asked for (:class:`Wanted`), each exact."""
    t_star_quant: int | None = None
    """For an incomplete frontier: ``T*``'s quant time, or ``None`` when it was not solved."""
    argmin_quant: dict[int, int] = field(default_factory=dict)
    """For an incomplete frontier: a deadline's quant time -> the quant time of the
    minimum-energy point at or below it (``deadline`` with ``argmin``)."""
    direct: Any = field(default=None, compare=False, repr=False)
    """For an incomplete frontier: its solved model, from which :meth:`extend` adds points
    (a :class:`~powerlib.planning.perseus.points.DirectPoints`)."""

    def extend(self, wanted: Wanted) -> Frontier:
        """This frontier with the points ``wanted`` asks for added (a complete one: itself).

        Solved on the same model from its last basis: a new straggler deadline costs a
        fraction of the first solve. Safe to call from another thread (one solve at a time).
        """
        if self.complete or self.direct is None:
            return self
        points, extra = self.direct.solve(wanted)
        return dataclasses.replace(self, points=tuple(points), **extra)

    @property
    def model(self) -> ReplayModel:
        """What replays and the slowdown guard read: the DAG, options, measured rows, τ, P_block."""
        return ReplayModel(
            dag=self.dag,
            options=self.options,
            measured=self.measured,
            unit_time_s=self.settings.unit_time_s,
            p_block_w=self.settings.p_block_w,
        )

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return self.dag.num_stages

    @property
    def fastest(self) -> FrontierPoint:
        """``T_min``: the last point."""
        return self.points[-1]

    @property
    def min_energy(self) -> FrontierPoint:
        """``T*``: the point of minimum total energy (the slowest one on ties).

        Raises:
            PlanError: An incomplete frontier solved without ``T*``.
        """
        if self.complete:
            return min(self.points, key=lambda p: (p.energy_j, -p.time_s))
        if self.t_star_quant is None:
            raise PlanError("this frontier was solved without T* (the minimum-energy point)")
        return self._at_quant(self.t_star_quant)

    @property
    def has_t_star(self) -> bool:
        """Whether :attr:`min_energy` is known."""
        return self.complete or self.t_star_quant is not None

    def _at_quant(self, quant: int) -> FrontierPoint:
        for p in self.points:
            if p.quant_time == quant:
                return p
        time_s = quant * self.settings.unit_time_s
        raise PlanError(
            f"this frontier was solved without the point at {time_s:g} s; plan again for it"
        )

    def select(
        self, policy: str, deadline_s: float | None = None, *, argmin: bool = False
    ) -> FrontierPoint:
        """Pick a point.

        Args:
            policy: ``fastest`` (T_min), ``deadline`` (a straggler's iteration time T′) or
                ``min-energy`` (T*).
            deadline_s: T′ for ``deadline``.
            argmin: For ``deadline``: the minimum-energy point with T ≤ T′ (the paper's emulation
                rule, which stops at T*), instead of the slowest point with T ≤ T′ (the
                model-optimal rule: waiting costs P_block either way).

        Raises:
            PlanError: Unknown policy (or power-budget), no deadline, one below T_min.
        """
        if policy == "fastest":
            return self.fastest
        if policy == "min-energy":
            return self.min_energy
        if policy == POWER_BUDGET:  # limits, not a point (docs/perseus.md §7)
            raise PlanError("a frontier point cannot hold a power budget: plan_power_budget can")
        if policy != "deadline":
            raise PlanError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if deadline_s is None or not math.isfinite(deadline_s):
            raise PlanError(
                "the deadline policy needs --deadline-s (the straggler's iteration time)"
            )
        fits = [p for p in self.points if p.time_s <= deadline_s + 1e-12]
        if not fits:
            raise PlanError(
                f"deadline {deadline_s:g} s is below the fastest plan's {self.fastest.time_s:g} s"
            )
        if not self.complete:
            quant = deadline_quant(
                deadline_s,
                self.settings.unit_time_s,
                self.fastest.quant_time,
                self.points[0].quant_time,
            )
            assert quant is not None  # fits is not empty: the deadline is at least T_min
            if argmin:
                if quant not in self.argmin_quant:
                    raise PlanError(
                        f"this frontier was solved without the minimum-energy point under "
                        f"{deadline_s:g} s; plan again for it"
                    )
                return self._at_quant(self.argmin_quant[quant])
            return self._at_quant(quant)
        if argmin:
            return min(fits, key=lambda p: (p.energy_j, -p.time_s))
        return fits[0]  # points run slowest first

    def baseline(self, time_s: float | None = None) -> Baseline:
        """All-max-frequency energy at ``time_s`` (default: its own iteration time).

        ``E = Σ_s [busy energy_s + P_block · (T - busy time_s)]`` (docs/perseus.md §4.4, Table 6).
        With ``reference_times`` (Kareus), ``T`` is at least the baseline's own time.
        """
        t = self.baseline_time_s if time_s is None else time_s
        if self.reference_times is not None:
            # A baseline of another execution model (Kareus: sequential) may be slower than the
            # plan; it cannot run faster than its own critical path.
            t = max(t, self.baseline_time_s)
        p_block_w = self.settings.p_block_w
        energy = sum(e + p_block_w * (t - busy) for busy, e in self.baseline_busy.values())
        return Baseline(time_s=t, energy_j=energy)

    @property
    def baseline_time_s(self) -> float:
        """Critical path with every instruction at its measured maximum-frequency time.

        The row at the highest clock, as :attr:`baseline_busy` counts its energy: with noisy
        times a lower clock can measure faster, but all-max runs the highest clock.
        """
        if self.reference_times is not None:
            times = [self.reference_times[(ins.stage, ins.kind)] for ins in self.dag.instructions]
        else:
            model = self.model
            tops = {key: model.top_option(*key).time_s for key in self.options}
            times = [tops[(ins.stage, ins.kind)] for ins in self.dag.instructions]
        return critical_path_s(self.dag, times)

    def saving(self, point: FrontierPoint) -> float:
        """Fractional energy saving of ``point`` against all-max at the same iteration time."""
        return 1.0 - point.energy_j / self.baseline(point.time_s).energy_j

    def planned_options(self, point: FrontierPoint) -> list[Option]:
        """Per-instruction option: the slowest whose quantized time fits the planned duration."""
        return self.model.planned(point.durations)

    def frequencies(self, point: FrontierPoint) -> list[float]:
        """Per-instruction frequency of :meth:`planned_options`."""
        return [o.freq_mhz for o in self.planned_options(point)]

    def within_slowdown(
        self,
        point: FrontierPoint,
        max_slowdown: float = 0.001,
        *,
        switch_latency_s: float = 0.0,
        limit_s: float | None = None,
        time_cv: float = 0.0,
        time_se: float = 0.0,
        noise: TimeNoise | None = None,
        latency_samples_s: Sequence[float] = (),
        request_ahead_s: float | None = None,
    ) -> list[Option]:
        """Per-instruction options for ``point``, realized within ``max_slowdown`` of all-max.

        Floor quantization lets a planned duration hide up to one τ of real time per instruction,
        so a frontier plan can realize slightly slower than all-max even at T_min (+0.35 % on the
        reference's synthetic case); a clock change that lands ``switch_latency_s`` late runs the
        start of an instruction at its predecessor's clock. The guard
        (:mod:`powerlib.planning.perseus.guard`) solves the plan once more on real durations
        (one min-cost flow), then speeds up the cheapest instructions on the realized critical
        path while the replay with that latency is too slow; all-max itself always qualifies
        (no clock ever changes), so it terminates, and it keeps most of the saving.

        Args:
            point: A frontier point (normally ``fastest``).
            max_slowdown: Allowed realized slowdown, as a fraction.
            switch_latency_s: Delay between a clock request and its effect. The runtime requests
                an instruction's clock when the previous instruction on its stage ends.
            limit_s: The time not to exceed (before ``max_slowdown``); default: all-max's. A
                straggler's iteration time for the ``deadline`` policy.
            time_cv: The run-to-run spread of instruction times (relative standard deviation,
                measured while profiling). With it, the guard then checks the plan's
                *expected* time under that noise against all-max's on the same draws
                (:class:`~powerlib.planning.perseus.noise.NoisyReplay`) and keeps speeding up
                the cheapest instructions that are critical in the draws until it is within
                ``max_slowdown``: a plan that spends every path's slack realizes slower than
                all-max under noise, because the iteration waits for the slowest of many paths
                that are all just critical (issue 32).
            time_se: The relative standard error of a profiled row's mean time: the noise
                stage also draws the profile's own error (see ``NoisyReplay``'s ``row_se``).
            noise: Where the noise is shared (per iteration, per microbatch, independent);
                overrides ``time_cv`` (issue 45, docs/perseus.md §2.8).
            latency_samples_s: Measured clock-change latencies: the noise stage draws each
                switch's latency from them.
            request_ahead_s: The runtime requests switches up this long before the previous
                instruction's predicted end (:attr:`ReplayModel.request_ahead_s
                <powerlib.planning.perseus.replay.ReplayModel.request_ahead_s>`).
        """
        return guard.within_slowdown(
            dataclasses.replace(self.model, request_ahead_s=request_ahead_s),
            point.durations,
            max_slowdown,
            reference_s=self.baseline_time_s if limit_s is None else limit_s,
            held=limit_s is not None,  # a straggler holds the iteration at the deadline
            switch_latency_s=switch_latency_s,
            time_cv=time_cv,
            time_se=time_se,
            started=getattr(self.direct, "guard_starts", None),
            noise=noise,
            latency_samples_s=latency_samples_s,
        )

    def realized(
        self,
        chosen: Sequence[Option],
        switch_latency_s: float = 0.0,
        *,
        request_ahead_s: float | None = None,
    ) -> Baseline:
        """Realized time and energy of per-instruction options, from the measured profile.

        With ``switch_latency_s``, an instruction whose clock differs from its stage
        predecessor's and that starts less than the latency after that predecessor ended runs
        at the old clock until the change lands (the runtime requests the next clock when an
        instruction ends; the first instruction follows the previous iteration's last), or,
        with ``request_ahead_s``, a switch up is requested that long before the predecessor's
        predicted end and the predecessor's tail runs at the faster clock.
        """
        model = self.model
        if request_ahead_s is not None:
            model = dataclasses.replace(model, request_ahead_s=request_ahead_s)
        run = replay_options(model, chosen, switch_latency_s)
        return Baseline(time_s=run.time_s, energy_j=run.energy_j)

    def replay(self, point: FrontierPoint) -> Baseline:
        """Realized iteration time and energy of ``point``'s plan, from the *measured* profile.

        Every instruction runs at its planned frequency for its measured time and energy; the
        iteration time is the critical path, and each stage pays ``P_block`` while it waits
        (docs/perseus.md §5.5). This is what the plan would cost if the profile were exact, without
        the fit and the quantization the planner works with.
        """
        return self.realized(self.planned_options(point))

    def plan(
        self,
        point: FrontierPoint,
        *,
        policy: str,
        chosen: Sequence[Option] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> FrequencyPlan:
        """The plan of ``point``: per stage, its instructions in execution order and their clocks.

        Every instruction records its planned duration and its option's measured time and
        energy (``predicted_*``: the apply phase times a request ahead by it); a Kareus option
        also its execution mode and partition settings.

        Args:
            point: The frontier point.
            policy: Recorded in the plan.
            chosen: Per-instruction options overriding the point's (e.g. from
                :meth:`within_slowdown`).
            metadata: Extra workload fields.
        """
        options = self.planned_options(point) if chosen is None else list(chosen)
        stages = tuple(
            tuple(
                _planned(
                    self.dag.instructions[i],
                    options[i],
                    point.durations[i] * self.settings.unit_time_s,
                )
                for i in self.dag.stage_order(stage)
            )
            for stage in range(self.num_stages)
        )
        base = self.baseline(point.time_s)
        return FrequencyPlan(
            stages=stages,
            workload={
                "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches,
                "schedule": self.schedule_name,
                "num_chunks": self.num_chunks,
                "placement": self.placement,
                "p_block_w": self.settings.p_block_w,
                "unit_time_s": self.settings.unit_time_s,
                "order": self.settings.order,
                "pruning": self.settings.pruning,
                "cost_model": self.settings.cost_model,
                **(metadata or {}),
            },
            summary={
                "policy": policy,
                "iteration": point.iteration,
                "time_s": point.time_s,
                "energy_j": point.energy_j,
                "effective_energy_j": point.effective_energy_j,
                "baseline_energy_j": base.energy_j,
                "saving": 1.0 - point.energy_j / base.energy_j,
            },
            source="the plan",
        )


def _planned(ins: Instruction, option: Option, planned_time_s: float) -> PlannedInstruction:
    """One instruction of a plan; a Kareus option's knob gives its execution and settings."""
    if option.knob is None:
        # the measured time at the clock: when the apply phase requests the next clock ahead
        return PlannedInstruction(
            ins,
            float(option.freq_mhz),
            planned_time_s=planned_time_s,
            predicted_time_s=float(option.time_s),
            predicted_energy_j=float(option.energy_j),
        )
    fields = option.knob.to_plan()
    return PlannedInstruction(
        ins,
        float(option.freq_mhz),
        execution=fields["execution"],
        overlap={key: PartitionSetting(**entry) for key, entry in fields["overlap"].items()},
        planned_time_s=planned_time_s,
        predicted_time_s=float(option.time_s),
        predicted_energy_j=float(option.energy_j),
        option_source=fields.get("option_source"),
    )


def compute_frontier(
    profile: Profile | None,
    schedule: Schedule,
    *,
    settings: FrontierSettings,
    schedule_name: str,
    num_microbatches: int,
    num_chunks: int = 1,
    placement: str = "looped",
    progress: Callable[[int, int], None] | None = None,
    candidates: Mapping[tuple[int, str], Sequence[tuple[Any, ...]]] | None = None,
    reference: Mapping[tuple[int, str], tuple[float, float]] | None = None,
    wanted: Wanted | None = None,
) -> Frontier:
    """Profile + schedule -> the exact frontier of the relaxed (fitted) problem.

    Args:
        profile: Measured (stage, instruction, frequency, time, energy) rows, or ``None`` with
            ``candidates``.
        schedule: Per stage, its instructions in execution order.
        settings: τ, ``P_block``, the filter order, the cost model, the solver and its work
            limit (:class:`FrontierSettings`).
        schedule_name: Recorded in plans.
        num_microbatches: Microbatches per iteration (recorded).
        num_chunks: Model chunks per stage.
        placement: ``looped`` or ``v``.
        progress: ``(done, expected)`` callback per solver step.
        candidates: Instead of ``profile`` (then ``None``): per ``(stage, kind)``, the
            execution options ``(freq_mhz, time_s, energy_j, knob)``, several per clock allowed
            (Kareus's composed instruction options). The solver is the same; only the options
            differ.
        reference: With ``candidates``: per ``(stage, kind)``, the ``(time_s, energy_j)`` of
            the baseline the savings are measured against (Kareus: sequential execution at the
            maximum clock). Default: each pair's fastest option.
        wanted: For the direct solve: which points (default: ``T_min`` and ``T*``).

    Raises:
        PlanError: The profile does not cover the schedule, parameters are out of range, or
            the solve is past ``settings.max_work``.
        BackendUnavailableError: ``solver="direct"`` without highspy.
    """
    settings = _resolve_solver(settings)
    unit_time_s, p_block_w = settings.unit_time_s, settings.p_block_w
    check_quantum(unit_time_s, p_block_w)
    dag = build_dag(schedule, placement)
    used = {(ins.stage, ins.kind) for ins in dag.instructions}
    source = OptionSource(profile, candidates, reference)
    source.check(used, dag.num_stages)
    options, costs = _cost_models(source, dag, used, settings)
    solver_pd = PhillipsDessouky(len(dag.instructions), dag.edges, costs)
    stub = Frontier(
        points=(),
        dag=dag,
        schedule_name=schedule_name,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        options=options,
        settings=settings,
        baseline_busy=source.baseline_busy(dag),
        measured=source.fastest_per_clock(used),
        placement=placement,
        reference_times=source.reference_times(),
    )
    n_block = dag.num_stages * p_block_w
    if settings.solver != "direct":
        points = walk_points(solver_pd, settings.max_work, n_block, unit_time_s, progress)
        return dataclasses.replace(stub, points=tuple(points))
    points, extra = direct_points(
        solver_pd,
        wanted or Wanted(),
        n_block,
        unit_time_s,
        stub.model,
        lambda: stub.baseline_time_s,
        settings.max_work,
        progress,
        settings.direct_solver,
    )
    return dataclasses.replace(stub, points=tuple(points), **extra)


def _cost_models(
    source: OptionSource, dag: PipelineDAG, used: set[tuple[int, str]], settings: FrontierSettings
) -> tuple[dict[tuple[int, str], list[Option]], list[Any]]:
    """Per used ``(stage, kind)``, its prepared options; per DAG node, its fitted cost model."""
    options: dict[tuple[int, str], list[Option]] = {}
    costs_of: dict[tuple[int, str], Any] = {}  # CostModels (solver.ActivityCost's shape)
    for stage in range(dag.num_stages):
        for kind in (k for k in KINDS if (stage, k) in used):
            opts = prepare_options(
                source.points(stage, kind),
                unit_time_s=settings.unit_time_s,
                p_block_w=settings.p_block_w,
                order=settings.order,
                pruning=settings.pruning,
            )
            options[(stage, kind)] = opts
            costs_of[(stage, kind)] = build_cost_model(
                opts, kind=settings.cost_model, unit_time_s=settings.unit_time_s
            )
    return options, [costs_of[(ins.stage, ins.kind)] for ins in dag.instructions]


def check_solver(solver: str) -> None:
    """Refuse a solver name that is not one of :data:`SOLVERS`.

    Raises:
        PlanError: An unknown solver.
    """
    if solver not in SOLVERS:
        raise PlanError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")


def resolve_solver(solver: str) -> str:
    """The solver that will run: ``auto`` is ``direct`` where a direct solve can run, else ``walk``.

    Raises:
        PlanError: An unknown solver.
    """
    check_solver(solver)
    if solver == "auto":
        return "direct" if direct_available() else "walk"
    return solver


def _resolve_solver(settings: FrontierSettings) -> FrontierSettings:
    """``settings`` with ``solver="auto"`` resolved to the solver that will run."""
    return dataclasses.replace(settings, solver=resolve_solver(settings.solver))
