"""The profile's blocks on an emulated GPU that samples power part-time and warms up (issue 45).

The device declares its power-sampling duty (``DeviceInfo.power_sampling_duty``), the sampler
carries it, and the sweep's attribution counts only each counter update's sampled window: rows
resolve in a few iterations instead of refusing. A GPU warming while the sweep runs is
corrected to its last temperature (docs/measurement.md §2.1).
"""

from __future__ import annotations

import contextlib
import random
import warnings
from pathlib import Path

import pytest
from runtime_helpers import emulated_sessions, make_emulator, toy_profile

from powerlib.emulator.device import EmulatedDevice, VirtualTime
from powerlib.measurement.attribution import REST
from powerlib.measurement.sampler import DeviceSampler
from powerlib.runtime.profile_blocks import Blocks, SolvedRows

FREQS = (1400.0, 1100.0, 800.0)
TABLE = {  # kind -> clock -> (time_s, energy_j): 400-460 W busy, 80 W waiting
    "forward": {1400.0: (0.050, 23.0), 1100.0: (0.060, 22.0), 800.0: (0.080, 22.4)},
    "backward": {1400.0: (0.090, 36.0), 1100.0: (0.110, 33.0), 800.0: (0.150, 36.0)},
}


def _sweep(
    duty: float,
    *,
    drift: float = 0.0,
    iterations: int = 3,
    declared: bool = True,
    gap_s: float = 0.04,
    bubble_s: float = 0.15,
) -> tuple[Blocks, SolvedRows, EmulatedDevice]:
    """One stage's sweep, top clock first, 4 microbatches per iteration, gaps between.

    ``gap_s``: the longest gap after an instruction (uniform from 0); ``bubble_s``: the idle
    time closing each iteration.
    """
    clock = VirtualTime()
    device = EmulatedDevice(
        index=0, table=TABLE, clock=clock, p_block_w=80.0, counter_period_s=0.1,
        counter_phase_s=0.037, duty=duty, drift=drift, drift_tau_s=5.0,
    )  # fmt: skip
    sampler = DeviceSampler(device, clock=clock)
    if not declared:
        sampler.duty = 1.0  # as if the device had not said it samples part-time
    blocks = Blocks(sampler)
    rng = random.Random(0)
    for freq in FREQS:
        device.lock_sm_clocks(freq)
        blocks.start(freq, clock())
        block = blocks.blocks[-1]
        assert block.windows is not None
        for _ in range(iterations):
            start = clock()
            for kind in ("forward", "backward") * 4:
                t0 = clock()
                end, _, _ = device.execute(kind, t0)
                clock.advance_to(end)
                blocks.spans[-1].append((kind, [t0], [end]))
                clock.advance_to(end + rng.uniform(0.0, gap_s))
            clock.advance_to(clock() + bubble_s)  # the pipeline's bubble
            block.windows.append(([start], [clock()]))
            block.iterations += 1
    clock.advance_to(clock() + 0.3)  # the counter publishes past the last window
    return blocks, blocks.solve_rows(0, FREQS, None), device


def _power_error(rows: SolvedRows, scale: float = 1.0) -> float:
    """Worst relative error of a row's power against the table (times ``scale``)."""
    worst = 0.0
    for r in rows.rows:
        time_s, energy_j = TABLE[r.instruction][r.freq_mhz]
        worst = max(worst, abs((r.energy_j / r.time_s) / (scale * energy_j / time_s) - 1.0))
    return worst


def test_the_emulated_gpu_declares_its_duty() -> None:
    _, _, device = _sweep(0.25, iterations=1)
    assert device.info.power_sampling_duty == 0.25


def test_a_declared_duty_resolves_every_row_in_three_iterations() -> None:
    blocks, rows, _ = _sweep(0.25)
    assert blocks.sampler.duty == 0.25
    assert len(rows.rows) == 6
    assert max(rows.errors.values()) < 0.02  # the sweep's target
    assert _power_error(rows) < 0.01
    assert rows.p_block_w == pytest.approx(80.0, rel=0.01)


def test_a_blocking_power_the_gaps_cannot_tell_is_left_unresolved() -> None:
    """Back-to-back instructions (gaps of at most 0.2 ms, no bubble) cannot tell P_block: its
    fit (about 62 W +- 490 % here; a loaded CI run once solved -65 W) is not reported, so the
    planner falls back to the devices' idle power instead of refusing a negative one."""
    blocks, rows, _ = _sweep(1.0, gap_s=0.0002, bubble_s=0.0)
    fitted = blocks.solve(list(range(len(blocks.blocks))), recent=False, latency_s=None)
    assert fitted[REST][1] >= 1.0  # the fit's interval reaches 0 W
    assert rows.p_block_w is None and rows.p_block_error is None
    assert len(rows.rows) == 6  # the instructions themselves still resolve
    _, resolved, _ = _sweep(1.0, gap_s=0.001, bubble_s=0.0)
    assert resolved.p_block_w is not None and resolved.p_block_w > 0  # 1 ms gaps: +-74 %


def test_an_undeclared_duty_leaves_the_rows_unresolved() -> None:
    _, rows, _ = _sweep(0.25, declared=False)
    assert max(rows.errors.values()) > 0.04  # what made every GPT-3 case refuse before


def test_the_thermal_drift_is_removed_from_the_rows() -> None:
    blocks, rows, device = _sweep(1.0, drift=0.02, iterations=4)
    assert blocks.drift_per_c is not None
    last_read_s = float(blocks.sampler.temperature_reads()[0][-1])
    warm = device.drift_factor(last_read_s - 0.5)  # the powers over the sweep's last second
    assert _power_error(rows, warm) < 0.003
    # the fit's drift per degree is near the emulator's (2 % over 40 degrees, at the warm end);
    # the counter's located updates leave the rows 0.1-0.3 % of misfit, which it absorbs
    assert blocks.drift_per_c[0] * warm == pytest.approx(0.02 / 40.0, rel=0.3)
    kept = list(range(len(blocks.blocks)))
    plain = blocks.solve(kept, recent=False, latency_s=None)
    top = plain[("forward", 1400.0)][0] / (warm * 23.0 / 0.050)
    assert top < 0.99  # measured first, coldest: without the drift term it reads low


def test_a_pipeline_of_part_time_gpus_plans_and_applies(tmp_path: Path) -> None:
    """Four emulated stages whose 100 ms counter samples a quarter of each period, at a random
    phase: the sessions used to refuse in the first clock (known to +-13 %); now they plan."""
    emulator = make_emulator(
        toy_profile(), 4, counter_period_s=0.1, duty=0.25, counter_phase="random"
    )
    sessions = emulated_sessions(emulator, tmp_path / "out")
    with warnings.catch_warnings(record=True) as caught, contextlib.ExitStack() as stack:
        warnings.simplefilter("always")
        for session in sessions:
            stack.enter_context(session)
        phases = [emulator.run_iteration(sessions).phases for _ in range(60)]
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert phases[-1] == ("apply",) * 4
    assert (tmp_path / "out" / "plan.json").exists()
