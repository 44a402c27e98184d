"""The one profile -> plan pipeline (powerlib.planning.workflow): what `powerlib plan`, the demo's
pre-check and rank 0's make_plan all run, and the one writer of their files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from powerlib.errors import PlanError
from powerlib.planning.perseus.report import PLAN_SUMMARY_SCHEMA, PlanOutputs
from powerlib.planning.plan import RECORDED, FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule
from powerlib.planning.workflow import (
    PlanRequest,
    SessionInputs,
    check_work,
    plan_profile,
    replan,
    resolve_order,
    resolve_p_block,
)
from powerlib.progress import Progress

GPT3 = Path(__file__).parents[2] / "powerlib/emulator/data/gpt3-175b_a100_sxm.csv"

SUMMARY_KEYS = [
    "schema", "solver", "complete_frontier", "num_points", "t_min_s", "t_max_s", "t_star_s",
    "t_star_energy_j", "saving_percent", "slowdown_percent", "per_iteration", "chosen",
    "baseline", "saving_at_plan_time_percent", "replay", "solve_time_s",
]  # fmt: skip
SESSION_KEYS = [
    "switch_latency_s", "time_cv", "time_se", "switch_latency_source", "latency_samples",
    "time_noise",
]  # fmt: skip


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.read(GPT3)


FILE = PlanRequest(num_stages=8, num_microbatches=4, p_block_w=83.64, unit_time_s=0.001)
SESSION = replace(
    FILE,
    p_block_w=None,
    switch_latency_s=0.02,
    time_cv=0.01,
    time_se=0.001,
    session=SessionInputs(p_block_w=80.0, switch_latency_source="measured"),
)


def test_a_file_request_summarises_as_powerlib_plan_always_did(profile: Profile) -> None:
    result = plan_profile(profile, FILE)
    data = result.summary.to_json()
    assert list(data) == SUMMARY_KEYS and data["schema"] == PLAN_SUMMARY_SCHEMA
    assert list(data["chosen"]) == [
        "policy", "iteration", "time_s", "energy_j", "realized_time_s", "realized_energy_j",
    ]  # fmt: skip
    assert list(data["baseline"]) == ["description", "own_time_s", "time_s", "energy_j"]
    assert list(data["per_iteration"]) == [
        "description", "time_s", "energy_j", "baseline_time_s", "baseline_energy_j",
    ]  # fmt: skip
    assert list(data["replay"]) == [
        "description", "max_slowdown_guard", "switch_latency_s", "instructions_sped_up",
    ]  # fmt: skip
    assert data["saving_percent"] == result.summary.saving_percent
    assert (result.p_block_source, result.unit_time_source) == ("given", "given")
    assert result.order_source == "generated" and result.plan_metadata is None
    plan = result.frequency_plan()
    assert plan is not None and "profile_source" not in plan.workload


def test_a_session_request_records_the_guard_and_the_sources(profile: Profile) -> None:
    result = plan_profile(profile, SESSION)
    data = result.summary.to_json()
    assert list(data) == SUMMARY_KEYS + SESSION_KEYS  # no "refused": it pays
    assert data["switch_latency_source"] == "measured" and data["time_cv"] == 0.01
    assert (result.p_block_w, result.p_block_source) == (80.0, "measured")
    plan = result.frequency_plan()
    assert plan is not None
    assert plan.workload["profile_source"] == profile.source
    assert plan.workload["order_source"] == "generated" and plan.workload["deadline_s"] is None


def test_p_block_precedence(profile: Profile, capsys: pytest.CaptureFixture[str]) -> None:
    carried = Profile(profile.rows, source="saved.csv", p_block_w=75.0)
    bare = Profile(profile.rows, source="bare.csv")
    given = replace(SESSION, p_block_w=70.0)
    assert resolve_p_block(carried, given) == (70.0, "given")
    assert resolve_p_block(carried, SESSION) == (80.0, "measured")  # measured beats carried
    saved = replace(SESSION, session=SessionInputs())
    assert resolve_p_block(carried, saved) == (75.0, "profile")
    idle = replace(SESSION, session=SessionInputs(idle_power_w=(60.0, 0.0, 64.0)))
    assert resolve_p_block(bare, idle, Progress(True)) == (62.0, "idle")
    assert "using the devices' power before the session, 62.0 W" in capsys.readouterr().err
    with pytest.raises(PlanError, match="^P_block is unknown: no rank measured"):
        resolve_p_block(bare, saved)
    with pytest.raises(PlanError, match="^bare.csv: the profile does not carry the blocking"):
        resolve_p_block(bare, replace(FILE, p_block_w=None))


def test_a_deadline_ratio_is_a_deadline_against_all_max(profile: Profile) -> None:
    by_ratio = plan_profile(profile, replace(FILE, policy="deadline", deadline_ratio=1.1))
    t_prime = 1.1 * by_ratio.frontier.baseline_time_s
    assert by_ratio.deadline_s == pytest.approx(t_prime)
    by_time = plan_profile(profile, replace(FILE, policy="deadline", deadline_s=t_prime))
    assert by_time.choice.point == by_ratio.choice.point
    assert by_time.summary.to_json() | {"solve_time_s": 0} == by_ratio.summary.to_json() | {
        "solve_time_s": 0
    }


def test_a_deadline_below_t_min_is_an_error_for_a_file_and_clipped_for_a_session(
    profile: Profile,
) -> None:
    with pytest.raises(PlanError, match="below the fastest plan"):
        plan_profile(profile, replace(FILE, policy="deadline", deadline_s=0.01))
    result = plan_profile(profile, replace(SESSION, policy="deadline", deadline_s=0.01))
    assert result.deadline_s == result.frontier.fastest.time_s


def test_a_refused_session_plan_is_never_built_nor_written(
    profile: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # held to T_min, the deadline plan cannot meet it (the guard allows 0.1 % over T′)
    late = replace(SESSION, policy="deadline", deadline_s=0.01)
    result = plan_profile(profile, late)
    assert result.refused is not None and result.refused == result.choice.objection
    assert result.frequency_plan() is None
    assert result.summary.to_json()["refused"] == result.refused
    result.write(PlanOutputs.in_dir(tmp_path / "out"), say=Progress(True))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "frontier.csv", "profile.csv", "summary.json",
    ]  # fmt: skip
    assert f"profile, frontier, summary written to {tmp_path / 'out'}/" in capsys.readouterr().err
    # powerlib plan writes the plan it was asked for, whatever the verdict (as it always did)
    t_min = result.frontier.fastest.time_s
    as_file = replace(late, session=None, deadline_s=t_min, p_block_w=80.0)
    file_result = plan_profile(profile, as_file)
    assert file_result.choice.objection is not None and file_result.refused is None
    assert file_result.frequency_plan() is not None


def test_the_session_files(profile: Profile, tmp_path: Path) -> None:
    result = plan_profile(profile, replace(SESSION, frontier_points=8))
    result.write(PlanOutputs.in_dir(tmp_path, plot=False))
    written = Profile.read(tmp_path / "profile.csv")  # plans as the session did
    assert (written.p_block_w, written.unit_time_s) == (80.0, 0.001)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary.to_json()))
    assert FrequencyPlan.read(tmp_path / "plan.json").workload["profile_source"] == profile.source
    rows = (tmp_path / "frontier.csv").read_text().splitlines()
    assert len(rows) == 1 + len(result.frontier.points) >= 1 + 8


def test_the_order_a_session_recorded(capsys: pytest.CaptureFixture[str]) -> None:
    request = replace(FILE, num_stages=4, num_microbatches=4, say=Progress(True))
    one_f_one_b = build_schedule("1f1b", 4, 4)
    same = replace(request, recorded=dict(enumerate(one_f_one_b)))
    assert resolve_order(same) == (one_f_one_b, "recorded")
    assert capsys.readouterr().err == ""
    gpipe = build_schedule("gpipe", 4, 4)
    order, source = resolve_order(replace(request, recorded=dict(enumerate(gpipe))))
    assert (order, source) == (gpipe, "recorded")
    assert "differs from 1f1b's; planning on it" in capsys.readouterr().err
    partial = replace(request, recorded={0: gpipe[0]})
    assert resolve_order(partial) == (one_f_one_b, "generated")
    with pytest.raises(PlanError, match="the recorded orders cover stages \\[0\\]"):
        resolve_order(replace(partial, schedule=RECORDED))
    with pytest.raises(PlanError, match="no instruction order was recorded"):
        resolve_order(replace(request, schedule=RECORDED))


def test_replan_adds_a_deadline_to_the_sessions_frontier(profile: Profile) -> None:
    first = plan_profile(profile, SESSION)
    later = replan(first, SESSION, 1.15 * first.frontier.baseline_time_s)
    assert later.deadline_s == pytest.approx(1.15 * first.frontier.baseline_time_s)
    assert later.choice.policy.name == "deadline" and later.summary.guard is None
    plan = later.frequency_plan()
    assert plan is not None
    assert list(plan.workload)[-4:] == [
        "profile_source", "order_source", "deadline_s", "request_ahead_s"
    ]  # fmt: skip
    assert replan(first, SESSION, 0.01).deadline_s == first.frontier.fastest.time_s


def test_the_work_check_runs_before_anything_is_built(profile: Profile) -> None:
    huge = replace(FILE, num_microbatches=100_000, work_hint="use fewer --microbatches")
    with pytest.raises(PlanError, match="use fewer --microbatches"):
        check_work(profile, huge)
    with pytest.raises(PlanError, match="max-work"):
        plan_profile(profile, replace(FILE, max_work=10))
