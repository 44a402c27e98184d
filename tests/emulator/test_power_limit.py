"""A power limit on the emulated GPUs: clocks throttle to hold it (issue 47, item 1)."""

from __future__ import annotations

import pytest
from runtime_helpers import make_emulator, toy_profile

from powerlib.emulator.engine import IterationResult
from powerlib.planning.power_budget import PowerLimitModel, throttled_freq_mhz

# powers 200, 300 and 400 W; 1100 MHz draws less than 1000 MHz (tables are not monotone)
TABLE = {
    1000.0: (1.0, 200.0),
    1100.0: (0.95, 0.95 * 190.0),
    1200.0: (0.9, 270.0),
    1400.0: (0.8, 320.0),
}


@pytest.mark.parametrize(
    ("freq_mhz", "limit_w", "expected"),
    [
        (1400.0, None, 1400.0),  # no limit: the clock in force
        (1400.0, 400.0, 1400.0),  # exactly at the limit: allowed
        (1400.0, 399.0, 1200.0),
        (1400.0, 300.0, 1200.0),
        (1400.0, 250.0, 1100.0),  # the highest clock within it, not the first one below
        (1400.0, 195.0, 1100.0),
        (1400.0, 100.0, 1000.0),  # nothing holds it: the lowest clock
        (1000.0, 400.0, 1000.0),  # a lock below the limit's clock stays (never above a lock)
        (1200.0, 250.0, 1100.0),
    ],
)
def test_throttled_clock_is_the_highest_within_the_limit_and_the_lock(
    freq_mhz: float, limit_w: float | None, expected: float
) -> None:
    assert throttled_freq_mhz(TABLE, freq_mhz, limit_w) == expected


def _clocks(result: IterationResult, stage: int) -> set[float]:
    return {f for ex in result.executed if ex.instruction.stage == stage for _, _, f in ex.segments}


def test_a_limit_throttles_the_instructions_and_caps_the_waiting_power() -> None:
    profile = toy_profile(2)  # powers from 400 W (1410 MHz) down; 1095 MHz draws ~282 W
    emulator = make_emulator(profile, 2, p_block_w=500.0)  # waiting above the limit: capped
    emulator.set_power_limits([300.0, None])
    result = emulator.run_iteration()
    assert _clocks(result, 0) == {1095.0} and _clocks(result, 1) == {1410.0}
    table = {(r.stage, r.instruction, r.freq_mhz): (r.time_s, r.energy_j) for r in profile.rows}
    busy = [0.0, 0.0]
    energy = 0.0
    for ex in result.executed:
        s = ex.instruction.stage
        time_s, energy_j = table[s, ex.instruction.kind, 1095.0 if s == 0 else 1410.0]
        assert ex.end_s - ex.start_s == pytest.approx(time_s)
        busy[s] += time_s
        energy += energy_j
    energy += 300.0 * (result.time_s - busy[0]) + 500.0 * (result.time_s - busy[1])
    assert result.energy_j == pytest.approx(energy)


def test_no_limit_and_a_limit_above_every_power_change_nothing() -> None:
    profile = toy_profile(3)
    plain = make_emulator(profile, 3, noise=0.01, seed=3).run_iteration(noise_key=1)
    for limits in (None, [None, None, None], [400.0, 1000.0, 400.0]):
        emulator = make_emulator(profile, 3, noise=0.01, seed=3)
        emulator.set_power_limits(limits)
        got = emulator.run_iteration(noise_key=1)
        assert (got.time_s, got.energy_j) == (plain.time_s, plain.energy_j)


def test_a_locked_clock_under_a_limit_runs_at_the_lower_of_the_two() -> None:
    emulator = make_emulator(toy_profile(2), 2)
    emulator.set_power_limits([300.0, 300.0])
    n = len(emulator.dag.instructions)
    assert _clocks(emulator.run_frequencies([990.0] * n), 0) == {990.0}
    assert _clocks(emulator.run_frequencies([1410.0] * n), 1) == {1095.0}


def test_the_planners_model_of_a_limit_is_what_the_ideal_emulator_runs() -> None:
    profile = toy_profile(4)
    emulator = make_emulator(profile, 4, p_block_w=80.0)
    model = PowerLimitModel(profile, emulator.dag, p_block_w=80.0)
    for limits in ([400.0, 300.0, 250.0, 360.0], [220.0] * 4):
        emulator.set_power_limits(limits)
        result = emulator.run_iteration()
        predicted = model.outcome(limits)
        assert result.time_s == pytest.approx(predicted.time_s, rel=1e-9)
        assert result.energy_j == pytest.approx(predicted.energy_j, rel=1e-9)


@pytest.mark.parametrize("limits", [[300.0], [300.0, -1.0], [300.0, float("nan")]])
def test_bad_limits_are_refused_in_one_line(limits: list[float]) -> None:
    emulator = make_emulator(toy_profile(2), 2)
    with pytest.raises(ValueError, match="power limit") as err:
        emulator.set_power_limits(limits)
    assert "\n" not in str(err.value)
