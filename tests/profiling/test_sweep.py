"""The profile sweep's iteration plan, its stop rule, and the rank aggregation."""

from __future__ import annotations

import pytest

from powerlib.errors import InvalidArgumentError
from powerlib.planning.profile import ProfileRow
from powerlib.profiling.sweep import (
    FrequencySweep,
    ProfileRecorder,
    SweepConfig,
    aggregate_stage_rows,
)


def _walk(config: SweepConfig, stop_at: float | None = None) -> list[tuple[float, bool]]:
    sweep = FrequencySweep(config)
    seen = []
    while not sweep.finished:
        seen.append((sweep.freq_mhz, sweep.measuring))
        complete = sweep.block_complete_after_this()
        stop = complete and not sweep.warming_up and sweep.freq_mhz == stop_at
        sweep.advance(stop)
    return seen


def test_warmup_settle_and_measured_iterations_from_high_to_low() -> None:
    config = SweepConfig(
        freqs_mhz=(900, 1410, 1200, 1410),
        warmup_iterations=2,
        settle_iterations=1,
        iterations_per_freq=2,
    )
    assert config.freqs_mhz == (1410.0, 1200.0, 900.0)
    assert _walk(config) == [
        (1410.0, False),
        (1410.0, False),  # warm-up
        (1410.0, False),
        (1410.0, True),
        (1410.0, True),
        (1200.0, False),
        (1200.0, True),
        (1200.0, True),
        (900.0, False),
        (900.0, True),
        (900.0, True),
    ]
    assert config.max_iterations == 11


def test_stop_ends_after_the_current_block() -> None:
    config = SweepConfig(
        freqs_mhz=(1410, 1200, 900), warmup_iterations=0, settle_iterations=0, iterations_per_freq=1
    )
    assert _walk(config, stop_at=1200.0) == [(1410.0, True), (1200.0, True)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"freqs_mhz": ()},
        {"freqs_mhz": (0.0,)},
        {"freqs_mhz": (float("nan"),)},
        {"freqs_mhz": (1410,), "iterations_per_freq": 0},
        {"freqs_mhz": (1410,), "warmup_iterations": -1},
        {"freqs_mhz": (1410,), "stop_after_rises": 1.5},
    ],
)
def test_bad_sweep_settings(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SweepConfig(**kwargs)


def test_energy_rise_counts_frequencies_above_the_best_so_far() -> None:
    rec = ProfileRecorder()
    freqs = (1400.0, 1300.0, 1200.0, 1100.0, 1000.0, 900.0)
    for f, e in zip(freqs, (10.0, 9.0, 8.0, 8.5, 8.2, 8.9)):
        rec.add_iteration(f, e)
    assert rec.energy_rose(freqs, 1200.0) == 0
    assert rec.energy_rose(freqs, 1100.0) == 1
    assert rec.energy_rose(freqs, 1000.0) == 2  # 8.2 > 8.0, though below 8.5
    assert rec.energy_rose(freqs, 900.0) == 3


def test_recorder_means_and_blocking_power() -> None:
    rec = ProfileRecorder()
    rec.add("forward", 1410.0, 0.010, 3.0)
    rec.add("forward", 1410.0, 0.014, 5.0)
    rec.add("backward", 1410.0, 0.020, 8.0)
    rec.add_gap(0.001, 10.0)  # too short to trust: ignored
    assert rec.p_block_w is None
    rec.add_gap(0.050, 4.0)
    rec.add_gap(0.030, 2.4)
    rows = {(r.instruction, r.freq_mhz): r for r in rec.rows(2)}
    assert rows[("forward", 1410.0)].time_s == pytest.approx(0.012)
    assert rows[("forward", 1410.0)].energy_j == pytest.approx(4.0)
    assert rows[("backward", 1410.0)].stage == 2
    assert rec.p_block_w == pytest.approx(6.4 / 0.08)


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
