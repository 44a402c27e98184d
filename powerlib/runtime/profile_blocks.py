"""What the profile sweep measured, clock by clock, and the energy attributed to it.

:class:`~powerlib.runtime.profile_phase.ProfilePhase` runs the sweep (hooks, votes, the clock
walk); this module holds what it records and how that becomes profile rows. A :class:`Block` is
one clock's measured iterations: when the clock was requested and seen to land, each iteration's
window, and the instruction spans the hooks stamped in it (:class:`Blocks`). Energy comes from
counter intervals the way :mod:`powerlib.measurement` attributes windows: the sampler's reads
locate every counter update in time (:mod:`powerlib.measurement.timeline`), and
:func:`~powerlib.measurement.attribution.solve_powers` solves each (kind, clock)'s power and the
blocking power from which spans and gaps each counter interval covered, each with its interval
(issue 32; docs/measurement.md). A block whose device ran below its clock (throttled) is dropped;
each row's time is its spans' mean, made non-increasing in the clock (:func:`monotone_times`).
A device that samples power part-time solves with its declared duty, and the whole-sweep solve
removes a thermal drift (docs/measurement.md §2.1).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from powerlib.measurement.attribution import REST, Spans, solve_drifting_powers, solve_powers
from powerlib.measurement.sampler import DeviceSampler
from powerlib.planning.profile_rows import ProfileRow
from powerlib.runtime.records import BlockSummary

__all__ = ["Block", "Blocks", "SolvedRows", "clock_step", "monotone_times"]

MIN_DRIFT_SPAN_C = 1.0
"""A sweep whose temperature reads moved less than this is solved without a drift term."""

Span = tuple[str, list[float], list[float]]
"""One instruction: its kind and the stamp cells of its start and end."""

Powers = dict[Any, tuple[float, float]]
"""``{(kind, freq) or REST: (power_w, relative error)}``."""


@dataclass(slots=True)
class Block:
    """One clock's measured iterations."""

    freq_mhz: float
    requested_s: float
    landed_s: float | None = None
    windows: list[tuple[list[float], list[float]]] | None = None
    """Each measured iteration's (start, end) cells; measured from the landing on."""
    iterations: int = 0
    ran_mhz: float | None = None
    temperature_c: float | None = None
    dropped: str | None = None
    energy_j: float | None = None
    """Instruction energy per iteration, once the block ended."""

    def summary(self) -> BlockSummary:
        """The block's summary (the profile payload's ``blocks``)."""
        return BlockSummary(
            freq_mhz=self.freq_mhz,
            iterations=self.iterations,
            ran_mhz=self.ran_mhz,
            temperature_c=self.temperature_c,
            dropped=self.dropped,
        )


@dataclass(frozen=True, slots=True)
class SolvedRows:
    """The whole sweep solved at once.

    Attributes:
        rows: One row per (kind, clock) that resolved.
        errors: Each row's relative 95 % half-width of its power.
        p_block_w: The blocking power between instructions, when it resolved: positive, with
            its 95 % interval clear of 0 W (``None`` otherwise).
        p_block_error: Its relative half-width.
        time_cv: The median run-to-run spread of an instruction's time (the guard's margin).
        time_se: The median relative standard error of a row's mean time.
    """

    rows: list[ProfileRow]
    errors: dict[tuple[str, float], float]
    p_block_w: float | None
    p_block_error: float | None
    time_cv: float | None
    time_se: float | None


