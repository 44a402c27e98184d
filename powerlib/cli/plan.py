"""``powerlib plan``: the Perseus frontier of a pipeline from a profile, and a plan.

One call to :func:`powerlib.planning.workflow.plan_profile` (then its result's writer); this
module parses the options and formats the summary.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import click

from powerlib.cli.format import pct, table
from powerlib.cli.options import Number, emit_json, plan_outputs, progress_bar
from powerlib.config import direct_solver
from powerlib.errors import PlanError
from powerlib.planning.names import COST_MODELS, POLICIES, POWER_BUDGET, SOLVERS
from powerlib.planning.perseus.frequency_options import ORDERS, PRUNINGS
from powerlib.planning.schedules import SCHEDULE_NAMES

if TYPE_CHECKING:
    from powerlib.planning.power_budget import PowerBudgetPlan
    from powerlib.planning.profile import Profile
    from powerlib.planning.workflow import PlanResult

__all__ = ["plan"]


def _existing_profile(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """Refuse a PROFILE that cannot be opened before the options are checked (one line)."""
    try:
        os.stat(value)
    except OSError as err:
        raise PlanError(f"{value}: cannot read the profile: {err.strerror}") from None
    return value


@click.command()
@click.argument(
    "profile_path",
    metavar="PROFILE",
    type=click.Path(dir_okay=False),
    callback=_existing_profile,
)
@click.option("--stages", type=click.IntRange(min=1), required=True, help="Pipeline stages N.")
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    required=True,
    help="Microbatches M per iteration.",
)
@click.option(
    "--schedule",
    type=click.Choice(SCHEDULE_NAMES),
    default="1f1b",
    show_default=True,
)
@click.option(
    "--chunks",
    type=click.IntRange(min=1),
    default=None,
    help="Virtual stages per GPU (interleaved; default 2).",
)
@click.option(
    "--p-block-w",
    type=Number(min=0.0),
    default=None,
    help="Power while blocked on communication, W (A100: 83.64, A40: 70.38). Default: the "
    "profile's (profiles a powerlib session writes carry it); required otherwise.",
)
@click.option(
    "--unit-time-s",
    type=Number(min=0.0, min_open=True),
    default=None,
    help="Time quantum τ, s. Default: the profile's, else a power of ten at most 1/20 of the "
    "shortest instruction (1 ms for 20-200 ms instructions, the Perseus artifact's τ).",
)
@click.option(
    "--order",
    type=click.Choice(ORDERS),
    default="filter-then-subtract",
    show_default=True,
    help="Pareto filter before or after the effective-energy conversion (the paper: before).",
)
@click.option(
    "--pruning",
    type=click.Choice(PRUNINGS),
    default="weak",
    show_default=True,
    help="Option pruning: weak dominance, the cheapest option per time quantum (default), or "
    "the SOSP'24 artifact's strict dominance (reproduces its published frontiers exactly).",
)
@click.option(
    "--cost-model",
    type=click.Choice(COST_MODELS),
    default="exp",
    show_default=True,
    help="Exponential fit (the paper) or the lower convex hull of the measured points.",
)
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default="fastest",
    show_default=True,
    help="Which frontier point to write as the plan; power-budget: per-GPU power limits and "
    "clocks inside --budget or --budget-w instead (docs/perseus.md §7).",
)
@click.option(
    "--budget",
    "budget_fraction",
    type=Number(min=0.0, min_open=True, max=1.0),
    default=None,
    help="Power-budget policy: the GPUs' limits sum to at most this share of their limits (0.8).",
)
@click.option(
    "--budget-w",
    type=Number(min=0.0, min_open=True),
    default=None,
    help="Power-budget policy: the budget in watts, the GPUs' limits summed (instead of --budget).",
)
@click.option(
    "--power-limit-w",
    type=Number(min=0.0, min_open=True),
    default=None,
    help="Power-budget policy: each GPU's limit now (an administrator's; never raised). Default: "
    "the profile's highest power, up to a watt (the GPUs as profiled never throttle at it).",
)
@click.option(
    "--argmin",
    is_flag=True,
    help="Deadline policy: min-energy point with T <= T' (the paper's emulation rule) instead of the slowest.",
)
@click.option(
    "--solver",
    type=click.Choice(SOLVERS),
    default="auto",
    show_default=True,
    help="direct: solve only the points the plan needs, one linear program each (seconds at "
    "16 stages x 256 microbatches; needs powerlib[fast]); walk: every point of the frontier, one "
    "time quantum at a time (the reference); auto: direct where highspy is installed.",
)
@click.option(
    "--frontier-points",
    type=click.IntRange(min=2),
    default=32,
    show_default=True,
    help="With the direct solve and --frontier-out/--plot: exact frontier points evenly spaced "
    "from the slowest to T_min (T* and the chosen point added).",
)
@plan_outputs
def plan(
    profile_path: str,
    stages: int,
    microbatches: int,
    schedule: str,
    chunks: int | None,
    p_block_w: float | None,
    unit_time_s: float | None,
    order: str,
    pruning: str,
    cost_model: str,
    policy: str,
    budget_fraction: float | None,
    budget_w: float | None,
    power_limit_w: float | None,
    deadline_s: float | None,
    argmin: bool,
    solver: str,
    frontier_points: int,
    max_slowdown: float,
    switch_latency_s: float,
    frontier_out: str | None,
    plan_out: str | None,
    plot_path: str | None,
    max_work: int,
    as_json: bool,
) -> None:
    """Compute the Perseus time-energy frontier of a pipeline from a PROFILE and pick a plan.

    PROFILE is a CSV (stage,instruction,frequency,time,energy; extra rank columns are merged:
    time = max, energy = mean; optional p_block_w and unit_time_s columns) or a JSON profile.
    Savings are against every instruction at its maximum frequency, blocking power included,
    at the chosen plan's iteration time.
    """
    from powerlib.planning.perseus.report import PlanOutputs  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.planning.workflow import PlanRequest, plan_profile  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    given = (budget_fraction, budget_w, power_limit_w)
    budget = _budget_options(policy, given, deadline_s, frontier_out, plot_path)
    profile = _read_profile(profile_path, p_block_w)
    if budget:  # power limits, not a frontier point (docs/perseus.md §7)
        layout = (stages, microbatches, schedule, chunks, deadline_s)
        return _power_budget_plan(profile, layout, budget, p_block_w, plan_out, as_json)
    with progress_bar("solving frontier") as bar:

        def progress(done: int, expected: int) -> None:
            bar.length = max(expected, 1)
            bar.update(1)

        result = plan_profile(
            profile,
            PlanRequest(
                num_stages=stages,
                num_microbatches=microbatches,
                schedule=schedule,
                num_chunks=chunks,
                policy=policy,
                deadline_s=deadline_s,
                argmin=argmin,
                max_slowdown=max_slowdown,
                switch_latency_s=switch_latency_s,
                p_block_w=p_block_w,
                unit_time_s=unit_time_s,
                solver=solver,
                direct_solver=direct_solver(),
                order=order,
                pruning=pruning,
                cost_model=cost_model,
                max_work=max_work,
                frontier_points=frontier_points if (frontier_out or plot_path) else 0,
                progress=progress,
            ),
        )
    result.write(PlanOutputs.files(frontier=frontier_out, plan=plan_out, plot=plot_path))
    if as_json:
        emit_json(result.summary.to_json())
        return
    _echo_result(result, policy)
    _echo_written(frontier=frontier_out, plan=plan_out, plot=plot_path)


def _echo_written(**paths: str | None) -> None:
    """One line per file written (``frontier written to f.csv``)."""
    for label, path in paths.items():
        if path:
            click.echo(f"{label} written to {path}")


_Budget = tuple[float | None, float | None, float | None]
"""``(--budget, --budget-w, --power-limit-w)``."""


def _budget_options(
    policy: str,
    budget: _Budget,
    deadline_s: float | None,
    frontier_out: str | None,
    plot_path: str | None,
) -> _Budget | None:
    """The options checked before any work: ``budget`` for ``--policy power-budget``.

    Returns ``None`` for the other policies.

    Raises:
        click.UsageError: A deadline policy without its deadline, ``--plot`` without
            matplotlib, a budget option with another policy, not exactly one budget, or a
            frontier output asked of the power-budget policy (it plans none).
    """
    if policy == "deadline" and deadline_s is None:
        raise click.UsageError("--policy deadline needs --deadline-s")
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError("--plot needs matplotlib: pip install 'powerlib[plot]'")
    names = ("--budget", "--budget-w", "--power-limit-w")
    given = [name for name, value in zip(names, budget) if value is not None]
    if policy != POWER_BUDGET:
        if given:
            raise click.UsageError(f"{given[0]} plans power limits: give --policy power-budget")
        return None
    if (budget[0] is None) == (budget[1] is None):
        raise click.UsageError("--policy power-budget needs --budget or --budget-w, one of them")
    if frontier_out or plot_path:
        raise click.UsageError("--policy power-budget plans limits, no frontier to write or plot")
    return budget


def _power_budget_plan(
    profile: Profile,
    layout: tuple[int, int, str, int | None, float | None],
    budget: _Budget,
    p_block_w: float | None,
    plan_out: str | None,
    as_json: bool,
) -> None:
    """``plan --policy power-budget``: per-stage limits and clocks, the uniform cap beside."""
    from powerlib.planning.pipeline import build_dag  # noqa: PLC0415 - keep CLI start fast
    from powerlib.planning.power_budget import (  # noqa: PLC0415 - keep CLI start fast
        PowerLimitModel,
        limits_plan,
        plan_power_budget,
        unthrottled_limit_w,
    )
    from powerlib.planning.schedules import build_schedule  # noqa: PLC0415 - keep CLI start fast

    stages, microbatches, schedule, chunks, deadline_s = layout
    num_chunks = chunks or (2 if schedule == "interleaved" else 1)
    if profile.num_stages != stages:
        raise click.UsageError(f"the profile has {profile.num_stages} stages, --stages {stages}")
    dag = build_dag(build_schedule(schedule, stages, microbatches, num_chunks))
    fraction, watts, limit_w = budget
    if limit_w is None:
        limit_w = unthrottled_limit_w(profile)
    budget_w = watts if watts is not None else (fraction or 0.0) * limit_w * stages
    p_block = p_block_w if p_block_w is not None else profile.p_block_w
    result = plan_power_budget(
        profile, dag, budget_w, admin_limits_w=limit_w, p_block_w=p_block, deadline_s=deadline_s
    )
    if plan_out:
        model = PowerLimitModel(profile, dag, p_block_w=p_block or 0.0, deadline_s=deadline_s)
        workload = {"num_microbatches": microbatches, "schedule": schedule}
        limits_plan(model, result, {**workload, "num_chunks": num_chunks}).write(plan_out)
    if as_json:
        emit_json({"policy": POWER_BUDGET, **result.to_json()})
    else:
        _echo_budget(result, stages)
    if not as_json:
        _echo_written(plan=plan_out)


def _echo_budget(result: PowerBudgetPlan, stages: int) -> None:
    """The power-budget plan in words: the three sets of limits, then each stage's clocks."""
    click.echo(
        f"power budget {result.budget_w:.0f} W for {stages} GPUs (limits "
        f"{max(result.admin_limits_w):.0f} W each); predicted on the profile"
    )
    base_s = result.uncapped.time_s
    rows = [
        [
            label,
            f"{outcome.time_s:.4f} s",
            f"{outcome.energy_j:.1f} J",
            f"{100.0 * (outcome.time_s / base_s - 1.0):+.2f} %",
            " ".join(f"{w:.0f}" for w in outcome.limits_w),
        ]
        for label, outcome in (
            ("uncapped", result.uncapped),
            ("uniform cap", result.uniform),
            ("powerlib", result.plan),
        )
    ]
    table(["", "iteration time", "energy / iteration", "vs uncapped", "limits (W)"], rows)
    for s, (limit_w, clocks) in enumerate(zip(result.plan.limits_w, result.plan.clocks_mhz)):
        said = ", ".join(f"{kind} {f:g} MHz" for kind, f in clocks.items())
        click.echo(f"  stage {s}: {limit_w:.0f} W, {said}")


