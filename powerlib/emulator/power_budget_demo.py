"""``powerlib demo --budget``: the uniform cap beside powerlib's per-GPU limits.

The demo's emulated pipeline (by default GPT-3 175B in 8 stages on A100s) runs under a power
budget twice on the same noise draws: every GPU at ``budget / N`` (the uniform cap, what sites
do today with ``nvidia-smi -pl``) and at the limits
:func:`~powerlib.planning.power_budget.plan_power_budget` chose; all GPUs at their
administrator's limit run beside them as the reference. The emulated GPUs throttle their clocks
to hold a limit (:meth:`Emulator.set_power_limits
<powerlib.emulator.engine.Emulator.set_power_limits>`; docs/perseus.md §7). Each
GPU's administrator limit is the profile's highest power, rounded up to a watt (the GPUs as
measured never throttle at it). Unlike ``fastest`` and the other policies, nothing is profiled
by sessions: the planner reads the profile the GPUs run, and the figures are the emulator's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from powerlib.emulator.demo import DemoConfig
from powerlib.emulator.engine import Emulator, IterationResult, NvmlLikeModel
from powerlib.emulator.truth import default_profile
from powerlib.errors import InvalidArgumentError
from powerlib.planning.pipeline import build_dag
from powerlib.planning.power_budget import (
    PowerBudgetPlan,
    PowerLimitModel,
    plan_power_budget,
    unthrottled_limit_w,
)
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule

__all__ = ["BudgetDemoResult", "run_limits", "run_power_budget_demo"]

SETS = ("uncapped", "uniform_cap", "powerlib")
"""The limits every noise draw runs, in the order of the JSON."""

WARM_UP_ITERATIONS = 120  # all-max, unmeasured: ~5 drift time constants of 60 s at ~2.8 s each


def run_limits(
    emulator: Emulator,
    limits: Mapping[str, Sequence[float]],
    iterations: int,
    first_key: int = 1,
) -> dict[str, list[IterationResult]]:
    """Every noise draw runs every set of limits, in an order that rotates by draw.

    Each set sees the same noise draws, and the GPUs' thermal drift weighs on all alike.
    """
    names = list(limits)
    runs: dict[str, list[IterationResult]] = {name: [] for name in names}
    for i in range(iterations):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            emulator.set_power_limits(list(limits[name]))
            runs[name].append(emulator.run_iteration(noise_key=first_key + i))
    emulator.set_power_limits(None)
    return runs


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetDemoResult:
    """What ``powerlib demo --budget`` (or ``--budget-w``) reports.

    Attributes:
        model: The emulated GPUs' model.
        profile: The profile's source.
        workload: Stages, microbatches, schedule, P_block, straggler and its deadline.
        plan: The planner's limits and predictions (uniform cap and uncapped beside).
        runs: Per set of limits, its emulated iterations (paired noise draws).
    """

    model: NvmlLikeModel
    profile: str
    workload: dict[str, object]
    plan: PowerBudgetPlan
    runs: dict[str, list[IterationResult]]

    def figures(self, name: str) -> dict[str, object]:
        """One set of limits: limits, the emulated time and energy (+- SE), the prediction."""
        predicted = {
            "uncapped": self.plan.uncapped,
            "uniform_cap": self.plan.uniform,
            "powerlib": self.plan.plan,
        }[name]
        runs, base = self.runs[name], self.runs["uncapped"]
        time_s, time_se = _mean_se([r.time_s for r in runs])
        energy_j, energy_se = _mean_se([r.energy_j for r in runs])
        ratio, ratio_se = _mean_se([r.time_s / b.time_s for r, b in zip(runs, base)])
        return {
            "limits_w": list(predicted.limits_w),
            "sum_w": predicted.sum_w,
            "time_s": time_s,
            "time_se_s": time_se,
            "energy_j": energy_j,
            "energy_se_j": energy_se,
            "slowdown_percent": 100.0 * (ratio - 1.0),
            "slowdown_se_percent": 100.0 * ratio_se,
            "predicted_time_s": predicted.time_s,
            "predicted_energy_j": predicted.energy_j,
        }

    def to_json(self) -> dict[str, object]:
        """The ``powerlib.demo.power_budget.v1`` record."""
        return {
            "schema": "powerlib.demo.power_budget.v1",
            "policy": "power-budget",
            "model": self.model.to_json(),
            "model_description": self.model.describe(),
            "profile": self.profile,
            "workload": dict(self.workload),
            "budget_w": self.plan.budget_w,
            "admin_limits_w": list(self.plan.admin_limits_w),
            "iterations": len(self.runs["powerlib"]),
            **{name: self.figures(name) for name in SETS},
        }


def run_power_budget_demo(
    config: DemoConfig,
    *,
    budget_fraction: float | None = None,
    budget_w: float | None = None,
    warm_up_iterations: int = WARM_UP_ITERATIONS,
) -> BudgetDemoResult:
    """Plan per-GPU limits for a budget and run them beside the uniform cap on emulated GPUs.

    Args:
        config: The demo's workload and emulated GPUs (``truth_iterations``: the paired noise
            draws, each running every set of limits; ``straggler``: its deadline is that many
            times the all-max iteration on the profile); what sessions and files need is unused.
        budget_fraction: The budget as a share of the GPUs' summed limits (e.g. 0.8).
        budget_w: The budget in watts (give this or ``budget_fraction``).
        warm_up_iterations: All-max iterations first, unmeasured (thermal drift).

    Raises:
        InvalidArgumentError: Neither or both budgets, a bad figure, a budget below what the
            GPUs draw at their lowest clocks, or a straggler below 1 (one line each).
        PlanError: A bad profile.
    """
    _check(config, budget_fraction, budget_w)
    profile = (
        default_profile() if config.profile_path is None else Profile.read(config.profile_path)
    )
    n = profile.num_stages
    order = build_schedule(config.schedule, n, config.num_microbatches, config.num_chunks)
    dag = build_dag(order)
    admin = unthrottled_limit_w(profile)
    budget = budget_w if budget_w is not None else (budget_fraction or 0.0) * admin * n
    deadline_s = None
    if config.straggler is not None:
        deadline_s = config.straggler * PowerLimitModel(profile, dag).makespan_s([admin] * n)
    plan = plan_power_budget(
        profile,
        dag,
        budget,
        admin_limits_w=admin,
        p_block_w=config.p_block_w,
        deadline_s=deadline_s,
    )
    model = config.effective_model()
    emulator = Emulator(
        profile, order, p_block_w=config.p_block_w, model=model, seed=config.seed,
        straggler_time_s=deadline_s,
    )  # fmt: skip
    for _ in range(warm_up_iterations if model.drift > 0 else 0):
        emulator.run_iteration()
    limits = {
        "uncapped": plan.uncapped.limits_w,
        "uniform_cap": plan.uniform.limits_w,
        "powerlib": plan.plan.limits_w,
    }
    workload = {
        "num_stages": n,
        "num_microbatches": config.num_microbatches,
        "schedule": config.schedule,
        "p_block_w": config.p_block_w,
        "straggler": config.straggler,
        "deadline_s": deadline_s,
    }
    return BudgetDemoResult(
        model=model,
        profile=profile.source,
        workload=workload,
        plan=plan,
        runs=run_limits(emulator, limits, config.truth_iterations),
    )


def _check(config: DemoConfig, budget_fraction: float | None, budget_w: float | None) -> None:
    """One error line for a missing, doubled or bad budget, straggler or draw count."""
    if (budget_fraction is None) == (budget_w is None):
        raise InvalidArgumentError(
            "give the power budget as a fraction (--budget) or in watts (--budget-w), one of them"
        )
    for name, value in (("--budget", budget_fraction), ("--budget-w", budget_w)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise InvalidArgumentError(f"{name} must be > 0, got {value}")
    if config.straggler is not None and not config.straggler >= 1.0:
        raise InvalidArgumentError(
            f"--straggler must be >= 1 (a slowdown factor), got {config.straggler}"
        )
    if config.truth_iterations < 2:
        raise InvalidArgumentError("truth_iterations must be >= 2 (a standard error needs two)")
