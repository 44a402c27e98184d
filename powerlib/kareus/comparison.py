"""Kareus's frontier against its baselines: the paper's metrics (docs/kareus.md §4 "Metrics").

:func:`compare_frontiers` measures the Kareus frontier against Perseus-only (Megatron-LM +
Perseus, "M+P") and, when solved, stock nanobatching + Perseus ("N+P"); what it finds is a
:class:`FrontierComparison`, whose :meth:`~FrontierComparison.to_json` is the ``comparison`` of
``powerlib kareus plan --compare --json``.

Pure: frontiers in, figures out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from powerlib.kareus.compose import sample_frontier
from powerlib.planning.perseus.frontier import Frontier
from powerlib.planning.perseus.points import FrontierPoint

__all__ = [
    "Dominance",
    "FrontierComparison",
    "IsoTime",
    "MaxThroughput",
    "compare_frontiers",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class IsoTime:
    """Kareus at the fastest Perseus-only time (``iso_time``).

    Attributes:
        time_s: The fastest Perseus-only (M+P) time.
        perseus_energy_j: That M+P point's energy.
        kareus_energy_j: The lowest Kareus energy within that time (``None``: no point fits).
        kareus_time_s: That Kareus point's time (``None``: no point fits).
    """

    time_s: float
    perseus_energy_j: float
    kareus_energy_j: float | None
    kareus_time_s: float | None

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class MaxThroughput:
    """One method's fastest plan, replayed on the measurements, against Megatron-LM.

    Attributes:
        time_s: The replayed iteration time.
        energy_j: The replayed iteration energy.
        planned_time_s: The fastest point's planned (quantized) time.
        time_reduction: ``1 − time_s / megatron time``.
        energy_reduction: ``1 − energy_j / megatron energy``.
    """

    time_s: float
    energy_j: float
    planned_time_s: float
    time_reduction: float
    energy_reduction: float

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Dominance:
    """Whether Kareus weakly dominates one baseline at its sampled points.

    Attributes:
        weakly_dominated: At every sample Kareus has a point no slower and no costlier.
        min_margin: The worst relative energy margin (``-inf``: a sample Kareus cannot reach).
        samples: Sampled baseline points.
    """

    weakly_dominated: bool
    min_margin: float
    samples: int

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontierComparison:
    """What :func:`compare_frontiers` found.

    Attributes:
        iso_time_energy_reduction: The lowest Kareus energy with ``T ≤`` the fastest M+P time,
            against that M+P point's energy (``None``: no Kareus point that fast).
        iso_time: The points that figure compares.
        iso_energy_time_reduction: The shortest Kareus time with ``E ≤`` the minimum-energy
            M+P point's energy, against that point's time (``None``: none that cheap).
        megatron_time_s: Megatron-LM's iteration time (sequential, highest clock).
        megatron_energy_j: Its iteration energy.
        max_throughput: Per method (``kareus``, ``perseus``, ``nanobatch`` when solved), its
            fastest plan against Megatron-LM.
        dominance: Per baseline, whether Kareus weakly dominates it.
    """

    iso_time_energy_reduction: float | None
    iso_time: IsoTime
    iso_energy_time_reduction: float | None
    megatron_time_s: float
    megatron_energy_j: float
    max_throughput: dict[str, MaxThroughput]
    dominance: dict[str, Dominance]

    def to_json(self) -> dict[str, object]:
        """The ``comparison`` of ``powerlib kareus plan --compare --json`` (keys as always)."""
        return {
            "iso_time_energy_reduction": self.iso_time_energy_reduction,
            "iso_time": self.iso_time.to_json(),
            "iso_energy_time_reduction": self.iso_energy_time_reduction,
            "megatron": {"time_s": self.megatron_time_s, "energy_j": self.megatron_energy_j},
            "max_throughput": {k: v.to_json() for k, v in self.max_throughput.items()},
            "dominance": {k: v.to_json() for k, v in self.dominance.items()},
        }


def _lowest_energy_within(points: Sequence[FrontierPoint], time_s: float) -> FrontierPoint | None:
    fits = [p for p in points if p.time_s <= time_s + 1e-12]
    return min(fits, key=lambda p: (p.energy_j, p.time_s)) if fits else None


def compare_frontiers(
    kareus: Frontier, perseus: Frontier, nanobatch: Frontier | None = None, *, samples: int = 10
) -> FrontierComparison:
    """The paper's metrics (docs/kareus.md §4 "Metrics") on planner frontiers.

    - ``iso_time_energy_reduction``: the lowest energy Kareus reaches with ``T ≤`` the fastest
      Perseus-only (M+P) time, against that M+P point's energy.
    - ``iso_energy_time_reduction``: the shortest Kareus time with ``E ≤`` the minimum-energy
      M+P point's energy, against that point's time.
    - ``max_throughput``: each method's fastest plan, replayed on the measurements, against
      Megatron-LM (sequential, highest clock, the frontiers' common baseline): time and energy
      reductions.
    - ``dominance``: per baseline, whether at each of its ``samples`` sampled points Kareus has a
      point no slower and no costlier (weak dominance), with the worst margin.
    """
    mp_fast = perseus.fastest
    got = _lowest_energy_within(kareus.points, mp_fast.time_s)
    mp_min = perseus.min_energy
    fits = [p for p in kareus.points if p.energy_j <= mp_min.energy_j + 1e-9]
    fastest = min(fits, key=lambda p: p.time_s) if fits else None
    base = perseus.baseline()
    methods = {"kareus": kareus, "perseus": perseus}
    if nanobatch is not None:
        methods["nanobatch"] = nanobatch
    return FrontierComparison(
        iso_time_energy_reduction=None if got is None else 1.0 - got.energy_j / mp_fast.energy_j,
        iso_time=IsoTime(
            time_s=mp_fast.time_s,
            perseus_energy_j=mp_fast.energy_j,
            kareus_energy_j=None if got is None else got.energy_j,
            kareus_time_s=None if got is None else got.time_s,
        ),
        iso_energy_time_reduction=(
            None if fastest is None else 1.0 - fastest.time_s / mp_min.time_s
        ),
        megatron_time_s=base.time_s,
        megatron_energy_j=base.energy_j,
        max_throughput={
            name: _max_throughput(f, base.time_s, base.energy_j) for name, f in methods.items()
        },
        dominance={
            name: _dominance(kareus, f, samples) for name, f in methods.items() if name != "kareus"
        },
    )


def _max_throughput(frontier: Frontier, base_time_s: float, base_energy_j: float) -> MaxThroughput:
    """``frontier``'s fastest plan replayed on the measurements, against Megatron-LM's figures."""
    # Replayed on the measurements (real, not floor-quantized, durations), so that the
    # comparison with Megatron-LM's critical path is like for like.
    run = frontier.replay(frontier.fastest)
    return MaxThroughput(
        time_s=run.time_s,
        energy_j=run.energy_j,
        planned_time_s=frontier.fastest.time_s,
        time_reduction=1.0 - run.time_s / base_time_s,
        energy_reduction=1.0 - run.energy_j / base_energy_j,
    )


def _dominance(kareus: Frontier, baseline: Frontier, samples: int) -> Dominance:
    """Whether ``kareus`` weakly dominates ``baseline`` at ``samples`` of its points."""
    margins = []
    for p in sample_frontier(baseline.points, samples):
        k = _lowest_energy_within(kareus.points, p.time_s)
        margins.append(-math.inf if k is None else (p.energy_j - k.energy_j) / p.energy_j)
    return Dominance(
        weakly_dominated=all(m >= -1e-9 for m in margins),
        min_margin=min(margins),
        samples=len(margins),
    )
