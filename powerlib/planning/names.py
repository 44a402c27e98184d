"""The planner's option names, in one light module: the CLI builds its choices from them.

Importing this loads nothing else (no numpy, no solver), so ``powerlib --help`` lists every
command without loading the planner. The filter orders are
:data:`~powerlib.planning.perseus.frequency_options.ORDERS` and the pipeline schedules
:data:`~powerlib.planning.schedules.SCHEDULE_NAMES` (both light too).
"""

from __future__ import annotations

__all__ = ["COST_MODELS", "POLICIES", "POWER_BUDGET", "SOLVERS"]

POLICIES = ("fastest", "deadline", "min-energy", "power-budget")
"""Which frontier point becomes the plan (:class:`~powerlib.planning.choice.Policy`), or
``power-budget``: per-GPU power limits and clocks inside a budget in watts, not a frontier point
(:func:`~powerlib.planning.power_budget.plan_power_budget`, docs/perseus.md §7)."""

POWER_BUDGET = "power-budget"
"""The policy that plans power limits inside a budget instead of choosing a frontier point."""

SOLVERS = ("walk", "direct", "auto")
"""How a frontier is solved (:class:`~powerlib.planning.perseus.frontier.FrontierSettings`)."""

COST_MODELS = ("exp", "convex")
"""Per-(stage, kind) cost models
(:func:`~powerlib.planning.perseus.cost_model.build_cost_model`); the first is the default."""
