"""What rank 0 gathered: the ranks' profiles merged, and whether they resolve energy.

Between the gather and the planner (:mod:`powerlib.runtime.planning_step`): each rank's
:class:`~powerlib.runtime.records.ProfilePayload` is merged per stage (time = max, energy = mean
across the tensor/context-parallel ranks of a stage, docs/architecture.md §2), its measured
P_block, latency and noise are summarised, and :func:`check_resolution` says why a profile
cannot resolve per-instruction energy before anything is planned on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from powerlib.errors import PlanError
from powerlib.planning.perseus.noise import TimeNoise
from powerlib.planning.profile_rows import ProfileRow
from powerlib.runtime.noise_estimate import SpanTime, normalize_times
from powerlib.runtime.profile_blocks import monotone_times
from powerlib.runtime.records import Payload, ProfilePayload
from powerlib.runtime.sweep import aggregate_stage_rows

__all__ = [
    "GATHERED",
    "GIVE_UP_FACTOR",
    "MAX_ENERGY_ERROR",
    "as_profiles",
    "check_resolution",
    "measured_latency_s",
    "latency_samples_for",
    "merge_profiles",
    "time_cv_for",
    "time_noise_for",
    "time_se_for",
]

GIVE_UP_FACTOR = 4.0
"""A row known to worse than this many times the sweep's target (16x the iterations it would
need) cannot be resolved: the sweep gives up on it, and the planner refuses it."""

MAX_ENERGY_ERROR = 0.08
"""The largest relative error (half-width of the 95 % interval the attribution gives each row)
of a profiled instruction energy the planner accepts at the default 2 % target: the sweep gives
up at :data:`GIVE_UP_FACTOR` x its target, and a larger target (``target_error``) raises the
limit alike. The planner's cost model fits each (stage, kind) over all its clocks, which smooths
one row's error."""


GATHERED = "the gathered profile"


def as_profiles(payloads: Sequence[Payload]) -> list[ProfilePayload]:
    """The ranks' profiles (what every rank sent at the end of its sweep).

    Raises:
        PlanError: A rank sent something else (a bug: the ranks' exchanges are out of step).
    """
    profiles = [p for p in payloads if isinstance(p, ProfilePayload)]
    if len(profiles) != len(payloads):
        kinds = sorted({type(p).__name__ for p in payloads if not isinstance(p, ProfilePayload)})
        raise PlanError(f"rank 0 expected every rank's profile, got {', '.join(kinds)}")
    return normalized(profiles)


def normalized(profiles: list[ProfilePayload]) -> list[ProfilePayload]:
    """The profiles with each row's time freed of the iteration's shared factor.

    The sweep's rotating reference (:class:`~powerlib.runtime.sweep.FrequencySweep`) shows each
    iteration's shared factor; :func:`~powerlib.runtime.noise_estimate.normalize_times` divides
    it out of every span, and each row's time becomes the normalized mean (non-increasing in
    the clock, :func:`~powerlib.runtime.profile_blocks.monotone_times`), its energy scaled
    with it (the attributed power stands). Without the spans to do it, the profiles as sent.
    """
    spans: dict[int, list[SpanTime]] = {}
    for p in profiles:
        spans.setdefault(p.stage, []).extend(p.span_times)
    result = normalize_times(spans, time_noise_for(profiles))
    if result is None:
        return profiles
    out = []
    for p in profiles:
        mine = {(k, f): v for (s, k, f), v in result.samples.items() if s == p.stage and v}
        times = monotone_times(mine)
        rows = tuple(
            r
            if (r.instruction, r.freq_mhz) not in times
            else dataclasses.replace(
                r,
                time_s=times[(r.instruction, r.freq_mhz)],
                energy_j=r.energy_j * times[(r.instruction, r.freq_mhz)] / r.time_s,
            )
            for r in p.rows
        )
        out.append(dataclasses.replace(p, rows=rows, time_se=result.time_se or p.time_se))
    return out


def merge_profiles(profiles: Sequence[ProfilePayload]) -> tuple[list[ProfileRow], float | None]:
    """Every rank's rows merged per stage, and P_block from the ranks' attribution.

    P_block is the mean of the ranks' solved blocking power (``p_block_w``); ``None`` when no
    rank resolved one.
    """
    rows = aggregate_stage_rows(list(p.rows) for p in profiles)
    measured = [p.p_block_w for p in profiles if p.p_block_w]
    return rows, (sum(measured) / len(measured) if measured else None)


