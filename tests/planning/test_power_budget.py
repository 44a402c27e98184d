"""Per-GPU power limits inside a budget (powerlib.planning.power_budget, issue 47 item 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import toy_profile

from powerlib.errors import InvalidArgumentError
from powerlib.planning.pipeline import build_dag
from powerlib.planning.power_budget import (
    PowerLimitModel,
    plan_power_budget,
    uniform_limits_w,
)
from powerlib.planning.profile import Profile
from powerlib.planning.profile_rows import ProfileRow
from powerlib.planning.schedules import build_schedule

TOP_W = 400.0  # toy_profile's power at its top clock, every stage
FLOOR_W = 140.0 + 260.0 * (780.0 / 1410.0) ** 2.4  # ... and at its lowest (~203 W)


def _dag(stages: int = 4, microbatches: int = 4):  # type: ignore[no-untyped-def]
    return build_dag(build_schedule("1f1b", stages, microbatches))


def test_the_limits_fit_the_budget_and_the_plan_is_never_slower_than_the_uniform_cap() -> None:
    profile, dag = toy_profile(4), _dag()
    for fraction in (0.55, 0.6, 0.7, 0.8, 0.9, 0.97, 1.0, 1.2):
        budget = fraction * 4 * TOP_W
        plan = plan_power_budget(profile, dag, budget, admin_limits_w=TOP_W)
        assert plan.plan.sum_w <= budget * (1 + 1e-12)
        assert all(limit <= TOP_W for limit in plan.plan.limits_w)
        assert plan.plan.time_s <= plan.uniform.time_s * (1 + 1e-12), fraction
        assert plan.uncapped.time_s <= plan.plan.time_s
    assert plan.plan.limits_w == (TOP_W,) * 4  # above the summed limits: nothing is raised


def test_a_stage_with_slack_gives_up_watts_first() -> None:
    # toy stages are heavier down the pipeline: stage 3 sets the pace, stage 0 waits the most
    profile, dag = toy_profile(4), _dag()
    plan = plan_power_budget(profile, dag, 4 * TOP_W - 60.0, admin_limits_w=TOP_W)
    limits = plan.plan.limits_w
    assert limits[3] == TOP_W
    assert limits[0] < TOP_W
    assert plan.plan.time_s < plan.uniform.time_s


def test_the_lightest_stages_give_up_the_most_under_a_tight_budget() -> None:
    profile, dag = toy_profile(4), _dag()
    plan = plan_power_budget(profile, dag, 0.75 * 4 * TOP_W, admin_limits_w=TOP_W)
    limits = plan.plan.limits_w
    assert limits[0] <= limits[3] and limits[1] <= limits[3]
    assert plan.plan.time_s < plan.uniform.time_s


def test_an_administrators_lower_limit_is_never_raised() -> None:
    profile, dag = toy_profile(4), _dag()
    admin = [TOP_W, 300.0, TOP_W, 250.0]
    for budget in (1000.0, 1300.0, 5000.0):
        plan = plan_power_budget(profile, dag, budget, admin_limits_w=admin)
        assert all(p <= a for p, a in zip(plan.plan.limits_w, admin))
        assert all(u <= a for u, a in zip(plan.uniform.limits_w, admin))
        assert plan.plan.sum_w <= budget
    assert plan.plan.limits_w == tuple(admin)


def test_a_straggler_lets_every_stage_give_up_watts_for_free() -> None:
    profile, dag = toy_profile(4), _dag()
    model = PowerLimitModel(profile, dag)
    deadline = 1.2 * model.makespan_s([TOP_W] * 4)
    budget = 0.7 * 4 * TOP_W
    plan = plan_power_budget(profile, dag, budget, admin_limits_w=TOP_W, deadline_s=deadline)
    assert plan.plan.time_s == pytest.approx(deadline)  # the budget costs nothing
    assert plan.uniform.time_s > 1.05 * deadline  # the uniform cap misses the deadline


def test_with_a_straggler_a_generous_budget_buys_energy_not_time() -> None:
    profile, dag = toy_profile(4), _dag()
    model = PowerLimitModel(profile, dag, p_block_w=80.0)
    deadline = 1.2 * model.makespan_s([TOP_W] * 4)
    plan = plan_power_budget(
        profile, dag, 4 * TOP_W, admin_limits_w=TOP_W, p_block_w=80.0, deadline_s=deadline
    )
    assert plan.plan.time_s == pytest.approx(deadline) == plan.uncapped.time_s
    assert plan.plan.energy_j < 0.95 * plan.uncapped.energy_j
    for limit, clocks in zip(plan.plan.limits_w, plan.plan.clocks_mhz):  # headroom, same clocks
        assert limit > max(140.0 + 260.0 * (f / 1410.0) ** 2.4 for f in clocks.values())
    assert plan.plan.sum_w <= 4 * TOP_W


def test_a_budget_below_the_lowest_limits_is_one_clear_error() -> None:
    profile, dag = toy_profile(4), _dag()
    with pytest.raises(InvalidArgumentError, match="below the 8.. W the 4 GPUs draw") as err:
        plan_power_budget(profile, dag, 4 * FLOOR_W - 5.0)
    assert "\n" not in str(err.value)
    plan = plan_power_budget(profile, dag, 4 * FLOOR_W + 1e-9)  # the floor itself fits
    assert plan.plan.limits_w == pytest.approx([FLOOR_W] * 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_w": -5.0}, "budget_w must be > 0 W"),
        ({"budget_w": float("inf")}, "budget_w must be a number"),
        ({"admin_limits_w": [400.0, 400.0]}, "2 limits for 4 stages"),
        ({"admin_limits_w": 150.0}, "below the 203 W"),
    ],
)
def test_bad_inputs_are_refused_in_one_line(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"budget_w": 1200.0, **kwargs}
    with pytest.raises(InvalidArgumentError, match=message) as err:
        plan_power_budget(toy_profile(4), _dag(), **args)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_the_uniform_cap_splits_the_budget_evenly_under_each_admin_limit() -> None:
    assert uniform_limits_w(1000.0, [400.0, 200.0, 400.0, 400.0]) == (250.0, 200.0, 250.0, 250.0)


def test_the_known_answer_of_two_stages_with_a_deadline() -> None:
    # Stage 0 is light (it waits for stage 1), stage 1 heavy; one level each worth 100 W.
    rows = []
    for stage, scale in ((0, 1.0), (1, 2.0)):
        for kind, base in (("forward", 1.0), ("backward", 2.0)):
            for freq, t_factor, power in ((1000.0, 1.0, 300.0), (800.0, 1.25, 200.0)):
                time_s = base * scale * t_factor
                rows.append(
                    ProfileRow(
                        stage=stage,
                        instruction=kind,
                        freq_mhz=freq,
                        time_s=time_s,
                        energy_j=power * time_s,
                    )
                )
    profile, dag = Profile(rows), _dag(2, 4)
    plan = plan_power_budget(profile, dag, 500.0)
    assert plan.plan.limits_w == (200.0, 300.0)  # the light stage gives up its 100 W
    assert plan.uniform.limits_w == (250.0, 250.0)  # both throttle to 800 MHz
    assert plan.plan.time_s < plan.uniform.time_s
    slow, fast = {"backward": 800.0, "forward": 800.0}, {"backward": 1000.0, "forward": 1000.0}
    assert plan.plan.clocks_mhz == (slow, fast)
    data = plan.to_json()
    assert set(data) >= {"powerlib", "uniform_cap", "uncapped", "budget_w"}


def test_the_benchmark_runs_and_reports_every_figure(tmp_path: Path) -> None:
    """benchmarks/power_budget.py in a tiny configuration: every case and budget carries the
    uniform cap, the plan and no cap, each with its time and energy, and names its emulation
    model (its figures are the emulator's, in benchmarks/results/power_budget.json: not checked)."""
    script = Path(__file__).parents[2] / "benchmarks" / "power_budget.py"
    out = tmp_path / "power_budget.json"
    args = ["--iterations", "2", "--microbatches", "4", "--fractions", "0.8", "--warm-up", "1"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["emulation_model"] and data["power_limit_model"]
    assert [c["straggler"] for c in data["cases"]] == [None, 1.2]
    for case in data["cases"]:
        (budget,) = case["budgets"]
        assert budget["fraction"] == 0.8
        for name in ("uncapped", "uniform_cap", "powerlib"):
            figures = budget[name]
            assert figures["time_s"] > 0 and figures["energy_j"] > 0, (name, figures)
            assert len(figures["limits_w"]) == data["num_stages"]
        assert sum(budget["powerlib"]["limits_w"]) <= budget["budget_w"] + 1e-6
