"""The power-budget policy in the planning layer: the plan type carries per-stage limits.

``FrequencyPlan.power_limits_w`` round-trips through JSON (each stage's ``power_limit_w``) and a
plan without it still loads; :func:`limits_plan` locks each instruction at the clock its kind
runs at under its stage's limit; a frontier cannot pick a power-budget point (issue 47).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from powerlib.errors import PlanError
from powerlib.planning.choice import Policy, check_policy
from powerlib.planning.names import POLICIES
from powerlib.planning.pipeline import build_dag
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.power_budget import PowerLimitModel, limits_plan, plan_power_budget
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule

GPT3 = Path(__file__).parents[2] / "powerlib/emulator/data/gpt3-175b_a100_sxm.csv"


@pytest.fixture(scope="module")
def planned() -> tuple[FrequencyPlan, PowerLimitModel, object]:
    profile = Profile.read(GPT3)
    dag = build_dag(build_schedule("1f1b", 8, 4))
    admin = float(math.ceil(max(r.energy_j / r.time_s for r in profile.rows)))
    budget = plan_power_budget(profile, dag, 0.8 * 8 * admin, admin_limits_w=admin, p_block_w=80.0)
    model = PowerLimitModel(profile, dag, p_block_w=80.0)
    return limits_plan(model, budget, {"num_microbatches": 4, "schedule": "1f1b"}), model, budget


def test_a_plan_with_power_limits_round_trips_through_json(planned, tmp_path: Path) -> None:
    plan, _, budget = planned
    assert plan.power_limits_w == dict(enumerate(budget.plan.limits_w))
    path = tmp_path / "plan.json"
    plan.write(path)
    data = json.loads(path.read_text())
    assert [entry["power_limit_w"] for entry in data["stages"]] == list(budget.plan.limits_w)
    back = FrequencyPlan.read(path)
    assert back.power_limits_w == plan.power_limits_w and back.stages == plan.stages
    assert back.policy == "power-budget"
    assert back.summary["uniform_cap"]["time_s"] == pytest.approx(budget.uniform.time_s)


def test_a_plan_without_power_limits_loads_and_writes_none(planned) -> None:
    plan, _, _ = planned
    data = plan.to_json()
    for entry in data["stages"]:
        del entry["power_limit_w"]  # as every plan before the power-budget policy
    old = FrequencyPlan.from_json(data)
    assert old.power_limits_w == {} and old.power_limit_w(0) is None
    assert all("power_limit_w" not in e for e in old.to_json()["stages"])


@pytest.mark.parametrize("bad", [0, -5, "300", float("inf")])
def test_a_bad_power_limit_is_one_error_line(planned, bad: object) -> None:
    data = planned[0].to_json()
    data["stages"][2]["power_limit_w"] = bad
    with pytest.raises(PlanError, match=r"stages\[2\].*power_limit_w") as err:
        FrequencyPlan.from_json(data, source="p.json")
    assert "\n" not in str(err.value)


def test_every_instruction_runs_at_its_kinds_clock_under_its_stages_limit(planned) -> None:
    plan, model, budget = planned
    for s in range(8):
        clocks = budget.plan.clocks_mhz[s]
        assert [p.freq_mhz for p in plan.stage(s)] == [
            clocks[p.instruction.kind] for p in plan.stage(s)
        ]
        at = model.stage_at(s, budget.plan.limits_w[s])
        for p in plan.stage(s):  # what the profile says the clock costs
            assert (p.predicted_time_s, p.predicted_energy_j) == at[p.instruction.kind][1:]


def test_the_policy_names_power_budget_and_a_frontier_refuses_it(planned) -> None:
    assert "power-budget" in POLICIES
    with pytest.raises(PlanError, match="cannot hold a power budget"):
        Policy(name="power-budget")
    with pytest.raises(PlanError, match="needs one budget"):
        check_policy("power-budget", max_slowdown=0.0, switch_latency_s=0.0)
    check_policy("power-budget", max_slowdown=0.0, switch_latency_s=0.0, budget_w=900.0)


def test_frontier_select_refuses_power_budget_with_one_clear_line() -> None:
    from runtime_helpers import toy_profile

    from powerlib.planning.names import POWER_BUDGET
    from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier

    frontier = compute_frontier(
        toy_profile(2),
        build_schedule("1f1b", 2, 2),
        settings=FrontierSettings(unit_time_s=1e-3, p_block_w=80.0),
        schedule_name="1f1b",
        num_microbatches=2,
    )
    assert frontier.select("fastest") is frontier.fastest  # the frontier itself is fine
    for deadline_s in (None, 2 * frontier.fastest.time_s):
        with pytest.raises(PlanError, match="cannot hold a power budget") as err:
            frontier.select(POWER_BUDGET, deadline_s)
        message = str(err.value)
        assert "\n" not in message and "plan_power_budget" in message
        assert "unknown policy" not in message  # named for what it is, not as a typo
