"""Power budget benchmark: the uniform cap against powerlib's per-GPU limits (issue 47, item 1).

Workload: the demo's GPT-3 175B profile on emulated A100-SXMs (8 stages, 1F1B, 12
microbatches, P_block = 83.64 W), on the default emulation (NVML-like: noise, per-GPU offsets,
thermal drift). Each GPU's administrator limit is the profile's highest power, rounded up to a
watt (the GPUs as measured never throttle at it), so 100 % of the summed limits is uncapped.

For each budget (60, 70, 80, 90 and 100 % of the summed limits), without and with a straggler
(a data-parallel pipeline that holds every iteration to 1.2x the all-max iteration, computed on
the profile), three sets of limits run on the same emulated GPUs: ``uncapped`` (the
administrator's), ``uniform_cap`` (every GPU at budget / N) and ``powerlib``
(:func:`~powerlib.planning.power_budget.plan_power_budget`). The GPUs first warm up
(:data:`WARM_UP_ITERATIONS`, until the thermal drift settles); then every noise draw runs all
three, in an order that rotates from draw to draw, so each sees the same noise and the drift
weighs on all alike. Reported per set: the limits, the planner's prediction, the emulated mean
iteration time and energy with their standard errors, and the slowdown against uncapped;
per budget, how many points the plan's slowdown is below the uniform cap's.

Run::

    python benchmarks/power_budget.py                  # writes benchmarks/results/power_budget.json
    python benchmarks/power_budget.py --iterations 10 --out /tmp/pb.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

from powerlib.emulator.engine import NVML_LIKE_MODEL, Emulator
from powerlib.emulator.power_budget_demo import SETS, WARM_UP_ITERATIONS, run_limits
from powerlib.emulator.truth import DEFAULT_P_BLOCK_W, default_profile
from powerlib.planning.pipeline import build_dag
from powerlib.planning.power_budget import (
    PowerBudgetPlan,
    PowerLimitModel,
    plan_power_budget,
    unthrottled_limit_w,
)
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule

HERE = Path(__file__).resolve().parent
FRACTIONS = (0.6, 0.7, 0.8, 0.9, 1.0)
STRAGGLER = 1.2


def _mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se


def _budget_case(
    emulator: Emulator, plan: PowerBudgetPlan, iterations: int, first_key: int, plan_wall_s: float
) -> tuple[dict[str, object], dict[str, float]]:
    """One budget: the three sets of limits emulated on the same draws; the row and slowdowns."""
    predicted = {"uncapped": plan.uncapped, "uniform_cap": plan.uniform, "powerlib": plan.plan}
    limits = {name: predicted[name].limits_w for name in SETS}
    runs = run_limits(emulator, limits, iterations, first_key)
    base_t = [r.time_s for r in runs["uncapped"]]
    out: dict[str, object] = {"budget_w": plan.budget_w, "plan_wall_s": plan_wall_s}
    slowdown: dict[str, float] = {}
    for name in SETS:
        times = [r.time_s for r in runs[name]]
        time_s, time_se = _mean_se(times)
        energy_j, energy_se = _mean_se([r.energy_j for r in runs[name]])
        # paired against uncapped on the same draws
        ratio, ratio_se = _mean_se([t / b for t, b in zip(times, base_t)])
        slowdown[name] = 100.0 * (ratio - 1.0)
        out[name] = {
            "limits_w": [round(x, 3) for x in predicted[name].limits_w],
            "sum_w": round(predicted[name].sum_w, 3),
            "clocks_mhz": [dict(c) for c in predicted[name].clocks_mhz],
            "predicted_time_s": predicted[name].time_s,
            "predicted_energy_j": predicted[name].energy_j,
            "time_s": time_s,
            "time_se_s": time_se,
            "energy_j": energy_j,
            "energy_se_j": energy_se,
            "slowdown_pct": slowdown[name],
            "slowdown_se_pct": 100.0 * ratio_se,
        }
    paired = [
        100.0 * (u.time_s - p.time_s) / b
        for u, p, b in zip(runs["uniform_cap"], runs["powerlib"], base_t)
    ]
    points, points_se = _mean_se(paired)
    out["plan_faster_than_uniform_points"] = points
    out["plan_faster_than_uniform_points_se"] = points_se
    out["plan_at_most_uniform"] = all(
        p.time_s <= u.time_s * (1 + 1e-9) for u, p in zip(runs["uniform_cap"], runs["powerlib"])
    )
    return out, slowdown


def _case(
    profile: Profile, args: argparse.Namespace, straggler: float | None, admin_w: float
) -> dict[str, object]:
    schedule = build_schedule("1f1b", profile.num_stages, args.microbatches)
    dag = build_dag(schedule)
    n = profile.num_stages
    allmax_s = PowerLimitModel(profile, dag).makespan_s([admin_w] * n)
    deadline_s = None if straggler is None else straggler * allmax_s
    emulator = Emulator(
        profile,
        schedule,
        p_block_w=DEFAULT_P_BLOCK_W,
        model=NVML_LIKE_MODEL,
        seed=args.seed,
        straggler_time_s=deadline_s,
    )
    for _ in range(args.warm_up):
        emulator.run_iteration()
    budgets = []
    for k, fraction in enumerate(args.fractions):
        budget_w = fraction * admin_w * n
        started = time.perf_counter()
        plan = plan_power_budget(
            profile,
            dag,
            budget_w,
            admin_limits_w=admin_w,
            p_block_w=DEFAULT_P_BLOCK_W,
            deadline_s=deadline_s,
        )
        wall = time.perf_counter() - started
        row, slowdown = _budget_case(emulator, plan, args.iterations, 1 + k * args.iterations, wall)
        budgets.append({"fraction": fraction, **row})
        print(
            f"straggler={straggler} {fraction:.0%}: uniform {slowdown['uniform_cap']:+.2f} %, "
            f"powerlib {slowdown['powerlib']:+.2f} % vs uncapped (plan {wall:.2f} s)",
            file=sys.stderr,
        )
    return {
        "straggler": straggler,
        "deadline_s": deadline_s,
        "allmax_makespan_s": allmax_s,
        "budgets": budgets,
    }


def _within(
    profile: Profile, admin_w: float, microbatches: int, slowdown: float
) -> dict[str, float]:
    """The smallest budget (fraction of the summed limits) within ``slowdown`` of uncapped.

    On the planner's model (the profile, no noise), for the uniform cap and for the plan:
    what the figures at 80 % are measured against (bisection, 1/1024 of the range).
    """
    n = profile.num_stages
    dag = build_dag(build_schedule("1f1b", n, microbatches))
    model = PowerLimitModel(profile, dag, p_block_w=DEFAULT_P_BLOCK_W)
    target = (1.0 + slowdown) * model.makespan_s([admin_w] * n)
    found = {}
    for name in ("uniform_cap", "powerlib"):
        lo, hi = 0.5, 1.0
        for _ in range(10):
            mid = 0.5 * (lo + hi)
            plan = plan_power_budget(profile, dag, mid * admin_w * n, admin_limits_w=admin_w)
            time_s = (plan.uniform if name == "uniform_cap" else plan.plan).time_s
            lo, hi = (lo, mid) if time_s <= target else (mid, hi)
        found[name] = hi
    return found


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40, help="noise draws per budget")
    parser.add_argument("--microbatches", type=int, default=12)
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--warm-up", type=int, default=WARM_UP_ITERATIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "results" / "power_budget.json"))
    args = parser.parse_args(argv)
    profile = default_profile()
    admin_w = unthrottled_limit_w(profile)
    started = time.perf_counter()
    cases = [_case(profile, args, s, admin_w) for s in (None, STRAGGLER)]
    result: dict[str, object] = {
        "benchmark": "power_budget",
        "emulation_model": NVML_LIKE_MODEL.describe(),
        "emulation_model_json": NVML_LIKE_MODEL.to_json(),
        "power_limit_model": "clocks throttle to the highest profiled clock whose profiled "
        "power is within the limit (else the lowest); waiting at min(P_block, limit)",
        "profile": profile.source,
        "schedule": "1f1b",
        "num_stages": profile.num_stages,
        "num_microbatches": args.microbatches,
        "p_block_w": DEFAULT_P_BLOCK_W,
        "admin_limit_w": admin_w,
        "summed_limits_w": admin_w * profile.num_stages,
        "iterations": args.iterations,
        "warm_up_iterations": args.warm_up,
        "seed": args.seed,
        "python": platform.python_version(),
        "wall_s": time.perf_counter() - started,
        "cases": cases,
        "min_fraction_within_1pct_of_uncapped": _within(profile, admin_w, args.microbatches, 0.01),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
