"""Frontier.plan builds the FrequencyPlan itself: what each instruction records, and round trips."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from powerlib.planning.choice import Policy, choose
from powerlib.planning.perseus.frontier import Frontier, FrontierSettings, compute_frontier
from powerlib.planning.plan import FrequencyPlan, PartitionSetting
from powerlib.planning.schedules import schedule_1f1b


@dataclass(frozen=True)
class _Knob:
    """What a Kareus option sets besides its clock, as the planner sees it (``to_plan``)."""

    execution: str

    def to_plan(self) -> dict[str, Any]:
        overlap = (
            {"fwd_attn": {"slot": "rope_0", "sm_count": 3, "block_size": 1024}}
            if self.execution == "nanobatch"
            else {}
        )
        return {"execution": self.execution, "overlap": overlap, "option_source": "search"}


def _frontier(knobs: bool) -> Frontier:
    def options(scale: float) -> list[tuple[Any, ...]]:
        rows = [(1410.0, 0.010 * scale, 10.0 * scale), (1200.0, 0.013 * scale, 8.0 * scale)]
        if not knobs:
            return rows
        return [(f, t, e, _Knob("nanobatch" if f == 1410.0 else "sequential")) for f, t, e in rows]

    candidates = {
        (s, kind): options(1.0 if kind == "forward" else 2.0)
        for s in range(2)
        for kind in ("forward", "backward")
    }
    return compute_frontier(
        None,
        schedule_1f1b(2, 3),
        settings=FrontierSettings(unit_time_s=1e-3, p_block_w=50.0),
        schedule_name="1f1b",
        num_microbatches=3,
        candidates=candidates,
    )


def test_a_perseus_plan_records_clock_planned_time_and_the_options_measured_figures() -> None:
    frontier = _frontier(knobs=False)
    plan = frontier.plan(frontier.fastest, policy="fastest")
    entry = plan.to_json()["stages"][0]["instructions"][0]
    assert list(entry) == [
        "kind", "microbatch", "chunk", "freq_mhz", "planned_time_s", "predicted_time_s",
        "predicted_energy_j",
    ]  # fmt: skip
    assert entry["freq_mhz"] == 1410.0 and entry["planned_time_s"] == 0.01
    # the option's measured time: the apply phase times a request ahead by it (issue 45)
    option = frontier.planned_options(frontier.fastest)[frontier.dag.stage_order(0)[0]]
    assert (entry["predicted_time_s"], entry["predicted_energy_j"]) == (
        option.time_s, option.energy_j
    )  # fmt: skip
    assert plan.workload["num_stages"] == 2 and plan.policy == "fastest"
    assert (
        FrequencyPlan.from_json(json.loads(json.dumps(plan.to_json())), source="the plan") == plan
    )


def test_a_kareus_plan_records_execution_settings_and_option_source() -> None:
    frontier = _frontier(knobs=True)
    plan = frontier.plan(frontier.fastest, policy="fastest")
    first = plan.stages[0][0]
    assert first.execution == "nanobatch" and first.option_source == "search"
    assert first.overlap == {"fwd_attn": PartitionSetting(slot="rope_0", sm_count=3)}
    assert first.predicted_time_s == 0.010 and first.predicted_energy_j == 10.0
    entry = plan.to_json()["stages"][0]["instructions"][0]
    assert list(entry)[-3:] == ["execution", "overlap", "option_source"]
    slow = frontier.plan(frontier.points[0], policy="min-energy").to_json()
    sequential = slow["stages"][0]["instructions"][0]
    assert (sequential["execution"], sequential["overlap"]) == ("sequential", {})
    assert sequential["option_source"] == "search"
    again = FrequencyPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.stages == plan.stages


def test_the_deadline_lands_in_the_plan_only_when_the_caller_records_it() -> None:
    frontier = _frontier(knobs=False)
    policy = Policy(name="deadline", deadline_s=frontier.points[0].time_s)
    assert "deadline_s" not in choose(frontier, policy).plan().workload
    plan = choose(frontier, policy).plan(metadata={"deadline_s": policy.deadline_s})
    assert plan.workload["deadline_s"] == policy.deadline_s
