"""What rank 0 gathered: the ranks' profiles merged, and whether they resolve energy.

Between the gather and the planner (:mod:`powerlib.runtime.planning_step`): each rank's
:class:`~powerlib.runtime.records.ProfilePayload` is merged per stage (time = max, energy = mean
across the tensor/context-parallel ranks of a stage, docs/architecture.md §2), its measured
P_block, latency and noise are summarised, and :func:`check_resolution` says why a profile
cannot resolve per-instruction energy before anything is planned on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from powerlib.errors import PlanError
from powerlib.planning.profile_rows import ProfileRow
from powerlib.runtime.records import Payload, ProfilePayload
from powerlib.runtime.sweep import aggregate_stage_rows

__all__ = [
    "GATHERED",
    "GIVE_UP_FACTOR",
    "MAX_ENERGY_ERROR",
    "as_profiles",
    "check_resolution",
    "measured_latency_s",
    "merge_profiles",
    "time_cv_for",
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
    return profiles


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
