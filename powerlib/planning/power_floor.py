"""A GPU power floor (NVIDIA power smoothing) in planning: slack cannot save below it.

Blackwell's power smoothing holds a busy GPU's power at or above a floor set by an
administrator (docs/real-gpu.md §8). An instruction slowed into slack then draws at least
``P_floor`` for its whole time, and so does the GPU while it waits: a profile measured with the
floor on already shows it, one measured without (or before it was set) does not. Before
planning, :func:`floored_profile` raises every row's energy to at least ``P_floor x time`` and
the carried blocking power to ``P_floor``; :func:`floor_effect` compares the chosen plan's
predicted saving with and without the floor, so a session can say in one line when smoothing
cancels (part of) it. Pure planning: the floor comes in as a number
(:func:`floor_from_details` reads it from a device's ``details()`` mapping).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.planning.profile_rows import ProfileRow

__all__ = ["FloorEffect", "floor_effect", "floor_from_details", "floored_profile"]

CANCEL_REPORT_POINTS = 0.05
"""A floor that takes less than this (percentage points) off the saving is not reported."""


def floor_from_details(details: Mapping[str, object]) -> float | None:
    """The power floor a device's ``details()`` reports (W), when power smoothing is on.

    ``None`` where the device has no power smoothing, has it off, or reports no floor.
    """
    smoothing = details.get("power_smoothing")
    if not isinstance(smoothing, Mapping) or not smoothing.get("enabled"):
        return None
    floor_w = smoothing.get("floor_w")
    return float(floor_w) if isinstance(floor_w, int | float) and floor_w > 0 else None


def floored_profile(profile: Profile, floor_w: float) -> Profile:
    """``profile`` with every row's energy at least ``floor_w x time``, P_block at least the floor.

    The same profile when ``floor_w`` is not positive or changes nothing.
    """
    if floor_w <= 0:
        return profile
    rows = tuple(
        r
        if r.energy_j >= floor_w * r.time_s
        else dataclasses.replace(r, energy_j=floor_w * r.time_s)
        for r in profile.rows
    )
    p_block_w = profile.p_block_w
    raised_block = p_block_w is not None and p_block_w < floor_w
    if rows == profile.rows and not raised_block:
        return profile
    return Profile(
        rows,
        source=profile.source,
        p_block_w=floor_w if raised_block else p_block_w,
        unit_time_s=profile.unit_time_s,
    )


@dataclass(frozen=True, slots=True)
class FloorEffect:
    """The chosen plan's predicted saving with the floor and without it (percent).

    Attributes:
        floor_w: The floor planned with (W).
        saving_percent: The predicted saving with the floor (what the plan's summary says).
        without_floor_percent: The same plan's saving had the GPUs no floor.
    """

    floor_w: float
    saving_percent: float
    without_floor_percent: float

    @property
    def cancelled_points(self) -> float:
        """Percentage points of saving the floor takes away (0 when it takes none)."""
        return max(self.without_floor_percent - self.saving_percent, 0.0)

    def line(self) -> str | None:
        """One line when the floor cancels (part of) the saving, else ``None``."""
        if self.cancelled_points < CANCEL_REPORT_POINTS:
            return None
        what = "all" if self.saving_percent <= 0 else f"{self.cancelled_points:.2f} points"
        return (
            f"power smoothing's {self.floor_w:g} W floor cancels {what} of the "
            f"{self.without_floor_percent:.2f} % this plan would save without it "
            f"({self.saving_percent:.2f} % left): slack cannot save below the floor"
        )


def _extra_j(
    rows: Mapping[tuple[int, str, float], ProfileRow], key: tuple[int, str, float], floor_w: float
) -> tuple[float, float]:
    """``(time_s, energy the floor adds)`` of one instruction run at a profiled clock."""
    row = rows.get(key)
    if row is None:
        return 0.0, 0.0
    return row.time_s, max(floor_w * row.time_s - row.energy_j, 0.0)


def floor_effect(
    plan: FrequencyPlan,
    raw: Profile,
    floor_w: float,
    *,
    raw_p_block_w: float,
    iteration: tuple[float, float, float, float],
) -> FloorEffect | None:
    """The plan's saving with and without the floor; ``None`` when it cannot be told.

    The floored figures are the summary's ``per_iteration`` (``iteration``: plan time and
    energy, baseline time and energy, planned on the floored profile). The floor's share is
    taken back out per stage: each instruction's energy below ``floor x time`` (the plan's
    clock, and the baseline's highest one), and the blocking power raised from
    ``raw_p_block_w`` to the floor over each stage's idle time.

    Args:
        plan: The chosen plan.
        raw: The profile as measured (no floor).
        floor_w: The floor planned with (W).
        raw_p_block_w: The blocking power before the floor was applied (W).
        iteration: ``(time_s, energy_j, baseline_time_s, baseline_energy_j)`` with the floor.
    """
    time_s, energy_j, base_time_s, base_energy_j = iteration
    rows = {(r.stage, r.instruction, r.freq_mhz): r for r in raw.rows}
    block_w = max(floor_w - raw_p_block_w, 0.0)
    extra_plan = extra_base = 0.0
    for stage in range(plan.num_stages):
        busy_plan = busy_base = 0.0
        for planned in plan.stage(stage):
            kind = planned.instruction.kind
            t, extra = _extra_j(rows, (stage, kind, planned.freq_mhz), floor_w)
            busy_plan, extra_plan = busy_plan + t, extra_plan + extra
            top = (stage, kind, raw.max_freq_mhz(stage, kind))
            t, extra = _extra_j(rows, top, floor_w)
            busy_base, extra_base = busy_base + t, extra_base + extra
        extra_plan += block_w * max(time_s - busy_plan, 0.0)
        extra_base += block_w * max(base_time_s - busy_base, 0.0)
    raw_energy_j, raw_base_j = energy_j - extra_plan, base_energy_j - extra_base
    if base_energy_j <= 0 or raw_base_j <= 0:
        return None
    return FloorEffect(
        floor_w=floor_w,
        saving_percent=100.0 * (1.0 - energy_j / base_energy_j),
        without_floor_percent=100.0 * (1.0 - raw_energy_j / raw_base_j),
    )
