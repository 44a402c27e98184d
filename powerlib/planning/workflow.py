"""Perseus planning from a profile, as one pipeline: ``powerlib plan``, the demo and rank 0.

:func:`plan_profile` takes a :class:`~powerlib.planning.profile.Profile` and a
:class:`PlanRequest` (the workload, the policy, the planner's settings) and returns a
:class:`PlanResult`: it works out the blocking power and the time quantum τ
(:func:`resolve_p_block`, :func:`resolve_unit_time`), checks the work estimate
(:func:`check_work`), picks the order to plan on (:func:`resolve_order`), solves the frontier
and applies the policy step (:func:`~powerlib.planning.choice.choose`); :func:`replan` adds a
new straggler deadline to a session's frontier. :meth:`PlanResult.write` writes the files
(:class:`~powerlib.planning.perseus.report.PlanOutputs`). Pure planning: no device, no
environment; the CLI parses options before and formats the result after, a session gathers its
ranks' profiles before (``powerlib.runtime.planning_step.make_plan``).

A request that carries :class:`SessionInputs` is a session's (rank 0 after profiling): the
blocking power falls back to what the ranks measured, a deadline below T_min is clipped up to it,
the summary records the guard's inputs and the objection (``refused``), a refused plan is never
built, and the plan file records its deadline and sources. Without them (``powerlib plan``) the
profile must carry P_block or it must be given, a deadline below T_min is an error, and the plan
is built whatever the verdict.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from powerlib.errors import PlanError
from powerlib.planning.choice import Choice, Policy, check_policy, choose
from powerlib.planning.perseus.frontier import (
    Frontier,
    FrontierSettings,
    check_solver,
    compute_frontier,
    resolve_solver,
)
from powerlib.planning.perseus.noise import TimeNoise
from powerlib.planning.perseus.points import Wanted
from powerlib.planning.perseus.report import (
    GuardInputs,
    PlanOutputs,
    PlanSummary,
    summary,
    write_plan_outputs,
)
from powerlib.planning.perseus.work import DEFAULT_MAX_WORK, WORK_HINT, estimate_pipeline_work
from powerlib.planning.pipeline import Instruction, Schedule, build_dag
from powerlib.planning.plan import RECORDED, FrequencyPlan
from powerlib.planning.power_floor import floored_profile
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule
from powerlib.progress import Progress

__all__ = [
    "PlanRequest",
    "PlanResult",
    "SessionInputs",
    "check_work",
    "default_chunks",
    "default_unit_time_s",
    "plan_profile",
    "replan",
    "resolve_order",
    "resolve_p_block",
    "resolve_unit_time",
    "wanted_for",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInputs:
    """What a session's ranks measured while profiling: what makes a request a session's.

    Attributes:
        p_block_w: The blocking power the ranks' attribution solved (their mean), if any.
        idle_power_w: The devices' power before the session (the last resort for P_block).
        switch_latency_source: Where the request's ``switch_latency_s`` came from: ``given``,
            ``measured`` or ``default`` (recorded in the summary).
        power_floor_w: The highest power-smoothing floor the ranks' GPUs hold (W; 0: none): the
            rows and P_block are raised to it (:func:`~powerlib.planning.power_floor.floored_profile`).
    """

    p_block_w: float | None = None
    idle_power_w: tuple[float, ...] = ()
    switch_latency_source: str = "default"
    power_floor_w: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """Everything :func:`plan_profile` plans with, besides the profile.

    Attributes:
        num_stages: Pipeline stages N (the profile must cover them).
        num_microbatches: Microbatches M per iteration.
        schedule: ``1f1b``, ``gpipe``, ``interleaved``, or ``recorded`` (only the order in
            ``recorded``: zero-bubble and V schedules).
        num_chunks: Virtual stages per GPU; ``None``: :func:`default_chunks`.
        placement: ``looped`` or ``v``.
        recorded: The order a session's hooks recorded, per stage (the ranks of a stage agreed);
            ``None``: none was. Planned on where it is a complete pipeline (:func:`resolve_order`).
        policy: ``fastest``, ``deadline`` or ``min-energy``.
        deadline_s: T′ for ``deadline``.
        deadline_ratio: T′ as a multiple of the frontier's all-max iteration time, for
            ``deadline`` when ``deadline_s`` is not given.
        argmin: ``deadline``: the minimum-energy point with T <= T′ instead of the slowest.
        max_slowdown: The slowdown guard (``fastest``, ``deadline``), as a fraction.
        switch_latency_s: The clock-change latency the guard assumes.
        time_cv: Run-to-run spread of instruction times the guard plans for.
        time_se: Relative standard error of a profiled row's mean time.
        time_noise: Where the noise is shared (the sweep's estimate); ``None``: ``time_cv``
            independent per instruction.
        latency_samples_s: Measured clock-change latencies the guard draws switches from.
        request_ahead_s: The apply phase requests a switch up this long before the previous
            instruction's predicted end (a session's ``apply.request_ahead``; recorded in the
            plan file, which the apply phase reads it from); ``None``: at its end.
        p_block_w: Blocking power (W); ``None``: :func:`resolve_p_block`.
        unit_time_s: Time quantum τ (s); ``None``: :func:`resolve_unit_time`.
        solver: ``auto``, ``direct`` or ``walk``.
        direct_solver: What solves direct points: ``auto`` (the compiled flow where it is
            built, else HiGHS) or ``highs`` (``powerlib plan`` passes
            :func:`powerlib.config.direct_solver`).
        order: ``filter-then-subtract`` (the paper) or ``subtract-then-filter``.
        pruning: ``weak`` (default) or ``artifact`` (the SOSP'24 artifact's strict dominance).
        cost_model: ``exp`` (the paper) or ``convex``.
        max_work: Refuse a frontier past this many instruction-steps (``None``: no limit).
        work_hint: Check the work estimate before the schedule is built, saying this on refusal
            (:func:`check_work`); ``None``: no estimate (the solve still checks the exact
            figure).
        frontier_points: Evenly spaced frontier points a direct solve adds for the outputs
            (frontier CSV, plot); 0: none (the walk always has every point).
        session: A session's measured inputs (see the module's docstring); ``None``: a profile
            file's request, as ``powerlib plan``.
        progress: ``progress(done, expected)`` as the solve advances.
        say: Where the planning lines go (default: nowhere).
    """

    num_stages: int
    num_microbatches: int
    schedule: str = "1f1b"
    num_chunks: int | None = None
    placement: str = "looped"
    recorded: Mapping[int, Sequence[Instruction]] | None = None
    policy: str = "fastest"
    deadline_s: float | None = None
    deadline_ratio: float | None = None
    argmin: bool = False
    max_slowdown: float = 0.001
    switch_latency_s: float = 0.005
    time_cv: float = 0.0
    time_se: float = 0.0
    time_noise: TimeNoise | None = None
    latency_samples_s: tuple[float, ...] = ()
    request_ahead_s: float | None = None
    p_block_w: float | None = None
    unit_time_s: float | None = None
    solver: str = "auto"
    direct_solver: str = "auto"
    order: str = "filter-then-subtract"
    pruning: str = "weak"
    cost_model: str = "exp"
    max_work: int | None = DEFAULT_MAX_WORK
    work_hint: str | None = WORK_HINT
    frontier_points: int = 0
    session: SessionInputs | None = None
    progress: Callable[[int, int], None] | None = None
    say: Progress = field(default_factory=lambda: Progress(False))

    def __post_init__(self) -> None:
        check_policy(
            self.policy, max_slowdown=self.max_slowdown, switch_latency_s=self.switch_latency_s
        )
        check_solver(self.solver)
        if self.policy == "deadline" and self.deadline_s is None and self.deadline_ratio is None:
            raise PlanError(
                "the deadline policy needs --deadline-s (the straggler's iteration time)"
            )
        if self.deadline_ratio is not None and not (
            math.isfinite(self.deadline_ratio) and self.deadline_ratio >= 1.0
        ):
            raise PlanError(f"deadline_ratio must be >= 1, got {self.deadline_ratio}")

    @property
    def chunks(self) -> int:
        """Virtual stages per GPU: :attr:`num_chunks`, else :func:`default_chunks`."""
        return default_chunks(self.schedule, self.num_chunks)

    @property
    def solver_to_run(self) -> str:
        """:attr:`solver` with ``auto`` resolved (direct where highspy is installed)."""
        return resolve_solver(self.solver)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """What :func:`plan_profile` found.

    Attributes:
        profile: The profile planned on.
        frontier: The solved time-energy frontier (with the policy's points).
        choice: The policy's point, guarded and judged.
        summary: The ``powerlib.plan-summary.v2`` record (``summary.json``, ``plan --json``).
        plan_metadata: The extra workload fields of the plan file (a session's: its deadline,
            profile and order sources), or ``None``.
        solve_time_s: Wall time the frontier solve took.
        p_block_w: The blocking power planned with (W).
        p_block_source: ``given``, ``profile``, ``measured`` or ``idle``.
        unit_time_s: The time quantum τ planned with (s).
        unit_time_source: ``given``, ``profile`` or ``default``.
        order_source: ``generated`` (the named schedule's order) or ``recorded``.
        deadline_s: The deadline the policy planned for (clipped to T_min for a session).
    """

    profile: Profile
    frontier: Frontier
    choice: Choice
    summary: PlanSummary
    plan_metadata: Mapping[str, float | str | None] | None
    solve_time_s: float
    p_block_w: float
    p_block_source: str
    unit_time_s: float
    unit_time_source: str
    order_source: str
    deadline_s: float | None

    @property
    def refused(self) -> str | None:
        """Why a session's plan is not applied (its summary's ``refused``), or ``None``."""
        return self.summary.refused

    def frequency_plan(self) -> FrequencyPlan | None:
        """The plan to apply (``powerlib.plan.v1``); ``None`` when a session's was refused.

        Built on each call: a refused plan is never built, nothing could apply it.
        """
        if self.refused is not None:
            return None
        return self.choice.plan(metadata=self.plan_metadata)

    def planned_profile(self) -> Profile:
        """:attr:`profile` with the P_block and τ it was planned with (``profile.csv``).

        ``powerlib plan`` on it plans the same way.
        """
        return Profile(
            self.profile.rows,
            source=self.profile.source,
            p_block_w=self.p_block_w,
            unit_time_s=self.unit_time_s,
        )

    def write(self, outputs: PlanOutputs, *, say: Progress | None = None) -> None:
        """Write this result's files (:func:`write_plan_outputs`)."""
        write_plan_outputs(
            outputs,
            self.choice,
            plan_metadata=self.plan_metadata,
            refused=self.refused is not None,
            profile=self.planned_profile if outputs.profile_csv else None,
            info=self.summary,
            say=say,
        )


def default_unit_time_s(profile: Profile) -> float:
    """The default time quantum τ: a power of ten at most 1/20 of the shortest instruction.

    1 ms for instructions of 20 to 200 ms, as the Perseus artifact used on A100 (its GPT-3
    profile: 1 ms); 0.1 ms for 5 ms instructions. The rule a training session uses when it is
    not given τ, so ``powerlib plan`` on a session's profile plans as the session did.
    """
    shortest = min(r.time_s for r in profile.rows)
    return 10.0 ** math.floor(math.log10(shortest / 20.0))


def default_chunks(schedule: str, chunks: int | None) -> int:
    """Virtual stages per GPU: ``chunks`` if given, else 2 for ``interleaved`` and 1 otherwise."""
    return chunks if chunks is not None else (2 if schedule == "interleaved" else 1)


def resolve_unit_time(profile: Profile, unit_time_s: float | None) -> tuple[float, str]:
    """``(τ, source)``: given, else the profile's, else :func:`default_unit_time_s`."""
    if unit_time_s is not None:
        return unit_time_s, "given"
    if profile.unit_time_s is not None:
        return profile.unit_time_s, "profile"
    return default_unit_time_s(profile), "default"


def resolve_p_block(
    profile: Profile, request: PlanRequest, say: Progress | None = None
) -> tuple[float, str]:
    """``(P_block, source)``: given, else carried, else measured, else idle power, else an error.

    The profile's carried P_block is used unless a session measured one; the devices' idle power
    (said on ``say``) only when nothing else gives it.

    Raises:
        PlanError: Nothing gives the blocking power.
    """
    session = request.session
    measured = None if session is None else session.p_block_w
    if request.p_block_w is not None:
        return request.p_block_w, "given"
    if profile.p_block_w is not None and measured is None:  # a saved profile carries it
        return profile.p_block_w, "profile"
    if session is None:
        raise PlanError(
            f"{profile.source}: the profile does not carry the blocking power (p_block_w); "
            "give it (A100: 83.64 W, A40: 70.38 W)"
        )
    if measured is not None:
        return measured, "measured"
    if idle := [p for p in session.idle_power_w if p]:
        p_block_w = sum(idle) / len(idle)
        (say or request.say).say(
            f"no usable gaps between instructions for P_block; using the devices' power before "
            f"the session, {p_block_w:.1f} W (pass p_block_w to set it)",
        )
        return p_block_w, "idle"
    raise PlanError(
        "P_block is unknown: no rank measured time between instructions; pass p_block_w"
    )


def check_work(profile: Profile, request: PlanRequest) -> None:
    """Refuse a solve past ``request.max_work`` by its estimate, before any schedule is built.

    Cheap (no DAG): M = 100000 or τ = 1e-7 s would run for hours. :func:`plan_profile` checks
    first where ``request.work_hint`` is set; the demo checks before it emulates anything.

    Raises:
        PlanError: The estimate, the limit and ``request.work_hint`` (:data:`WORK_HINT` if none).
    """
    estimate_pipeline_work(
        profile.option_points(),
        num_stages=request.num_stages,
        num_microbatches=request.num_microbatches,
        num_chunks=request.chunks,
        unit_time_s=resolve_unit_time(profile, request.unit_time_s)[0],
        solver=request.solver_to_run,
        direct_solver=request.direct_solver,
    ).check(request.max_work, hint=request.work_hint or WORK_HINT)


def resolve_order(request: PlanRequest) -> tuple[Schedule, str]:
    """``(order, source)``: the order a session recorded, else the named schedule's.

    The recorded order is used when it covers every stage and forms a complete, deadlock-free
    pipeline the planner models; otherwise the generated order of ``request.schedule`` is
    (``recorded`` has none: then the recorded order must do).

    Raises:
        PlanError: ``recorded`` without a usable recorded order.
    """
    n = request.num_stages
    generated: Schedule | None = None
    if request.schedule != RECORDED:
        generated = build_schedule(request.schedule, n, request.num_microbatches, request.chunks)

    def fallback(why: str) -> tuple[Schedule, str]:
        if generated is None:
            raise PlanError(f"schedule 'recorded' but {why}; there is no built-in order to use")
        return generated, "generated"

    if request.recorded is None:
        return fallback("no instruction order was recorded")
    if sorted(request.recorded) != list(range(n)):
        return fallback(f"the recorded orders cover stages {sorted(request.recorded)}")
    recorded = [list(request.recorded[s]) for s in range(n)]
    try:
        build_dag(recorded, request.placement)
    except PlanError as err:
        if generated is None:
            raise PlanError(
                f"the recorded order is not a pipeline the planner models: {err}"
            ) from None
        request.say.say(
            f"the recorded order is not a pipeline the planner models ({err}); "
            f"planning on the {request.schedule} order",
        )
        return generated, "generated"
    if generated is not None and recorded != generated:
        request.say.say(
            f"the recorded instruction order differs from {request.schedule}'s; planning on it"
        )
    return recorded, "recorded"


def wanted_for(policy: Policy, *, sweep: int = 0) -> Wanted:
    """The frontier points a direct solve needs for ``policy``: T_min, T*, the deadline's, its guard."""
    deadline = (
        () if policy.name != "deadline" or policy.deadline_s is None else (policy.deadline_s,)
    )
    guards = (
        ((policy.deadline_s if policy.name == "deadline" else None, policy.max_slowdown),)
        if policy.guarded
        else ()
    )
    return Wanted(
        t_star=True,
        deadlines_s=() if policy.argmin else deadline,
        argmin_deadlines_s=deadline if policy.argmin else (),
        sweep=sweep,
        guards=guards,
    )


def _needs_frontier(request: PlanRequest) -> bool:
    """Whether the policy's deadline is known only once the frontier is.

    A deadline ratio is resolved against the frontier's all-max time, and a session's deadline
    is clipped up to T_min.
    """
    return request.policy == "deadline" and (
        request.deadline_s is None or request.session is not None
    )


def _policy(request: PlanRequest, frontier: Frontier | None = None) -> Policy:
    """The request's policy, its deadline resolved against ``frontier`` where that is needed."""
    deadline_s = request.deadline_s
    if frontier is not None and request.policy == "deadline":
        if deadline_s is None:
            assert request.deadline_ratio is not None  # PlanRequest checked
            deadline_s = request.deadline_ratio * frontier.baseline_time_s
        if request.session is not None:
            deadline_s = max(deadline_s, frontier.fastest.time_s)
    return _guarded(request, request.policy, deadline_s)


def _guarded(request: PlanRequest, name: str, deadline_s: float | None) -> Policy:
    """Policy ``name`` at ``deadline_s`` with the request's guard settings.

    The first plan's and every re-plan's: argmin, slowdown, switch latency and noise.
    """
    return Policy(
        name=name,
        deadline_s=deadline_s,
        argmin=request.argmin,
        max_slowdown=request.max_slowdown,
        switch_latency_s=request.switch_latency_s,
        time_cv=request.time_cv,
        time_se=request.time_se,
        time_noise=request.time_noise,
        latency_samples_s=request.latency_samples_s,
        request_ahead_s=request.request_ahead_s,
    )


def _solve(
    profile: Profile, request: PlanRequest, schedule: Schedule, settings: FrontierSettings
) -> tuple[Frontier, Policy]:
    """The frontier with the policy's points, and the policy (its deadline resolved).

    A policy known before the frontier has its points solved with it; a deadline that needs
    the frontier (a ratio, a session's clip) has its points added after (``Frontier.extend``,
    from the same basis).
    """
    upfront = None if _needs_frontier(request) else _policy(request)
    frontier = compute_frontier(
        profile,
        schedule,
        settings=settings,
        schedule_name=request.schedule,
        num_microbatches=1 + max(ins.microbatch for order in schedule for ins in order),
        num_chunks=1 + max(ins.chunk for order in schedule for ins in order),
        placement=request.placement,
        progress=request.progress,
        wanted=Wanted(t_star=True, sweep=request.frontier_points)
        if upfront is None
        else wanted_for(upfront, sweep=request.frontier_points),
    )
    if upfront is not None:
        return frontier, upfront
    policy = _policy(request, frontier)
    return frontier.extend(wanted_for(policy)), policy


def plan_profile(profile: Profile, request: PlanRequest) -> PlanResult:
    """Solve a pipeline's Perseus frontier from a profile and choose the request's plan.

    Raises:
        PlanError: A profile that cannot plan the pipeline, no blocking power, too much work,
            or a deadline the frontier cannot meet.
    """
    profile.validate_for(request.num_stages, ())  # a profile of 8 stages cannot plan 100000
    floor_w = request.session.power_floor_w if request.session else 0.0  # issue 47
    profile = floored_profile(profile, floor_w)  # slack cannot go below a GPU's power floor
    p_block_w, p_block_source = resolve_p_block(profile, request)
    p_block_w = max(p_block_w, floor_w)
    unit_time_s, unit_time_source = resolve_unit_time(profile, request.unit_time_s)
    if request.work_hint is not None:  # before the schedule is even built
        check_work(profile, request)
    schedule, order_source = resolve_order(request)
    request.say.say(
        f"planning {request.num_stages} stages x "
        f"{1 + max(ins.microbatch for order in schedule for ins in order)} microbatches "
        f"({request.schedule}, {order_source} order), P_block {p_block_w:.2f} W, "
        f"tau {unit_time_s * 1e3:g} ms",
    )
    settings = FrontierSettings(
        unit_time_s=unit_time_s,
        p_block_w=p_block_w,
        order=request.order,
        pruning=request.pruning,
        cost_model=request.cost_model,
        solver=request.solver_to_run,
        max_work=request.max_work,
        direct_solver=request.direct_solver,
    )
    started = time.perf_counter()
    frontier, policy = _solve(profile, request, schedule, settings)
    solve_time_s = time.perf_counter() - started
    choice = choose(frontier, policy)
    session = request.session
    info = summary(
        choice,
        solve_time_s=solve_time_s,
        guard=None
        if session is None
        else GuardInputs(
            switch_latency_s=policy.switch_latency_s,
            time_cv=policy.noise.total_cv,
            time_se=policy.time_se,
            switch_latency_source=session.switch_latency_source,
            time_noise=policy.time_noise,
            latency_samples=len(policy.latency_samples_s),
        ),
        refused=None if session is None else choice.objection,
    )
    request.say.say(
        f"frontier of {len(frontier.points)} points"
        f"{'' if frontier.complete else ' (solved directly)'} in {solve_time_s:.1f} s; "
        f"{request.policy} plan: predicted saving "
        f"{'n/a' if info.saving_percent is None else f'{info.saving_percent:.2f} %'} per "
        f"iteration at {info.slowdown_percent:+.3f} % iteration time (replayed on the profile)",
    )
    return PlanResult(
        profile=profile,
        frontier=frontier,
        choice=choice,
        summary=info,
        plan_metadata=None
        if session is None
        else {
            "deadline_s": policy.deadline_s,
            "profile_source": profile.source,
            "order_source": order_source,
            "request_ahead_s": policy.request_ahead_s,
        },
        solve_time_s=solve_time_s,
        p_block_w=p_block_w,
        p_block_source=p_block_source,
        unit_time_s=unit_time_s,
        unit_time_source=unit_time_source,
        order_source=order_source,
        deadline_s=policy.deadline_s,
    )


def replan(result: PlanResult, request: PlanRequest, deadline_s: float) -> PlanResult:
    """A session's ``deadline`` plan for a new straggler time, from its solved frontier.

    Adds the deadline's points to ``result``'s frontier (the direct solve from its last basis,
    docs/perseus.md §2.6: seconds where the first solve took tens), then guards and judges the
    plan like the first. The deadline is clipped up to T_min; the summary records the objection
    (``refused``) but not the guard's inputs; the plan file records the sources and the deadline.
    Safe off the training thread (the frontier's own lock serialises solves).

    Args:
        result: The session's first plan (:func:`plan_profile`).
        request: The request it was planned with (its guard settings are kept).
        deadline_s: The straggler's iteration time T′.
    """
    deadline_s = max(float(deadline_s), result.frontier.fastest.time_s)
    policy = _guarded(request, "deadline", deadline_s)
    started = time.perf_counter()
    frontier = result.frontier.extend(wanted_for(policy))
    choice = choose(frontier, policy)
    solve_time_s = time.perf_counter() - started
    return dataclasses.replace(
        result,
        frontier=frontier,
        choice=choice,
        summary=summary(choice, solve_time_s=solve_time_s, refused=choice.objection),
        plan_metadata={
            "profile_source": result.profile.source,
            "order_source": result.order_source,
            "deadline_s": deadline_s,
            "request_ahead_s": policy.request_ahead_s,
        },
        solve_time_s=solve_time_s,
        deadline_s=deadline_s,
    )