def measured_latency_s(profiles: Sequence[ProfilePayload]) -> float | None:
    """The slowest rank's measured clock-change latency, when any rank measured one."""
    latencies = [p.latency_s for p in profiles if p.latency_s is not None]
    return max(latencies) if latencies else None


def time_cv_for(profiles: Sequence[ProfilePayload]) -> float:
    """The largest run-to-run spread of instruction times a rank saw (the guard's noise)."""
    spreads = [p.time_cv for p in profiles if p.time_cv is not None]
    return max(spreads) if spreads else 0.0


def time_noise_for(profiles: Sequence[ProfilePayload]) -> TimeNoise | None:
    """The noise's structure: each part's largest estimate over the ranks (``None``: none).

    The iteration and microbatch parts are shared by every stage, so the ranks estimate the
    same thing; the independent part is each stage's own, and the guard plans for the worst.
    """
    got = [p.time_noise for p in profiles if p.time_noise is not None]
    if not got:
        return None
    return TimeNoise(
        iteration_cv=max(n.iteration_cv for n in got),
        microbatch_cv=max(n.microbatch_cv for n in got),
        independent_cv=max(n.independent_cv for n in got),
    )


def latency_samples_for(profiles: Sequence[ProfilePayload]) -> tuple[float, ...]:
    """Every rank's measured clock-change landings, pooled and sorted."""
    return tuple(sorted(x for p in profiles for x in p.latency_samples_s))


def time_se_for(profiles: Sequence[ProfilePayload]) -> float:
    """The largest standard error of a row's mean time a rank's profile has."""
    errors = [p.time_se for p in profiles if p.time_se is not None]
    return max(errors) if errors else 0.0


def _fmt_s(time_s: float) -> str:
    return f"{time_s * 1e3:.3g} ms" if time_s < 1.0 else f"{time_s:.3g} s"


def check_resolution(rows: list[ProfileRow], profiles: Sequence[ProfilePayload]) -> str | None:
    """Why the gathered profile cannot resolve per-instruction energy, or ``None`` if it can.

    A rank that gave up while sweeping says why (``unresolved``: the figure it reached and what
    would resolve it). Otherwise every row carries the half-width of its 95 % interval from the
    attribution (``errors``); a row whose energy is not positive,
    or worse than :data:`MAX_ENERGY_ERROR`, means the counter cannot resolve the instructions.

    Args:
        rows: The merged rows (:func:`merge_profiles`).
        profiles: What the ranks sent.

    Returns:
        One line naming the worst case and what to change, or ``None``.
    """
    if any(p.gave_up for p in profiles):
        why = next((p.unresolved for p in profiles if p.unresolved), "a rank gave up")
        return f"the energy counter cannot resolve per-instruction energy: {why}"
    errors: dict[tuple[int, str, float], float] = {}
    for p in profiles:
        for (kind, freq), error in p.errors.items():
            key = (p.stage, kind, freq)
            errors[key] = max(errors.get(key, 0.0), error)
    targets = [p.target_error for p in profiles if p.target_error]
    limit = max([MAX_ENERGY_ERROR, *(GIVE_UP_FACTOR * t for t in targets)])
    worst: tuple[float, ProfileRow] | None = None
    coarse = 0
    for r in rows:
        error = errors.get((r.stage, r.instruction, r.freq_mhz), 0.0)
        if r.energy_j <= 0:
            error = math.inf
        if error > limit:
            coarse += 1
            if worst is None or error > worst[0]:
                worst = (error, r)
    if worst is None:
        return None
    error, r = worst
    known = f"+-{100 * error:.0f} %" if math.isfinite(error) else "not at all"
    period = [p.counter_period_s for p in profiles if p.counter_period_s]
    counter = f" (its energy counter updates about every {_fmt_s(max(period))})" if period else ""
    return (
        f"the energy counter cannot resolve per-instruction energy{counter}: stage {r.stage} "
        f"{r.instruction} at {r.freq_mhz:g} MHz ({_fmt_s(r.time_s)}) is known {known} "
        f"({coarse} of {len(rows)} profiled rows worse than +-{100 * limit:.0f} %); "
        "profile longer instructions (larger microbatches) or more iterations per clock "
        "(max_iterations_per_freq)"
    )
