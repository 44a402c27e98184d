"""FrequencyPlan.grid: the stage x time text rendering that ``powerlib simulate`` prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from powerlib import PlanError
from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier
from powerlib.planning.plan import FrequencyPlan, PlannedInstruction
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule, schedule_1f1b

PROFILE = Path(__file__).resolve().parents[2] / "powerlib" / "emulator" / "data"
GPT3 = PROFILE / "gpt3-175b_a100_sxm.csv"


def _plan(*, timed: bool = True, freqs: tuple[float, float] = (1410.0, 1200.0)) -> FrequencyPlan:
    """2 stages x 2 microbatches of 1F1B; every instruction 1 s; stage s at ``freqs[s]``."""
    stages = tuple(
        tuple(
            PlannedInstruction(ins, freqs[s], planned_time_s=1.0 if timed else None)
            for ins in order
        )
        for s, order in enumerate(schedule_1f1b(2, 2))
    )
    return FrequencyPlan(
        stages=stages, workload={"schedule": "1f1b"}, summary={"policy": "fastest"}
    )


def _rows(text: str, block: int) -> list[str]:
    """The cells of block 0 (instructions) or 1 (clocks), one string per stage."""
    rows = [line for line in text.splitlines() if "|" in line]
    half = len(rows) // 2
    chosen = rows[:half] if block == 0 else rows[half:]
    return [row.split("|")[1] for row in chosen]


def test_one_row_per_stage_each_as_wide_as_asked() -> None:
    for width in (1, 12, 100):
        text = _plan().grid(width)
        for block in (0, 1):
            rows = _rows(text, block)
            assert len(rows) == 2
            assert all(len(cells) == width for cells in rows)
    assert len(_plan().grid().splitlines()) == 1 + 1 + 2 + 1 + 2 + 1  # header, 2 blocks, legend


def test_stage_1_starts_after_stage_0_and_waits_idle() -> None:
    # S0: F0 [0,1] F1 [1,2] B0 [3,4] B1 [5,6]; S1: F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5]
    text = _plan().grid(12)
    s0, s1 = _rows(text, 0)
    assert s0 == "FFFF..BB..BB"
    assert s1 == "..FFBBFFBB.."
    assert s1.index("F") > s0.index("F")
    assert "iteration 6 s, 12 columns of 0.5 s" in text.splitlines()[0]


def test_the_clock_block_resolves_to_mhz() -> None:
    text = _plan().grid(12)
    s0, s1 = _rows(text, 1)
    assert (s0, s1) == ("0000..00..00", "..11111111..")
    assert text.splitlines()[-1] == "clock: 0 = 1410 MHz, 1 = 1200 MHz"


def test_a_plan_without_durations_is_drawn_one_unit_per_instruction() -> None:
    text = _plan(timed=False).grid(12)
    header = text.splitlines()[0]
    assert "records no duration for any instructions" in header and "6 units" in header
    assert _rows(text, 0) == ["FFFF..BB..BB", "..FFBBFFBB.."]


def test_predicted_time_stands_in_for_a_missing_planned_time() -> None:
    plan = _plan(timed=False)
    stages = tuple(
        tuple(PlannedInstruction(p.instruction, p.freq_mhz, predicted_time_s=2.0) for p in stage)
        for stage in plan.stages
    )
    text = FrequencyPlan(stages=stages).grid(12)
    assert "iteration 12 s" in text.splitlines()[0]
    assert _rows(text, 0) == ["FFFF..BB..BB", "..FFBBFFBB.."]


def test_the_grid_refuses_a_width_below_one() -> None:
    with pytest.raises(PlanError, match="at least 1 cell wide"):
        _plan().grid(0)


@pytest.mark.skipif(not GPT3.exists(), reason="the shipped GPT-3 profile is not present")
def test_a_frontier_plan_draws_every_stage_busy_and_in_dependency_order() -> None:
    frontier = compute_frontier(
        Profile.read(GPT3),
        build_schedule("1f1b", 8, 6),
        settings=FrontierSettings(unit_time_s=1e-3, p_block_w=80.0),
        schedule_name="1f1b",
        num_microbatches=6,
    )
    plan = frontier.plan(frontier.fastest, policy="fastest")
    text = plan.grid()
    rows = _rows(text, 0)
    assert len(rows) == 8 and all(len(r) == 100 for r in rows)
    firsts = [r.index("F") for r in rows]
    assert firsts == sorted(firsts) and firsts[0] == 0
    assert all(set(r) <= {"F", "B", "."} for r in rows)
    assert text == plan.grid()  # pure: drawing twice gives the same text
