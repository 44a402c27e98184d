"""The structure of run-to-run noise, estimated from the profile sweep's instruction spans.

The slowdown guard plans against noise (docs/perseus.md §2.8), and what it costs depends on
what the noise shares (:class:`~powerlib.planning.perseus.noise.TimeNoise`): a factor shared by
a whole iteration moves every path alike, a microbatch's factor adds up along its chain, and only
the independent part makes the slowest of many near-critical paths slower. One rank sees its own
stage's spans, which is enough to tell the three apart (a random-effects decomposition):

- each span's residual ``r = log(duration / mean duration of its (kind, clock))``;
- an iteration's mean residual ``a`` carries the iteration's factor, plus the microbatch and
  independent parts averaged over its spans;
- within an iteration, ``d = r - a``: the forward and the backward of one microbatch share its
  factor, so the mean product of their ``d`` estimates the microbatch variance, and what is left
  of the variance of ``d`` is the independent part;
- the variance of ``a`` between iterations of one clock's block, less what the other two
  contribute to a mean of that many spans, is the iteration's.

Each row's mean is taken over its own block, which absorbs the mean iteration factor of that
block: the between-iteration variance is taken within blocks, with ``n - 1`` degrees of freedom.
That the forward and the backward of a microbatch share its factor is how variable-length data
behaves (a longer sample makes both passes longer; ByteDance's traces, docs/emulator.md, "The
noise model").
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from powerlib.planning.perseus.noise import TimeNoise

__all__ = ["Normalized", "SpanTime", "estimate_time_noise", "normalize_times", "row_time_se"]

SpanTime = tuple[int, int, int, str, float, float]
"""One measured instruction: ``(block, iteration, microbatch, kind, clock, time_s)``.

