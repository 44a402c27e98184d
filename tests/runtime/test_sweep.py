"""The profile sweep's iteration plan (warm-up, blocks, coarse then fill), and the rank
aggregation (docs/architecture.md §2 step 2, docs/perseus.md §4.5)."""

from __future__ import annotations

import dataclasses

import pytest

from powerlib.errors import InvalidArgumentError
from powerlib.planning.profile_rows import ProfileRow
from powerlib.runtime.sweep import (
    FrequencySweep,
    ProfileRecorder,
    SweepConfig,
    aggregate_stage_rows,
)

TWELVE = tuple(float(f) for f in range(1400, 690, -60))  # 1400, 1340, ..., 740 MHz


def _walk(config: SweepConfig, stop_at: float | None = None) -> list[tuple[float, bool]]:
    """Every iteration's (clock, measured); each block ends as soon as the sweep lets it (the
    ranks' vote says done), and the coarse pass is stopped at ``stop_at``."""
    sweep = FrequencySweep(config)
    seen = []
    while not sweep.finished:
        seen.append((sweep.freq_mhz, sweep.measuring))
        if sweep.iteration_ended():
            sweep.end_block(stop_coarse=sweep.coarse and sweep.freq_mhz == stop_at)
    return seen


def _blocks(seen: list[tuple[float, bool]]) -> list[float]:
    """The clocks of the measured blocks, in visiting order."""
    out: list[float] = []
    for freq, measured in seen:
        if measured and (not out or out[-1] != freq):
            out.append(freq)
    return out


def test_defaults() -> None:
    config = SweepConfig(freqs_mhz=TWELVE)
    assert config.warmup_iterations == 2
    assert config.settle_iterations == 0
    assert config.iterations_per_freq == 1
    assert config.max_iterations_per_freq == 4
    assert config.target_error == 0.02
    assert config.stop_after_rises == 2
    assert config.coarse_stride == 3
    assert config.target_time_error == 0.001
    assert config.reference_iterations == 8
    assert config.rotating_reference is True
    # the reference block (the top clock, first) runs 8 measured iterations at most instead of
    # 4: max_iterations counts those 4 extra (issue 45)
    assert config.max_iterations == 2 + 12 * 4 + (8 - 4)


def test_warmup_settle_and_measured_iterations_coarse_then_fill() -> None:
    config = SweepConfig(
        freqs_mhz=(900, 1410, 1200, 1410, 1000),
        warmup_iterations=2,
        settle_iterations=1,
        iterations_per_freq=2,
        coarse_stride=2,
        reference_iterations=3,
    )
    assert config.freqs_mhz == (1410.0, 1200.0, 1000.0, 900.0)  # deduplicated, high to low
    assert _walk(config) == [
        (1410.0, False),
        (1410.0, False),  # warm-up at the top clock
        (1410.0, False),  # settle
        (1410.0, True),
        (1410.0, True),
        (1410.0, True),  # the reference block: reference_iterations (3), not 2
        (1000.0, False),  # coarse: every second clock from the top...
        (1000.0, True),
        (1000.0, True),
        (900.0, False),  # ... and the lowest clock
        (900.0, True),
        (900.0, True),
        (1200.0, False),  # fill: the clock the coarse pass skipped
        (1200.0, True),
        (1200.0, True),
    ]
    # no block resolves before its maximum (4; the reference block's 3 are below it)
    assert config.max_iterations == 2 + 4 * (1 + 4)
    longer = dataclasses.replace(config, reference_iterations=7)
    assert longer.max_iterations == 2 + 4 * (1 + 4) + (7 - 4)  # the reference block's extra 3


def test_warmup_needs_no_vote_and_runs_at_the_top_clock() -> None:
    sweep = FrequencySweep(SweepConfig(freqs_mhz=TWELVE, warmup_iterations=3))
    for _ in range(3):
        assert sweep.warming_up and not sweep.measuring
        assert sweep.freq_mhz == 1400.0
        assert sweep.position == (0, 12)
        assert sweep.iteration_ended() is False
    assert not sweep.warming_up and sweep.measuring
    assert sweep.freq_mhz == 1400.0
    assert sweep.position == (1, 5)  # first of the 5 coarse clocks


