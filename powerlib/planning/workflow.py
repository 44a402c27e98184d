"""Perseus planning from a profile, as one call: what ``powerlib plan`` runs.

:func:`plan_from_profile` checks the work estimate, builds the pipeline schedule, solves the
frontier and applies the policy step (:func:`~powerlib.planning.choice.choose`);
:func:`write_outputs` writes the frontier CSV, the plan file and the plot. Both are plain Python:
the CLI only parses options before and formats the result after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.errors import PlanError
from powerlib.planning.choice import Choice, Policy, choose
from powerlib.planning.perseus.direct import direct_available
from powerlib.planning.perseus.frontier import SOLVERS, Frontier, FrontierSettings, compute_frontier
from powerlib.planning.perseus.points import Wanted
from powerlib.planning.perseus.report import plot_frontier, summary, write_frontier_csv
from powerlib.planning.perseus.work import DEFAULT_MAX_WORK, WORK_HINT, estimate_pipeline_work
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule

__all__ = [
    "PlanResult",
    "default_unit_time_s",
    "plan_from_profile",
    "planner_settings",
    "wanted_for",
    "write_outputs",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """What :func:`plan_from_profile` found.

    Attributes:
        frontier: The solved time-energy frontier.
        choice: The policy's point, guarded and judged.
        summary: The ``powerlib.plan-summary.v1`` record (what ``powerlib plan --json`` prints).
        solve_time_s: Wall time the frontier solve took.
        p_block_w: The blocking power planned with (W): given, else the profile's.
        unit_time_s: The time quantum τ planned with (s): given, else the profile's, else
            :func:`default_unit_time_s`.
    """

    frontier: Frontier
    choice: Choice
    summary: dict[str, Any]
    solve_time_s: float
    p_block_w: float
    unit_time_s: float


def default_unit_time_s(profile: Profile) -> float:
    """The default time quantum τ: a power of ten at most 1/20 of the shortest instruction.

    1 ms for instructions of 20 to 200 ms, as the Perseus artifact used on A100 (its GPT-3
    profile: 1 ms); 0.1 ms for 5 ms instructions. The rule a training session uses when it is
    not given τ, so ``powerlib plan`` on a session's profile plans as the session did.
    """
    shortest = min(r.time_s for r in profile.rows)
    return 10.0 ** math.floor(math.log10(shortest / 20.0))


def planner_settings(
    profile: Profile, *, p_block_w: float | None = None, unit_time_s: float | None = None
) -> tuple[float, float]:
    """``(p_block_w, unit_time_s)`` to plan ``profile`` with: given, else carried, else default.

    The time quantum defaults to :func:`default_unit_time_s`; the blocking power has no
    default.

    Raises:
        PlanError: Neither ``p_block_w`` nor the profile gives the blocking power.
    """
    p_block = p_block_w if p_block_w is not None else profile.p_block_w
    if p_block is None:
        raise PlanError(
            f"{profile.source}: the profile does not carry the blocking power (p_block_w); "
            "give it (A100: 83.64 W, A40: 70.38 W)"
        )
    if unit_time_s is None:
        unit_time_s = (
            profile.unit_time_s if profile.unit_time_s is not None else default_unit_time_s(profile)
        )
    return p_block, unit_time_s


def default_chunks(schedule: str, chunks: int | None) -> int:
    """Virtual stages per GPU: ``chunks`` if given, else 2 for ``interleaved`` and 1 otherwise."""
    return chunks if chunks is not None else (2 if schedule == "interleaved" else 1)


def plan_from_profile(
    profile_or_path: Profile | str | Path,
    *,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    chunks: int | None = None,
    p_block_w: float | None = None,
    unit_time_s: float | None = None,
    order: str = "filter-then-subtract",
    cost_model: str = "exp",
    policy: Policy,
    max_work: int | None = DEFAULT_MAX_WORK,
    progress: Callable[[int, int], None] | None = None,
    solver: str = "auto",
    sweep: int = 0,
) -> PlanResult:
    """Solve a pipeline's Perseus frontier from a profile and choose ``policy``'s plan.

    Args:
        profile_or_path: A :class:`~powerlib.planning.profile.Profile` or the path of a CSV or
            JSON profile.
        stages: Pipeline stages N (the profile must cover them).
        microbatches: Microbatches M per iteration.
        schedule: ``1f1b``, ``gpipe`` or ``interleaved``.
        chunks: Virtual stages per GPU (default: 2 for ``interleaved``, else 1).
        p_block_w: Power while blocked on communication (W); ``None``: the profile's
            (:func:`planner_settings`).
        unit_time_s: Time quantum τ (s); ``None``: the profile's, else
            :func:`default_unit_time_s`.
        order: ``filter-then-subtract`` (the paper) or ``subtract-then-filter``.
        cost_model: ``exp`` (the paper) or ``convex``.
        policy: Which frontier point becomes the plan.
        max_work: Refuse a frontier estimated past this many instruction-steps (``None``: no
            limit), before the schedule is built.
        progress: ``progress(done, expected)`` as the walk advances.
        solver: ``auto`` (direct where highspy is installed, else the walk), ``direct`` (one
            linear program per point needed: T_min, T* and the policy's; docs/perseus.md §2.6)
            or ``walk`` (the whole frontier, one quantum at a time).
        sweep: With the direct solve, this many evenly spaced frontier points as well (for the
            frontier CSV and plot); the walk always has every point.

    Raises:
        PlanError: A profile that cannot plan the pipeline, no blocking power given or carried,
            too much work, or a deadline the frontier cannot meet.
    """
    if solver not in SOLVERS:
        raise PlanError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if solver == "auto":
        solver = "direct" if direct_available() else "walk"
    num_chunks = default_chunks(schedule, chunks)
    profile = (
        profile_or_path if isinstance(profile_or_path, Profile) else Profile.read(profile_or_path)
    )
    profile.validate_for(stages, ())  # a profile of 8 stages cannot plan 100000
    p_block_w, unit_time_s = planner_settings(profile, p_block_w=p_block_w, unit_time_s=unit_time_s)
    # Before the schedule is even built: M = 100000 or τ = 1e-7 s would run for hours.
    estimate_pipeline_work(
        profile.option_points(),
        num_stages=stages,
        num_microbatches=microbatches,
        num_chunks=num_chunks,
        unit_time_s=unit_time_s,
        solver=solver,
    ).check(max_work, hint=WORK_HINT)
    sched = build_schedule(schedule, stages, microbatches, num_chunks)
    started = time.perf_counter()
    settings = FrontierSettings(
        unit_time_s=unit_time_s,
        p_block_w=p_block_w,
        order=order,
        cost_model=cost_model,
        solver=solver,
        max_work=max_work,
    )
    frontier = compute_frontier(
        profile,
        sched,
        settings=settings,
        schedule_name=schedule,
        num_microbatches=microbatches,
        num_chunks=num_chunks,
        progress=progress,
        wanted=wanted_for(policy, sweep=sweep),
    )
    solve_time_s = time.perf_counter() - started
    choice = choose(frontier, policy)
    return PlanResult(
        frontier=frontier,
        choice=choice,
        summary=summary(choice, solve_time_s=solve_time_s),
        solve_time_s=solve_time_s,
        p_block_w=p_block_w,
        unit_time_s=unit_time_s,
    )


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


def write_outputs(
    choice: Choice,
    *,
    frontier_out: str | Path | None = None,
    plan_out: str | Path | None = None,
    plot_path: str | Path | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write a choice's frontier CSV, plan file (``powerlib.plan.v1``) and frontier plot.

    Args:
        choice: The chosen plan and its frontier.
        frontier_out: Frontier CSV path, or ``None``.
        plan_out: Plan file path, or ``None``.
        plot_path: Frontier PNG path (needs ``powerlib[plot]``), or ``None``.
        metadata: Extra workload fields for the plan file.
    """
    if frontier_out:
        write_frontier_csv(choice.frontier, frontier_out)
    if plan_out:
        choice.plan(metadata=metadata).write(plan_out)
    if plot_path:
        plot_frontier(choice.frontier, choice.point, plot_path)
