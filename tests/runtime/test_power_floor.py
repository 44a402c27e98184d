"""A GPU power floor (power smoothing) in planning: slack cannot go below it (issue 47).

The planner raises every profiled row's energy to at least ``P_floor x time`` and the blocking
power to at least ``P_floor``; rank 0 says in one line when the floor cancels (part of) the
predicted saving. The profile is the GPT-3 A100 one the emulator ships (no GPU involved).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from powerlib.planning.power_floor import floor_from_details, floored_profile
from powerlib.planning.profile import Profile
from powerlib.planning.workflow import PlanRequest, SessionInputs, plan_profile
from powerlib.runtime.planning_step import floor_line, make_plan
from powerlib.runtime.records import ProfilePayload
from powerlib.runtime.session_config import SessionConfig

GPT3 = Path(__file__).parents[2] / "powerlib/emulator/data/gpt3-175b_a100_sxm.csv"
P_BLOCK_W = 80.0


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.read(GPT3)


def _floor_w(profile: Profile) -> float:
    """A floor between the slow clocks' power and the fast ones': it bites in slack only."""
    return statistics.median(r.energy_j / r.time_s for r in profile.rows)


INPUTS = SessionInputs(p_block_w=P_BLOCK_W, switch_latency_source="given")
SESSION = PlanRequest(
    num_stages=8, num_microbatches=4, unit_time_s=0.001, switch_latency_s=0.005, session=INPUTS
)


def _with_floor(floor_w: float) -> PlanRequest:
    return replace(SESSION, session=replace(INPUTS, power_floor_w=floor_w))


def test_the_floor_raises_rows_and_blocking_power_before_planning(profile: Profile) -> None:
    floor_w = _floor_w(profile)
    floored = floored_profile(profile, floor_w)
    assert all(r.energy_j >= floor_w * r.time_s * (1 - 1e-12) for r in floored.rows)
    raised = sum(a.energy_j != b.energy_j for a, b in zip(profile.rows, floored.rows, strict=True))
    assert 0 < raised < len(profile.rows)  # the slow clocks only
    assert floored_profile(profile, 0.0) is profile

    result = plan_profile(profile, _with_floor(floor_w))
    assert result.p_block_w == floor_w > P_BLOCK_W
    assert all(r.energy_j >= floor_w * r.time_s * (1 - 1e-12) for r in result.profile.rows)


def test_the_floor_cancels_part_of_the_saving_and_says_so(profile: Profile) -> None:
    floor_w = _floor_w(profile)
    plain = plan_profile(profile, SESSION)
    floored_request = _with_floor(floor_w)
    floored = plan_profile(profile, floored_request)
    without, with_floor = plain.summary.saving_percent, floored.summary.saving_percent
    assert without is not None and with_floor is not None and with_floor < without
    line = floor_line(floored, profile, floored_request)
    assert line is not None and f"{floor_w:g} W floor cancels" in line, line
    assert floor_line(plain, profile, SESSION) is None  # no floor: nothing to say


def test_rank_0_plans_with_the_highest_floor_a_rank_reported(
    profile: Profile, caplog: pytest.LogCaptureFixture
) -> None:
    floor_w = _floor_w(profile)
    config = SessionConfig.from_keywords(num_stages=8, num_microbatches=4, out_dir=None)
    payloads = [
        ProfilePayload(
            stage=s,
            rows=tuple(r for r in profile.rows if r.stage == s),
            p_block_w=P_BLOCK_W,
            power_floor_w=floor_w if s == 3 else None,
        )
        for s in range(8)
    ]
    with caplog.at_level(logging.WARNING):
        outcome = make_plan(config, payloads)
    assert outcome.p_block_w == floor_w  # planned with the floor, Planned or refused
    assert any(f"{floor_w:g} W floor cancels" in m for m in caplog.messages), caplog.messages


def test_the_floor_is_read_from_a_devices_details() -> None:
    on = {"power_smoothing": {"enabled": True, "floor_w": 420.0}}
    assert floor_from_details(on) == 420.0
    assert floor_from_details({"power_smoothing": {"enabled": False, "floor_w": 420.0}}) is None
    assert floor_from_details({"power_smoothing": {"enabled": True}}) is None
    assert floor_from_details({}) is None


def test_the_line_says_all_when_nothing_is_left_and_nothing_below_the_threshold() -> None:
    from powerlib.planning.power_floor import FloorEffect

    line = FloorEffect(475.0, -0.5, 0.8).line()
    assert line is not None and "475 W floor cancels all of the 0.80 %" in line
    assert FloorEffect(300.0, 10.0, 10.01).line() is None  # under 0.05 points: not said