def test_a_block_votes_from_its_minimum_and_must_end_at_its_maximum() -> None:
    config = SweepConfig(
        freqs_mhz=TWELVE,
        warmup_iterations=0,
        settle_iterations=1,
        iterations_per_freq=2,
        max_iterations_per_freq=4,
        reference_iterations=1,  # the first block is an ordinary one (see the next test)
    )
    sweep = FrequencySweep(config)
    assert not sweep.measuring  # the settle iteration is discarded
    assert sweep.iteration_ended() is False
    assert sweep.measuring and sweep.measured_in_block == 0
    assert sweep.iteration_ended() is False  # 1 measured: below the minimum
    assert sweep.iteration_ended() is True  # 2 measured: the ranks may vote
    assert not sweep.must_end_block()
    assert sweep.iteration_ended() is True  # the vote said "not resolved": one more
    assert not sweep.must_end_block()
    assert sweep.iteration_ended() is True
    assert sweep.measured_in_block == 4 and sweep.must_end_block()
    assert sweep.freq_mhz == 1400.0  # the block only ends when the ranks agree
    sweep.end_block()
    assert sweep.freq_mhz == 1220.0 and sweep.measured_in_block == 0 and not sweep.measuring
    assert sweep.visited == [1400.0]


def test_the_reference_block_votes_from_reference_iterations_and_later_blocks_do_not() -> None:
    config = SweepConfig(
        freqs_mhz=TWELVE,
        warmup_iterations=1,
        settle_iterations=1,
        iterations_per_freq=2,
        max_iterations_per_freq=4,
        reference_iterations=6,
    )
    sweep = FrequencySweep(config)
    assert sweep.iteration_ended() is False  # warm-up
    assert sweep.block_index == 0 and sweep.freq_mhz == 1400.0  # the reference: the top clock
    assert sweep.iteration_ended() is False  # settle
    for measured in range(1, 6):
        assert sweep.iteration_ended() is False, measured  # below reference_iterations (6)
        assert not sweep.must_end_block()
    assert sweep.iteration_ended() is True  # 6 measured: the ranks may vote ...
    assert sweep.measured_in_block == 6 and sweep.must_end_block()  # ... and must end it
    sweep.end_block()
    assert sweep.block_index == 1 and sweep.freq_mhz == 1220.0
    assert sweep.iteration == 8  # warm-up, settle, 6 measured
    assert sweep.iteration_ended() is False  # settle
    assert sweep.iteration_ended() is False  # 1 measured: below iterations_per_freq (2)
    assert sweep.iteration_ended() is True  # later blocks vote from iterations_per_freq ...
    assert not sweep.must_end_block()
    sweep.iteration_ended()
    sweep.iteration_ended()
    assert sweep.measured_in_block == 4 and sweep.must_end_block()  # ... and end at its maximum
    # the sweep that never resolves early: the reference block's 2 extra iterations counted
    assert config.max_iterations == 1 + 12 * (1 + 4) + (6 - 4)


def test_max_iterations_per_freq_below_the_minimum_is_raised_to_it() -> None:
    config = SweepConfig(freqs_mhz=(1410,), iterations_per_freq=3, max_iterations_per_freq=1)
    assert config.max_iterations_per_freq == 3


def test_the_coarse_pass_visits_every_stride_th_clock_then_fills_in() -> None:
    config = SweepConfig(freqs_mhz=TWELVE, warmup_iterations=0, coarse_stride=3)
    seen = _walk(config)
    assert all(measured for _, measured in seen)  # no settle iterations by default
    blocks = _blocks(seen)
    coarse = [1400.0, 1220.0, 1040.0, 860.0, 740.0]  # every third, and the lowest
    assert blocks[:5] == coarse
    assert blocks[5:] == [f for f in TWELVE if f not in coarse]  # the rest, high to low
    assert sorted(blocks) == sorted(TWELVE)  # each clock once


def test_stride_one_is_a_single_pass_from_high_to_low() -> None:
    config = SweepConfig(freqs_mhz=TWELVE, warmup_iterations=0, coarse_stride=1)
    assert _blocks(_walk(config)) == list(TWELVE)


def test_a_stopped_coarse_pass_fills_in_only_above_the_first_rise() -> None:
    config = SweepConfig(freqs_mhz=TWELVE, warmup_iterations=0, stop_after_rises=2)
    # energy rose at 1040 and again at 860: the ranks stop the coarse pass there
    blocks = _blocks(_walk(config, stop_at=860.0))
    assert blocks[:4] == [1400.0, 1220.0, 1040.0, 860.0]
    assert 740.0 not in blocks  # the coarse pass ended before its last clock
    fill = blocks[4:]
    assert fill == [f for f in TWELVE if f > 1040.0 and f not in (1400.0, 1220.0)]
    assert not any(f < 1040.0 for f in fill)  # dominated clocks are not profiled