``block`` and ``iteration`` are the sweep's (the same numbers on every rank); ``clock`` is the
one this rank ran (the block's, or the top clock where this rank was the block's reference)."""

_MIN_ITERATIONS = 4
"""Fewer measured iterations than this: no estimate (``None``)."""


def estimate_time_noise(spans: Sequence[SpanTime]) -> TimeNoise | None:
    """The per-iteration, per-microbatch and independent spread of the spans' times.

    Returns:
        The estimate, or ``None`` with fewer than :data:`_MIN_ITERATIONS` measured iterations
        or no two spans of one (kind, clock).
    """
    durations: dict[tuple[str, float], list[float]] = defaultdict(list)
    for _, _, _, kind, freq, time_s in spans:
        if time_s > 0 and math.isfinite(time_s):
            durations[(kind, freq)].append(time_s)
    means = {key: math.fsum(d) / len(d) for key, d in durations.items() if len(d) >= 2}
    residuals: dict[tuple[int, int], list[tuple[int, str, float]]] = defaultdict(list)
    for block, it, mb, kind, freq, time_s in spans:
        mean = means.get((kind, freq))
        if mean is not None and time_s > 0 and math.isfinite(time_s):
            residuals[(block, it)].append((mb, kind, math.log(time_s / mean)))
    if len(residuals) < _MIN_ITERATIONS:
        return None
    # within iterations: microbatch covariance (forward x backward) and the total variance
    sq, sq_n, cross, cross_n = 0.0, 0, 0.0, 0
    iteration_means: dict[int, list[float]] = defaultdict(list)
    spans_per_iteration: list[int] = []
    microbatches_per_iteration: list[int] = []
    for (block, _), items in residuals.items():
        n = len(items)
        a = math.fsum(r for _, _, r in items) / n
        iteration_means[block].append(a)
        spans_per_iteration.append(n)
        by_mb: dict[int, list[float]] = defaultdict(list)
        for mb, _, r in items:
            by_mb[mb].append(r - a)
        microbatches_per_iteration.append(len(by_mb))
        if n > 1:
            sq += math.fsum((r - a) ** 2 for _, _, r in items)
            sq_n += n
        for ds in by_mb.values():
            for i in range(len(ds)):
                for j in range(i + 1, len(ds)):
                    cross += ds[i] * ds[j]
                    cross_n += 1
    if not sq_n:
        return None
    # with M microbatches and n spans an iteration: E[d²] = σ_mb²(1 - 1/M) + σ_ind²(1 - 1/n),
    # E[d_fwd · d_bwd] = σ_mb²(1 - 1/M) - σ_ind²/n: their difference is σ_ind² exactly
    n_spans = sum(spans_per_iteration) / len(spans_per_iteration)
    n_mbs = sum(microbatches_per_iteration) / len(microbatches_per_iteration)
    var_d = sq / sq_n
    c = cross / cross_n if cross_n else 0.0
    var_ind = max(var_d - c, 0.0) if cross_n else var_d * n_spans / max(n_spans - 1, 1)
    var_mb = max((c + var_ind / n_spans) / (1 - 1 / n_mbs), 0.0) if n_mbs > 1 and cross_n else 0.0
    # between iterations, within each block (the block's rows absorbed its mean)
    between, dof = 0.0, 0
    for means_of_block in iteration_means.values():
        k = len(means_of_block)
        if k > 1:
            m = math.fsum(means_of_block) / k
            between += math.fsum((x - m) ** 2 for x in means_of_block)
            dof += k - 1
    var_it = 0.0
    if dof:
        var_it = max(between / dof - var_mb / n_mbs - var_ind / n_spans, 0.0)
    return TimeNoise(
        iteration_cv=min(math.sqrt(var_it), 0.5),
        microbatch_cv=min(math.sqrt(var_mb), 0.5),
        independent_cv=min(math.sqrt(var_ind), 0.5),
    )


def row_time_se(spans: Sequence[SpanTime], noise: TimeNoise) -> float | None:
    """The median relative standard error of a row's mean time, under ``noise``.

    A row is one (kind, clock), measured over a block's iterations: its spans share their
    iterations' factors (and a microbatch's), so its error is
    ``sqrt(iteration_cv² / iterations + microbatch_cv² / (iterations · microbatches) +
    independent_cv² / spans)``, not the spread over the square root of its spans (which
    assumes every span independent: a one-iteration block then looked 5x more precise than it
    was). ``None`` without spans.
    """
    iterations: dict[tuple[str, float], set[int]] = defaultdict(set)
    microbatches: dict[tuple[str, float], set[int]] = defaultdict(set)
    counts: dict[tuple[str, float], int] = defaultdict(int)
    for block, it, mb, kind, freq, _ in spans:
        iterations[(kind, freq)].add(block * 1_000_000 + it)
        microbatches[(kind, freq)].add(mb)
        counts[(kind, freq)] += 1
    errors = []
    for key, n in counts.items():
        k = len(iterations[key])
        m = max(len(microbatches[key]), 1)
        var = (
            noise.iteration_cv**2 / k
            + noise.microbatch_cv**2 / (k * m)
            + noise.independent_cv**2 / n
        )
        errors.append(math.sqrt(var))
    if not errors:
        return None
    errors.sort()
    return errors[len(errors) // 2]


@dataclass(frozen=True, slots=True)
class Normalized:
    """Every stage's mean instruction times with each iteration's shared factor divided out.

    Attributes:
        samples: ``(stage, kind, clock) -> every span's time_s, the shared factor divided out``.
        time_se: The median relative standard error of their means.
        per_microbatch: Whether the factor was taken per (iteration, microbatch) (variable-length
            data) rather than per iteration.
    """

    samples: dict[tuple[int, str, float], list[float]]
    time_se: float | None
    per_microbatch: bool


def normalize_times(
    spans_by_stage: Mapping[int, Sequence[SpanTime]], noise: TimeNoise | None
) -> Normalized | None:
    """Each row's time free of the factors every stage shares (rank 0, after the sweep).

    In every block after the first, one stage (the sweep's reference,
    :class:`~powerlib.runtime.sweep.FrequencySweep`) ran the top clock while the others ran the
    block's clock. Its times against its own top-clock level (the mean of the first block, where
    every stage ran the top clock) give the iteration's shared factor ``a``: per iteration, or,
    when the microbatch part of ``noise`` outweighs the independent one, per (iteration,
    microbatch). Every other stage's span is divided by ``exp(a)``; the reference's own spans
    of that block only serve as the reference. Without a first block, or a reference, or
    where the shared part of ``noise`` is smaller than the reference's own noise in ``a`` (which
    the division would add to every span), ``None``.
    """
    level: dict[tuple[int, str], list[float]] = defaultdict(list)
    top: dict[int, float] = {}
    for stage, spans in spans_by_stage.items():
        if spans:
            top[stage] = max(f for _, _, _, _, f, _ in spans)
        for block, _, _, kind, _, time_s in spans:
            if block == 0 and time_s > 0:
                level[(stage, kind)].append(math.log(time_s))
    mu = {key: math.fsum(v) / len(v) for key, v in level.items() if v}
    if not mu:
        return None
    per_mb = noise is not None and noise.microbatch_cv > noise.independent_cv
    # who ran the top clock in a block where another stage did not: that block's reference
    at_top: dict[int, set[int]] = defaultdict(set)
    below: dict[int, set[int]] = defaultdict(set)
    for stage, spans in spans_by_stage.items():
        for block, _, _, _, f, _ in spans:
            (at_top if f == top[stage] else below)[block].add(stage)
    refs = {b: stages for b, stages in at_top.items() if b > 0 and below.get(b)}
    shared: dict[tuple[int, int], list[float]] = defaultdict(list)
    for stage, spans in spans_by_stage.items():
        for block, it, mb, kind, _, time_s in spans:
            m = mu.get((stage, kind))
            if stage in refs.get(block, ()) and m is not None and time_s > 0:
                shared[(it, mb if per_mb else -1)].append(math.log(time_s) - m)
    if not shared:
        return None
    # the reference's own noise enters every span it normalizes: worth it only where the
    # shared part is larger than that (not under independent noise alone)
    per_factor = sum(len(v) for v in shared.values()) / len(shared)
    shared_cv = 0.0 if noise is None else (noise.microbatch_cv if per_mb else noise.iteration_cv)
    own_cv = 0.0 if noise is None else noise.independent_cv / math.sqrt(per_factor)
    if noise is not None and shared_cv <= own_cv:
        return None
    factor = {key: math.fsum(v) / len(v) for key, v in shared.items()}
    samples: dict[tuple[int, str, float], list[float]] = defaultdict(list)
    for stage, spans in spans_by_stage.items():
        for block, it, mb, kind, f, time_s in spans:
            if stage in refs.get(block, ()):
                continue  # the reference itself
            a = factor.get((it, mb if per_mb else -1), 0.0) if block > 0 else 0.0
            samples[(stage, kind, f)].append(time_s * math.exp(-a))
    times = {key: math.fsum(v) / len(v) for key, v in samples.items()}
    errors = sorted(
        statistics.stdev(v) / times[key] / math.sqrt(len(v))
        for key, v in samples.items()
        if len(v) >= 3
    )
    return Normalized(
        samples=dict(samples),
        time_se=errors[len(errors) // 2] if errors else None,
        per_microbatch=per_mb,
    )
