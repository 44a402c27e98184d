"""What `powerlib plan` and `powerlib overlap plan` share: options, policy step, JSON output."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from powerlib.planning.perseus.frontier import Frontier, FrontierPoint

__all__ = ["emit_json", "plan_outputs", "select_and_write"]


def emit_json(data: object) -> None:
    """Print a ``--json`` result."""
    click.echo(json.dumps(data, indent=2, sort_keys=False))


_OPTIONS = (
    click.option(
        "--deadline-s",
        type=float,
        default=None,
        help="Straggler iteration time T' (policy deadline).",
    ),
    click.option(
        "--max-slowdown",
        type=click.FloatRange(min=0.0),
        default=0.001,
        show_default=True,
        help="fastest/deadline policies: speed up instructions on the realized critical path until "
        "the plan, replayed on the measurements, is at most this much slower than the baseline "
        "(fastest) or than the deadline (a fraction).",
    ),
    click.option(
        "--switch-latency-s",
        type=click.FloatRange(min=0.0),
        default=0.005,
        show_default=True,
        help="Clock-change latency the slowdown guard plans for (the old clock runs meanwhile).",
    ),
    click.option(
        "--frontier-out",
        type=click.Path(dir_okay=False),
        default=None,
        help="Write the frontier CSV here.",
    ),
    click.option(
        "--plan-out",
        type=click.Path(dir_okay=False),
        default=None,
        help="Write the chosen plan (JSON) here.",
    ),
    click.option(
        "--plot",
        "plot_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="Plot the frontier to this PNG (needs powerlib[plot]).",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary."),
)


def plan_outputs(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--deadline-s --max-slowdown --switch-latency-s --frontier-out --plan-out --plot --json``."""
    for option in reversed(_OPTIONS):
        func = option(func)
    return func


def select_and_write(
    frontier: Frontier,
    *,
    policy: str,
    deadline_s: float | None,
    argmin: bool = False,
    max_slowdown: float,
    switch_latency_s: float,
    frontier_out: str | None,
    plan_out: str | None,
    plot_path: str | None,
    solve_time_s: float,
    metadata: dict[str, Any] | None = None,
) -> tuple[FrontierPoint, Any, dict[str, Any]]:
    """Pick the policy's point, run the slowdown guard, write the outputs, summarise.

    Returns:
        The chosen point, the guarded per-instruction options (``None`` for ``min-energy``) and
        the ``--json`` summary.
    """
    from powerlib.planning.perseus.report import (  # noqa: PLC0415 - keep CLI start fast
        plot_frontier,
        summary,
        write_frontier_csv,
        write_plan_json,
    )

    chosen = frontier.select(policy, deadline_s, argmin=argmin)
    guarded = None
    if policy in ("fastest", "deadline"):
        guarded = frontier.within_slowdown(
            chosen,
            max_slowdown,
            switch_latency_s=switch_latency_s,
            limit_s=deadline_s if policy == "deadline" else None,
        )
    if frontier_out:
        write_frontier_csv(frontier, frontier_out)
    if plan_out:
        write_plan_json(
            frontier, chosen, plan_out, policy=policy, chosen=guarded, metadata=metadata
        )
    if plot_path:
        plot_frontier(frontier, chosen, plot_path)
    data = summary(
        frontier,
        chosen,
        policy=policy,
        solve_time_s=solve_time_s,
        guarded=guarded,
        max_slowdown=max_slowdown if guarded is not None else None,
        switch_latency_s=switch_latency_s,
    )
    return chosen, guarded, data
