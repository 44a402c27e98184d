"""The sweep's estimate of the noise's structure (issue 45, docs/perseus.md §2.8)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from powerlib.planning.perseus.noise import TimeNoise
from powerlib.runtime.noise_estimate import (
    SpanTime,
    estimate_time_noise,
    normalize_times,
    row_time_se,
)
from powerlib.runtime.sweep import FrequencySweep, SweepConfig


def _spans(
    noise: TimeNoise, *, blocks: int, per_block: int, microbatches: int = 12, seed: int = 0
) -> list[SpanTime]:
    """Spans of one stage drawn from ``noise``: a clock per block, forward and backward."""
    rng = random.Random(seed)
    out: list[SpanTime] = []
    for b in range(blocks):
        freq = 1410.0 - 15 * b
        for it in range(per_block):
            a = rng.gauss(0.0, noise.iteration_cv)
            for mb in range(microbatches):
                m = rng.gauss(0.0, noise.microbatch_cv)
                for kind, base in (("forward", 0.05), ("backward", 0.1)):
                    e = rng.gauss(0.0, noise.independent_cv)
                    out.append((b, it, mb, kind, freq, base * (1 + b / 100) * math.exp(a + m + e)))
    return out


@pytest.mark.parametrize(
    "truth",
    [
        TimeNoise(iteration_cv=0.01, microbatch_cv=0.0, independent_cv=0.004),  # fixed-length
        TimeNoise(iteration_cv=0.01, microbatch_cv=0.017, independent_cv=0.0035),  # variable
        TimeNoise.iid(0.02),
    ],
)
def test_the_three_parts_are_told_apart(truth: TimeNoise) -> None:
    got = estimate_time_noise(_spans(truth, blocks=10, per_block=8))
    assert got is not None
    assert got.iteration_cv == pytest.approx(truth.iteration_cv, abs=0.004)
    assert got.microbatch_cv == pytest.approx(truth.microbatch_cv, abs=0.004)
    assert got.independent_cv == pytest.approx(truth.independent_cv, rel=0.15)


def test_one_long_block_is_enough_for_the_iteration_part() -> None:
    """The sweep's reference block (8 iterations) and one-iteration blocks after it."""
    truth = TimeNoise(iteration_cv=0.01, independent_cv=0.004)
    spans = _spans(truth, blocks=1, per_block=8) + [
        (b + 1, 0, mb, kind, f, t)
        for (b, _, mb, kind, f, t) in _spans(truth, blocks=20, per_block=1, seed=1)
    ]
    got = estimate_time_noise(spans)
    assert got is not None and 0.004 < got.iteration_cv < 0.02


def test_too_few_iterations_give_no_estimate() -> None:
    assert estimate_time_noise(_spans(TimeNoise.iid(0.02), blocks=1, per_block=3)) is None
    assert estimate_time_noise([]) is None


def test_a_row_of_one_iteration_is_known_to_the_iteration_factor_not_the_span_spread() -> None:
    truth = TimeNoise(iteration_cv=0.01, independent_cv=0.004)
    one = row_time_se(_spans(truth, blocks=4, per_block=1), truth)
    many = row_time_se(_spans(truth, blocks=4, per_block=16), truth)
    assert one == pytest.approx(math.sqrt(0.01**2 + 0.004**2 / 12))
    assert many == pytest.approx(one / 4, rel=0.01)
    assert row_time_se([], truth) is None


def test_the_reference_block_measures_its_iterations_first() -> None:
    config = SweepConfig(
        freqs_mhz=(1410.0, 1200.0, 1000.0), warmup_iterations=0, reference_iterations=5
    )
    sweep = FrequencySweep(config)
    votes = [sweep.iteration_ended() for _ in range(5)]
    assert votes == [False] * 4 + [True]
    assert sweep.must_end_block()
    sweep.end_block()
    assert sweep.freq_mhz != 1410.0 and sweep.iteration_ended()  # one iteration is enough now
    assert config.max_iterations == 3 * 4 + 1
    with pytest.raises(Exception, match="reference_iterations"):
        SweepConfig(reference_iterations=0)


def _sweep_spans(
    shared_cv: float, independent_cv: float, *, stages: int = 3, blocks: int = 7, seed: int = 0
) -> tuple[dict[int, list[SpanTime]], dict[tuple[int, str, float], float]]:
    """A sweep with a rotating reference: block 0 at the top clock, then one clock per block
    with stage ``(b - 1) % stages`` at the top clock. Returns the spans and the true times."""
    rng = random.Random(seed)
    top = 1410.0
    truth: dict[tuple[int, str, float], float] = {}
    spans: dict[int, list[SpanTime]] = {s: [] for s in range(stages)}
    it = 0
    for b in range(blocks):
        clock = top if b == 0 else top - 50 * b
        for _ in range(8 if b == 0 else 1):
            a = rng.gauss(0.0, shared_cv)  # the iteration's shared factor (and slow drift)
            for s in range(stages):
                f = top if b == 0 or (b - 1) % stages == s else clock
                for kind, base in (("forward", 0.05), ("backward", 0.1)):
                    t = base * (1 + 0.1 * s) * (top / f) ** 0.8
                    truth[(s, kind, f)] = t
                    for mb in range(6):
                        noisy = t * math.exp(a + rng.gauss(0.0, independent_cv))
                        spans[s].append((b, it, mb, kind, f, noisy))
            it += 1
    return spans, truth


def test_the_rotating_reference_divides_the_shared_factor_out_of_every_row() -> None:
    spans, truth = _sweep_spans(shared_cv=0.01, independent_cv=0.002)
    noise = TimeNoise(iteration_cv=0.01, independent_cv=0.002)
    got = normalize_times(spans, noise)
    assert got is not None and not got.per_microbatch
    raw_err, norm_err = [], []
    for key, samples in got.samples.items():
        stage, kind, f = key
        raw = [t for (_, _, _, k, ff, t) in spans[stage] if k == kind and ff == f]
        raw_err.append(abs(statistics.fmean(raw) / truth[key] - 1))
        norm_err.append(abs(statistics.fmean(samples) / truth[key] - 1))
    # one iteration per clock: raw rows carry that iteration's 1 % factor; normalized, the
    # reference's own noise (0.2 % / sqrt(12 spans)) and block 0's mean level remain
    assert max(raw_err) > 0.008
    level = statistics.fmean(norm_err)
    assert max(abs(e - level) for e in norm_err) < 0.0025
    assert got.time_se is not None and got.time_se < 0.002


def test_independent_noise_alone_is_not_divided_by_a_noisier_reference() -> None:
    spans, _ = _sweep_spans(shared_cv=0.0, independent_cv=0.02)
    assert normalize_times(spans, TimeNoise.iid(0.02)) is None
    assert normalize_times({s: [x for x in v if x[0] == 0] for s, v in spans.items()}, None) is None
