"""Click options shared by `powerlib plan` and `powerlib overlap plan` (one definition each)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

__all__ = ["plan_outputs"]

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
