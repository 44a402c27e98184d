"""The plan file: what the planner writes is what a session reads; bad plans fail in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from runtime_helpers import toy_profile

from powerlib.errors import PlanError
from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.schedules import build_schedule


@pytest.fixture(scope="module")
def plan_data() -> dict:
    profile = toy_profile()
    frontier = compute_frontier(
        profile,
        build_schedule("1f1b", 4, 4),
        settings=FrontierSettings(unit_time_s=1e-3, p_block_w=80.0),
        schedule_name="1f1b",
        num_microbatches=4,
    )
    return frontier.plan(frontier.fastest, policy="fastest").to_json()


def test_round_trip_keeps_order_and_frequencies(plan_data: dict, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_data))
    plan = FrequencyPlan.read(path)
    assert plan.num_stages == 4
    for s, stage in enumerate(plan_data["stages"]):
        got = [(p.instruction.kind, p.instruction.microbatch, p.freq_mhz) for p in plan.stage(s)]
        want = [(i["kind"], i["microbatch"], i["freq_mhz"]) for i in stage["instructions"]]
        assert got == want
    again = FrequencyPlan.from_json(plan.to_json())
    assert again.stages == plan.stages
    assert again.summary["policy"] == "fastest"


def _break(data: dict, how: str) -> object:
    d = copy.deepcopy(data)
    ins = d["stages"][1]["instructions"]
    if how == "schema":
        d["schema"] = "powerlib.plan.v0"
    elif how == "no-stages":
        d["stages"] = []
    elif how == "kind":
        ins[0]["kind"] = "sideways"
    elif how == "freq-negative":
        ins[0]["freq_mhz"] = -5
    elif how == "freq-string":
        ins[0]["freq_mhz"] = "1410"
    elif how == "freq-nan":
        ins[0]["freq_mhz"] = float("nan")
    elif how == "microbatch":
        ins[0]["microbatch"] = -1
    elif how == "duplicate":
        ins[1] = dict(ins[0])
    elif how == "stage-order":
        d["stages"][1]["stage"] = 3
    elif how == "num-stages":
        d["workload"]["num_stages"] = 7
    elif how == "not-object":
        return [1, 2]
    return d


@pytest.mark.parametrize(
    "how",
    [
        "schema",
        "no-stages",
        "kind",
        "freq-negative",
        "freq-string",
        "freq-nan",
        "microbatch",
        "duplicate",
        "stage-order",
        "num-stages",
        "not-object",
    ],
)
def test_malformed_plans_are_one_line_errors(plan_data: dict, how: str) -> None:
    with pytest.raises(PlanError) as info:
        FrequencyPlan.from_json(_break(plan_data, how), source="bad.json")
    message = str(info.value)
    assert message.startswith("bad.json")
    assert "\n" not in message


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read"):
        FrequencyPlan.read(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="bad.json: invalid JSON"):
        FrequencyPlan.read(tmp_path / "bad.json")


def test_check_frequencies_names_the_unsupported_clock(plan_data: dict) -> None:
    plan = FrequencyPlan.from_json(plan_data, source="p.json")
    freqs = sorted({f for s in range(4) for f in plan.frequencies(s)})
    plan.check_frequencies(freqs)  # all supported
    with pytest.raises(PlanError, match=f"{freqs[0]:g} MHz"):
        plan.check_frequencies(freqs[1:] + [1.0])
    with pytest.raises(PlanError, match="no stage 9"):
        plan.stage(9)