def test_stop_after_rises_zero_never_skips_a_clock() -> None:
    config = SweepConfig(freqs_mhz=TWELVE, warmup_iterations=0, stop_after_rises=0)
    blocks = _blocks(_walk(config, stop_at=1040.0))
    assert blocks[:3] == [1400.0, 1220.0, 1040.0]
    assert sorted(blocks) == sorted(TWELVE)  # every clock, each once


def test_a_single_clock_is_one_block() -> None:
    config = SweepConfig(freqs_mhz=(1410,), warmup_iterations=1)
    # the one block is the reference block: reference_iterations (8) measured iterations
    assert _walk(config) == [(1410.0, False)] + [(1410.0, True)] * 8
    exact = SweepConfig(freqs_mhz=(1410,), warmup_iterations=1, reference_iterations=1)
    assert _walk(exact) == [(1410.0, False), (1410.0, True)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"freqs_mhz": ()},
        {"freqs_mhz": (0.0,)},
        {"freqs_mhz": (-1410.0,)},
        {"freqs_mhz": (float("nan"),)},
        {"freqs_mhz": (float("inf"),)},
        {"freqs_mhz": (1410,), "iterations_per_freq": 0},
        {"freqs_mhz": (1410,), "max_iterations_per_freq": 0},
        {"freqs_mhz": (1410,), "warmup_iterations": -1},
        {"freqs_mhz": (1410,), "settle_iterations": -1},
        {"freqs_mhz": (1410,), "stop_after_rises": 1.5},
        {"freqs_mhz": (1410,), "stop_after_rises": -1},
        {"freqs_mhz": (1410,), "coarse_stride": 0},
        {"freqs_mhz": (1410,), "iterations_per_freq": True},
        {"freqs_mhz": (1410,), "target_error": 0.0},
        {"freqs_mhz": (1410,), "target_error": 1.0},
        {"freqs_mhz": (1410,), "target_error": float("nan")},
        {"freqs_mhz": (1410,), "target_error": "0.02"},
        {"freqs_mhz": (1410,), "reference_iterations": 0},
        {"freqs_mhz": (1410,), "reference_iterations": True},
        {"freqs_mhz": (1410,), "target_time_error": 0.0},
        {"freqs_mhz": (1410,), "target_time_error": 1.0},
    ],
)
def test_bad_sweep_settings(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SweepConfig(**kwargs)


def test_recorder_keeps_the_solved_rows_errors_and_blocking_power() -> None:
    rec = ProfileRecorder()
    assert rec.rows(2) == [] and rec.p_block_w is None and rec.row_errors == {}
    forward = ProfileRow(
        stage=0, instruction="forward", freq_mhz=1410.0, time_s=0.012, energy_j=4.0
    )
    backward = ProfileRow(
        stage=0, instruction="backward", freq_mhz=1410.0, time_s=0.020, energy_j=8.0
    )
    rec.set(
        [forward, backward], {("forward", 1410.0): 0.01, ("backward", 1410.0): 0.015}, 80.0, 0.03
    )
    rows = {(r.instruction, r.freq_mhz): r for r in rec.rows(2)}
    assert rows[("forward", 1410.0)].time_s == pytest.approx(0.012)
    assert rows[("forward", 1410.0)].energy_j == pytest.approx(4.0)
    assert {r.stage for r in rows.values()} == {2}  # restaged to the asked stage
    assert rec.row_errors[("backward", 1410.0)] == 0.015
    assert rec.p_block_w == 80.0 and rec.p_block_error == 0.03


def _row(stage: int, kind: str, f: float, t: float, e: float) -> ProfileRow:
    return ProfileRow(stage=stage, instruction=kind, freq_mhz=f, time_s=t, energy_j=e)


def test_aggregation_takes_max_time_and_mean_energy_per_stage() -> None:
    rank0 = [_row(0, "forward", 1410, 0.010, 4.0), _row(0, "forward", 1200, 0.012, 3.0)]
    rank1 = [_row(0, "forward", 1410, 0.011, 6.0)]  # did not measure 1200
    rank2 = [_row(1, "forward", 1410, 0.020, 9.0)]
    merged = {(r.stage, r.freq_mhz): r for r in aggregate_stage_rows([rank0, rank1, rank2])}
    assert merged[(0, 1410)].time_s == 0.011
    assert merged[(0, 1410)].energy_j == 5.0
    assert (0, 1200) not in merged  # not every rank of stage 0 has it
    assert merged[(1, 1410)].energy_j == 9.0
