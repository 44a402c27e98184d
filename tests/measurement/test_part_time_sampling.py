"""Part-time power sampling and thermal drift in the profile's attribution (issue 45, point 4).

An A100/H100 samples power during only the last 25 % of each 100 ms counter period and adds
``1 / duty`` times that window's energy at each update (Yang et al., SC'24, arXiv 2312.02741;
docs/measurement.md §2.1). Knowing the duty, the attribution counts only the spans inside each
sampled window and is exact again; a GPU that warms while the sweep runs is corrected by one
fitted drift per degree.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from powerlib.device import Capabilities, DeviceInfo, DeviceKind
from powerlib.gpu_specs import power_sampling_duty
from powerlib.measurement.attribution import (
    REST,
    Spans,
    sampled_windows,
    solve_drifting_powers,
    solve_powers,
)

PERIOD_S, DUTY = 0.1, 0.25
POWERS_W = {"forward": 420.0, "backward": 300.0, REST: 80.0}


def _workload(seconds: float, seed: int = 0) -> tuple[Spans, list[tuple[float, float, str]]]:
    """Instructions of 20-90 ms with gaps of 0-60 ms between them, in one window."""
    rng = random.Random(seed)
    spans, pieces = Spans(), []
    t = 0.013
    spans.add_window(t, seconds)
    while True:
        kind = rng.choice(("forward", "backward"))
        length, gap = rng.uniform(0.02, 0.09), rng.uniform(0.0, 0.06)
        if t + length + gap > seconds:
            break
        spans.add(kind, t, t + length)
        pieces.append((t, t + length, kind))
        t += length + gap
    return spans, pieces


def _energy(pieces: list[tuple[float, float, str]], a: float, b: float, scale=None) -> float:
    """Exact energy in ``[a, b]``: the pieces' power, the rest at the blocking power."""
    busy = 0.0
    total = 0.0
    for s, e, kind in pieces:
        lo, hi = max(s, a), min(e, b)
        if hi > lo:
            factor = 1.0 if scale is None else scale(0.5 * (lo + hi))
            total += POWERS_W[kind] * factor * (hi - lo)
            busy += hi - lo
    idle_factor = 1.0 if scale is None else scale(0.5 * (a + b))
    return total + POWERS_W[REST] * idle_factor * (b - a - busy)


def _part_time_counter(pieces, knots: np.ndarray, duty: float) -> np.ndarray:
    """What a counter that samples the last ``duty`` of each period publishes at each knot."""
    adds = [_energy(pieces, t - duty * PERIOD_S, t) / duty for t in knots]
    return np.cumsum(adds)


def test_sampled_windows_end_at_each_update_and_last_the_duty() -> None:
    knots = np.array([0.1, 0.2, 0.3, 0.5, 0.6])  # the update at 0.4 was not seen
    starts, ends, interval = sampled_windows(knots, 0.25)
    assert ends.tolist() == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.6])
    assert (ends - starts).tolist() == pytest.approx([0.025] * 5)
    assert interval.tolist() == [0, 1, 2, 2, 3]  # the missed update's window is in its interval


def test_a_known_duty_makes_a_part_time_counter_exact() -> None:
    spans, pieces = _workload(12.0)
    knots = np.arange(0.1, 12.0, PERIOD_S) + 0.037
    counter = _part_time_counter(pieces, knots, DUTY)
    known, _ = solve_powers(knots, counter, spans, duty=DUTY)
    for label, power_w in POWERS_W.items():
        assert known[label].power_w == pytest.approx(power_w, rel=1e-6)
        assert known[label].rel_error < 1e-6
    # read as whole-period energy, the same counter is far from it (the issue-45 refusal)
    whole, _ = solve_powers(knots, counter, spans)
    assert max(whole[k].rel_error for k in ("forward", "backward")) > 0.05


def test_missed_updates_and_merged_intervals_keep_it_exact() -> None:
    spans, pieces = _workload(8.0, seed=1)
    knots = np.arange(0.1, 8.0, PERIOD_S) + 0.011
    counter = _part_time_counter(pieces, knots, DUTY)
    seen = np.ones(knots.size, dtype=bool)
    seen[5::7] = False  # the sampler missed every 7th update (it waited for the GIL)
    got, used = solve_powers(knots[seen], counter[seen], spans, duty=DUTY, min_interval_s=0.15)
    assert used > 20
    for label, power_w in POWERS_W.items():
        assert got[label].power_w == pytest.approx(power_w, rel=1e-6)


def test_a_warming_gpu_is_corrected_to_its_last_temperature() -> None:
    """Powers rise 2 % as the GPU warms (the emulator's drift); one label per time block, as a
    sweep measures one clock per block; the blocking power is in every block."""
    tau = 60.0
    seconds = 120.0
    spans, pieces = Spans(), []
    spans.add_window(0.0, seconds)
    rng = random.Random(2)
    t = 0.0
    labels = ["forward", "backward"] * 6
    while t < seconds - 0.2:
        block = labels[int(t // 10.0)]
        length = rng.uniform(0.03, 0.08)
        spans.add((block, int(t // 10.0)), t, t + length)
        pieces.append((t, t + length, block))
        t += length + rng.uniform(0.01, 0.05)
    temperature = lambda s: 35.0 + 40.0 * (1.0 - math.exp(-s / tau))  # noqa: E731
    drift = lambda s: 1.0 + 0.0005 * (temperature(s) - 35.0)  # noqa: E731
    knots = np.arange(0.1, seconds, PERIOD_S)
    counter = np.cumsum([_energy(pieces, k - PERIOD_S, k, drift) for k in knots])
    reference_c = temperature(seconds)
    solved = solve_drifting_powers(
        knots, counter, spans, lambda s: np.vectorize(temperature)(s) - reference_c
    )
    assert solved is not None
    assert solved.drift_per_unit * drift(seconds) == pytest.approx(0.0005, rel=0.02)
    warm = drift(seconds)
    for (kind, block), p in ((k, v) for k, v in solved.powers.items() if k != REST):
        assert p.power_w == pytest.approx(POWERS_W[kind] * warm, rel=2e-3), (kind, block)
    plain, _ = solve_powers(knots, counter, spans)
    first = plain[("forward", 0)].power_w / (POWERS_W["forward"] * warm)
    assert first < 0.99  # the coldest block reads >1 % low without the drift term


def test_the_duty_is_declared_by_the_device() -> None:
    assert power_sampling_duty("NVIDIA A100-SXM4-40GB") == 0.25
    assert power_sampling_duty("NVIDIA H100 80GB HBM3") == 0.25
    assert power_sampling_duty("NVIDIA A40") == 1.0
    assert power_sampling_duty("NVIDIA RTX A4000") == 1.0  # not an A40, not an A100
    caps = Capabilities(
        can_lock_sm_clocks=False,
        can_set_power_limit=False,
        can_reset_power_limit=False,
        has_energy_counter=True,
        has_power_reading=True,
        has_temperature=False,
    )
    info = dict(
        device_id="x", index=0, name="x", vendor="x", kind=DeviceKind.GPU, backend="x",
        supported_sm_freqs_mhz=(), power_limit_range_w=None, default_power_limit_w=None,
        capabilities=caps,
    )  # fmt: skip
    assert DeviceInfo(**info).power_sampling_duty == 1.0  # type: ignore[arg-type]
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="power_sampling_duty"):
            DeviceInfo(**info, power_sampling_duty=bad)  # type: ignore[arg-type]