class Blocks:
    """The sweep's blocks and the instruction spans of each, and their attribution.

    Args:
        sampler: The session's reads of the device (counter updates, clock, temperature).

    Attributes:
        blocks: One per clock block, in the order the sweep ran them.
        spans: Per block, its instructions' spans.
    """

    def __init__(self, sampler: DeviceSampler) -> None:
        self.sampler = sampler
        self.blocks: list[Block] = []
        self.spans: list[list[Span]] = []
        self.drift_per_c: tuple[float, float] | None = None
        """The whole-sweep solve's thermal drift: (relative power change per degree, its
        standard error); ``None`` when it was not fitted."""

    def start(self, freq_mhz: float, requested_s: float) -> None:
        """A new block at ``freq_mhz``, requested at ``requested_s``."""
        self.blocks.append(Block(freq_mhz, requested_s, windows=[]))
        self.spans.append([])

    def _land(self, block: Block, latency_s: float | None) -> None:
        """When the block's clock landed, from the sampler's reads (``None``: not yet)."""
        if block.landed_s is None:
            if not self.sampler.reports_clock:  # no clock to watch: wait out a late landing
                block.landed_s = block.requested_s + max(latency_s or 0.0, 0.1)
                return
            seen = self.sampler.first_clock_at(block.freq_mhz, block.requested_s)
            if seen is not None:
                block.landed_s = seen[1]

    def windows(self, block: Block, latency_s: float | None) -> list[tuple[float, float]]:
        """The block's measured windows in seconds: resolved, and after its clock landed."""
        self._land(block, latency_s)
        if block.landed_s is None:
            return []
        out = []
        for start, end in block.windows or ():
            a, b = max(start[0], block.landed_s), end[0]
            if math.isfinite(a) and math.isfinite(b) and b > a:
                out.append((a, b))
        return out

    def error(self, index: int, powers: Powers) -> float:
        """Worst relative 95 % half-width of block ``index``'s rows."""
        freq = self.blocks[index].freq_mhz
        kinds = {kind for kind, _, _ in self.spans[index]}
        errors = [powers[(k, freq)][1] for k in kinds if (k, freq) in powers]
        if not errors or len(errors) < len(kinds):
            return math.inf
        return max(errors)

    def iteration_energy(self, index: int, powers: Powers) -> float | None:
        """Instruction energy per iteration of block ``index`` (power x time of its spans)."""
        b = self.blocks[index]
        if not b.iterations:
            return None
        total = 0.0
        for kind, t0, t1 in self.spans[index]:
            if (kind, b.freq_mhz) not in powers or not math.isfinite(t1[0] - t0[0]):
                return None
            total += powers[(kind, b.freq_mhz)][0] * (t1[0] - t0[0])
        return total / b.iterations

    def solve(
        self, indices: list[int], *, recent: bool, latency_s: float | None, drift: bool = False
    ) -> Powers:
        """``{(kind, freq) or REST: (power_w, relative error)}`` over ``indices``' windows.

        ``recent``: a quick solve from the blocks' own reads (the per-iteration vote); else
        from the whole sweep's reads. ``drift``: remove the thermal drift across the blocks
        (:meth:`_temperature_covariate`): every power as at the sweep's last temperature.
        """
        spans = Spans()
        start = math.inf
        for index in indices:
            for w0, w1 in self.windows(self.blocks[index], latency_s):
                spans.add_window(w0, w1)
                start = min(start, w0)
        if not spans.windows:
            return {}
        for index in indices:
            freq = self.blocks[index].freq_mhz
            for kind, t0, t1 in self.spans[index]:
                if math.isfinite(t0[0]) and math.isfinite(t1[0]):
                    spans.add((kind, freq), t0[0], t1[0])
        # Knots from the periodic fit only: the power-shaped placement needs power readings
        # that follow the workload, which NVML's (averaged) readings do not.
        timeline = self.sampler.timeline(since_s=start - 0.5 if recent else -math.inf, refine=False)
        knots, energy = timeline.knot_times_s, timeline.knot_energy_j
        covariate = self._temperature_covariate(start) if drift else None
        if covariate is not None:
            drifting = solve_drifting_powers(
                knots, energy, spans, covariate, duty=self.sampler.duty
            )
            if drifting is not None:
                self.drift_per_c = (drifting.drift_per_unit, drifting.drift_stderr)
                return {label: (p.power_w, p.rel_error) for label, p in drifting.powers.items()}
        powers, _ = solve_powers(knots, energy, spans, duty=self.sampler.duty)
        return {label: (p.power_w, p.rel_error) for label, p in powers.items()}

    def _temperature_covariate(self, start_s: float) -> Callable[[np.ndarray], np.ndarray] | None:
        """The drift's covariate: the temperature read at a time minus the sweep's last one.

        A GPU that warms while the sweep runs draws more power for the same work; the sweep
        visits its clocks at different times (the coarse and fill passes), so the profile
        would tilt with the drift (issue 45: the predicted saving read 0.2-0.7 pt low). The
        attribution fits one relative power change per degree for every label
        (:func:`~powerlib.measurement.attribution.solve_drifting_powers`; the blocking power,
        measured in every block, pins it) and reports each power at the last temperature, the
        one the plan starts at. ``None`` (no correction) when the device reports no
        temperature or it moved less than :data:`MIN_DRIFT_SPAN_C` over the sweep.
        """
        times, temps = self.sampler.temperature_reads()
        inside = times >= start_s - 0.5
        times, temps = times[inside], temps[inside]
        if times.size < 2 or float(np.ptp(temps)) < MIN_DRIFT_SPAN_C:
            return None
        reference = float(np.median(temps[times >= times[-1] - 1.0]))

        def covariate(at_s: np.ndarray) -> np.ndarray:
            x: np.ndarray = np.interp(at_s, times, temps - reference, left=np.nan, right=np.nan)
            return x

        return covariate

    def counter_period_s(self, now_s: float) -> float | None:
        """The energy counter's update period over the last 5 s of reads, or ``None``."""
        tau = self.sampler.timeline(since_s=now_s - 5.0, refine=False).knot_times_s
        if tau.size < 3:
            return None
        return float(statistics.median(tau[1:] - tau[:-1]))

    def solve_rows(
        self,
        stage: int,
        freqs_desc: Sequence[float],
        latency_s: float | None,
        *,
        num_blocks: int | None = None,
    ) -> SolvedRows:
        """The whole sweep solved at once: every row, its error, and the blocking power.

        ``num_blocks``: solve only the first this many blocks (those whose clock ended, when a
        run stops mid-sweep); default every block.
        """
        kept = []
        step = clock_step(freqs_desc)
        windows: dict[int, list[tuple[float, float]]] = {}
        for index, b in enumerate(self.blocks[:num_blocks]):
            windows[index] = self.windows(b, latency_s)
            if not windows[index]:
                b.dropped = b.dropped or "the clock never landed"
                continue
            reading = self.sampler.reading(windows[index][0][0], windows[index][-1][1])
            b.ran_mhz, b.temperature_c = reading.freq_mhz, reading.temperature_c
            if reading.freq_mhz is not None and reading.freq_mhz < b.freq_mhz - 0.5 * step:
                b.dropped = f"throttled: ran {reading.freq_mhz:g} MHz"
                continue
            kept.append(index)
        powers = self.solve(kept, recent=False, latency_s=latency_s, drift=True)
        rows = []
        spreads: list[float] = []
        standard_errors: list[float] = []
        errors: dict[tuple[str, float], float] = {}
        times: dict[tuple[str, float], list[float]] = {}
        for bi in kept:
            freq = self.blocks[bi].freq_mhz
            for kind, c0, c1 in self.spans[bi]:
                t0, t1 = c0[0], c1[0]
                if math.isfinite(t1 - t0) and any(w0 <= t0 and t1 <= w1 for w0, w1 in windows[bi]):
                    times.setdefault((kind, freq), []).append(t1 - t0)
        monotone = monotone_times({key: d for key, d in times.items() if key in powers})
        for (kind, freq), durations in sorted(times.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
            if (kind, freq) not in powers:
                continue
            power, error = powers[(kind, freq)]
            time_s = monotone[(kind, freq)]
            if len(durations) >= 3:
                spread = statistics.stdev(durations) / time_s
                spreads.append(spread)
                standard_errors.append(spread / math.sqrt(len(durations)))
            rows.append(
                ProfileRow(
                    stage=stage,
                    instruction=kind,
                    freq_mhz=freq,
                    time_s=time_s,
                    energy_j=power * time_s,
                )
            )
            errors[(kind, freq)] = error
        rest = powers.get(REST)
        if rest is not None and not (rest[0] > 0 and rest[1] < 1):
            # a blocking power at or below 0 W, or whose 95 % interval reaches 0 W: the gaps
            # between instructions were too short to tell it (the planner falls back to the
            # devices' idle power and says so; a CI run planned with -65 W and failed)
            rest = None
        return SolvedRows(
            rows=rows,
            errors=errors,
            p_block_w=None if rest is None else rest[0],
            p_block_error=None if rest is None else rest[1],
            # the run-to-run spread of an instruction's time: the guard's noise margin
            time_cv=statistics.median(spreads) if spreads else None,
            time_se=statistics.median(standard_errors) if standard_errors else None,
        )


def monotone_times(
    times: dict[tuple[str, float], list[float]],
) -> dict[tuple[str, float], float]:
    """Each (kind, clock)'s mean time, made non-increasing in the clock (weighted isotonic fit).

    A higher clock never makes an instruction slower, but with run-to-run noise its mean can
    measure slower than a neighbour's; the planner would then lower a clock for a "saving" that
    only the noise promised (the guard compares against all-max, which runs the top clock). The
    pool-adjacent-violators fit averages such neighbours, weighted by their samples: it leaves a
    monotone profile alone and pools the noise where the clocks are too close to tell apart.
    """
    out: dict[tuple[str, float], float] = {}
    for kind in {k for k, _ in times}:
        # from the top clock down, times must not decrease
        keys = sorted((key for key in times if key[0] == kind), key=lambda key: -key[1])
        blocks: list[list[float]] = []  # [weighted sum, weight, count of keys]
        for key in keys:
            d = times[key]
            blocks.append([math.fsum(d), float(len(d)), 1.0])
            while len(blocks) > 1 and (
                blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]
            ):
                total, weight, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += weight
                blocks[-1][2] += count
        i = 0
        for total, weight, count in blocks:
            for _ in range(int(count)):
                out[keys[i]] = total / weight
                i += 1
    return out


def clock_step(freqs_desc: Sequence[float]) -> float:
    """The smallest step between neighbouring candidate clocks (1 MHz with fewer than two)."""
    if len(freqs_desc) < 2:
        return 1.0
    return min(a - b for a, b in zip(freqs_desc, freqs_desc[1:]))
