"""Typed records the runtime passes around: a rank's profile, the plan's prediction, what it did.

Each is a frozen dataclass with ``to_json`` (and ``from_json`` where one arrives as JSON data),
so code reads fields, not string paths into nested dicts (issue 32, point 6):

- :class:`ProfilePayload`: what a rank sends rank 0 at the end of its sweep;
- :class:`Prediction`: the planner's figures for the plan it chose (replayed on the profile);
- :class:`Realized`: what the closed loop measured against interleaved all-max windows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from powerlib.planning.profile import ProfileRow

__all__ = ["Prediction", "ProfilePayload", "Realized"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfilePayload:
    """One rank's profile, as its sweep resolved it.

    Attributes:
        stage: The rank's pipeline stage.
        rows: Mean time and attributed energy per (kind, clock).
        errors: Per (kind, clock): relative half-width of the energy's 95 % interval.
        p_block_w: Power between instructions (the attribution's rest), when resolved.
        p_block_error: Its relative 95 % half-width.
        order: ``(chunk, microbatch, kind)`` in the order the loop ran its last iteration.
        idle_power_w: The device's power before the session changed anything.
        latency_s: The clock-change latency measured while warming up (90th percentile).
        blocks: Per visited clock: iterations, the clock really run, temperature, dropped.
        counter_period_s: The energy counter's update period, as observed.
        time_cv: Median run-to-run spread of an instruction's time (the guard's noise).
        time_se: Median relative standard error of a row's mean time.
        target_error: The sweep's target.
        gave_up: The sweep stopped because a row could not resolve.
        unresolved: Why (on the rank that could not resolve).
    """

    stage: int
    rows: tuple[ProfileRow, ...] = ()
    errors: Mapping[tuple[str, float], float] = field(default_factory=dict)
    p_block_w: float | None = None
    p_block_error: float | None = None
    order: tuple[tuple[int, int, str], ...] = ()
    idle_power_w: float | None = None
    latency_s: float | None = None
    blocks: tuple[Mapping[str, Any], ...] = ()
    counter_period_s: float | None = None
    time_cv: float | None = None
    time_se: float | None = None
    target_error: float | None = None
    gave_up: bool = False
    unresolved: str | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON data (rows as ``[stage, kind, freq_mhz, time_s, energy_j]``)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["rows"] = [
            [r.stage, r.instruction, r.freq_mhz, r.time_s, r.energy_j] for r in self.rows
        ]
        data["errors"] = [[k, f, e] for (k, f), e in self.errors.items()]
        data["order"] = [list(o) for o in self.order]
        data["blocks"] = [dict(b) for b in self.blocks]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProfilePayload:
        """The inverse of :meth:`to_json` (missing fields take their defaults)."""
        rows = tuple(
            ProfileRow(stage=int(s), instruction=str(k), freq_mhz=float(f), time_s=float(t),
                       energy_j=float(e))
            for s, k, f, t, e in data.get("rows", ())
        )  # fmt: skip
        return cls(
            stage=int(data.get("stage", 0)),
            rows=rows,
            errors={(str(k), float(f)): float(e) for k, f, e in data.get("errors", ())},
            p_block_w=_opt_float(data.get("p_block_w")),
            p_block_error=_opt_float(data.get("p_block_error")),
            order=tuple((int(c), int(m), str(k)) for c, m, k in data.get("order", ())),
            idle_power_w=_opt_float(data.get("idle_power_w")),
            latency_s=_opt_float(data.get("latency_s")),
            blocks=tuple(dict(b) for b in data.get("blocks", ())),
            counter_period_s=_opt_float(data.get("counter_period_s")),
            time_cv=_opt_float(data.get("time_cv")),
            time_se=_opt_float(data.get("time_se")),
            target_error=_opt_float(data.get("target_error")),
            gave_up=bool(data.get("gave_up", False)),
            unresolved=None if data.get("unresolved") is None else str(data["unresolved"]),
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """The planner's figures for the plan it chose: the plan replayed on the measured profile.

    Attributes:
        saving_percent: Energy saved per iteration against all-max iterations as they run (at
            T_min, or held to the straggler's T′): what the closed loop and a job measure.
        slowdown_percent: Iteration time against all-max.
        switch_latency_s: The clock-change latency the guard planned for.
        switch_latency_source: ``given``, ``measured`` or ``default``.
        time_cv: The run-to-run noise the guard planned for (0: none).
    """

    saving_percent: float | None
    slowdown_percent: float | None
    switch_latency_s: float | None = None
    switch_latency_source: str | None = None
    time_cv: float | None = None

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any] | None) -> Prediction | None:
        """From a planner summary (``summary.json``); ``None`` without one."""
        if not summary:
            return None
        realized = summary.get("realized") or {}
        per_iteration = realized.get("saving_per_iteration_percent")
        return cls(
            saving_percent=_opt_float(
                realized.get("saving_percent") if per_iteration is None else per_iteration
            ),
            slowdown_percent=_opt_float(realized.get("slowdown_percent")),
            switch_latency_s=_opt_float(summary.get("switch_latency_s")),
            switch_latency_source=summary.get("switch_latency_source"),
            time_cv=_opt_float(summary.get("time_cv")),
        )

    def to_json(self) -> dict[str, Any]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Realized:
    """What a plan achieved, measured against interleaved all-max windows.

    Attributes:
        saving_percent: Energy saved per iteration, all devices (measured).
        saving_ci_percent: Half-width of its 95 % interval (points).
        slowdown_percent: Iteration time change (measured; negative is faster).
        slowdown_ci_percent: Half-width of its 95 % interval (points).
        predicted_saving_percent: The planner's prediction (replayed on the profile).
        predicted_slowdown_percent: Likewise.
        rounds: Paired rounds measured.
        verdict: ``kept``, ``shortfall`` (kept, saves less than predicted) or ``reverted``.
        reason: Why, for ``shortfall`` and ``reverted``.
    """

    saving_percent: float
    saving_ci_percent: float
    slowdown_percent: float
    slowdown_ci_percent: float
    predicted_saving_percent: float | None
    predicted_slowdown_percent: float | None
    rounds: int
    verdict: str
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Every field, by name."""
        return dataclasses.asdict(self)

    def line(self) -> str:
        """One line for the log."""
        if self.rounds == 0:  # stopped before a round was paired: nothing was measured
            return f"no paired round measured: {self.verdict}"
        predicted = (
            ""
            if self.predicted_saving_percent is None
            else f" (predicted {self.predicted_saving_percent:.2f} %)"
        )
        return (
            f"measured saving {self.saving_percent:.2f} +- {self.saving_ci_percent:.2f} %"
            f"{predicted}, slowdown {self.slowdown_percent:+.3f} +- "
            f"{self.slowdown_ci_percent:.3f} % over {self.rounds} paired rounds: {self.verdict}"
        )