_SOURCES = {
    "given": "given",
    "profile": "the profile's",
    "default": "default: a power of ten at most 1/20 of the shortest instruction",
}


def _echo_result(result: PlanResult, policy: str) -> None:
    """The result in words: settings, frontier, chosen point, the one predicted figure."""
    data = result.summary
    click.echo(
        f"planned with P_block {result.p_block_w:g} W ({_SOURCES[result.p_block_source]}) and "
        f"τ {result.unit_time_s:g} s ({_SOURCES[result.unit_time_source]})"
    )
    c = data.chosen
    how = "points" if data.complete_frontier else "points solved directly"
    click.echo(
        f"frontier: {data.num_points} {how}, {data.t_max_s:.4f} s (all slowest) -> "
        f"{data.t_min_s:.4f} s (T_min); minimum energy {data.t_star_energy_j:.1f} J at "
        f"T* = {data.t_star_s:.4f} s; solved in {result.solve_time_s:.1f} s"
    )
    click.echo(
        f"chosen ({policy}): {c.time_s:.4f} s, {c.energy_j:.1f} J planned; "
        f"{c.realized_time_s:.4f} s, {c.realized_energy_j:.1f} J replayed on the profile"
    )
    click.echo(
        f"all max frequency at that time: {data.baseline.energy_j:.1f} J "
        f"({pct(data.saving_at_plan_time_percent)} less at the plan's time, the Perseus "
        "convention)"
    )
    sped_up, held_s = data.replay.instructions_sped_up, data.per_iteration.baseline_time_s
    held = f" held to {held_s:.4f} s" if held_s > data.baseline.own_time_s else ""
    click.echo(
        f"predicted per iteration: saving {pct(data.saving_percent)} at "
        f"{data.slowdown_percent:+.3f} % iteration time vs all max{held} (replayed on the "
        "measured profile)"
        + (f"; {sped_up} instruction(s) sped up by the slowdown guard" if sped_up else "")
    )


def _read_profile(path: str, p_block_w: float | None) -> Profile:
    """``Profile.read`` with a progress bar (and ETA) on stderr for files over 1 MB.

    Raises:
        click.UsageError: Neither ``p_block_w`` nor the profile gives the blocking power.
    """
    profile = _read_profile_file(path)
    if p_block_w is None and profile.p_block_w is None:
        what = "does not carry the blocking power: give --p-block-w (A100: 83.64, A40: 70.38)"
        raise click.UsageError(f"{path} {what}")
    return profile


def _read_profile_file(path: str) -> Profile:
    from powerlib.planning.profile import Profile  # noqa: PLC0415 - keep CLI start fast

    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0  # Profile.read says what is wrong with the path
    if size < 1_000_000:
        return Profile.read(path)
    with progress_bar("reading profile") as bar:

        def progress(done: int, total: int) -> None:
            bar.length = max(total, 1)
            bar.update(done - bar.pos)

        return Profile.read(path, progress=progress)
