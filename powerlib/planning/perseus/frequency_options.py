"""Profiled frequency options: from measured points to the Pareto-optimal, quantized options.

Perseus plans on *effective* energy ``ẽ = e - P_block·q·τ``. :func:`prepare_options` turns one
(stage, instruction) pair's measured ``(frequency, time, energy)`` points into the
Pareto-optimal, floor-quantized, de-duplicated options, sorted fastest first (the first step of
:mod:`~powerlib.planning.perseus.cost_model`); after solving, :func:`frequency_for` maps a
planned duration back to one of them: the slowest whose quantized time still fits.

The filter can run on raw or effective energy (``order``); the two shipped Perseus pipelines
disagree and the results differ (reference §2.1 step 4, §6 pitfall 4). The default,
``"filter-then-subtract"``, is the SOSP'24 artifact's and the one that reproduces the paper's data.

Pure code: standard library only, no device I/O.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from powerlib.errors import PlanError

__all__ = [
    "DEFAULT_NOISE_FACTOR",
    "ORDERS",
    "PRUNINGS",
    "Option",
    "check_finite",
    "frequency_for",
    "prepare_options",
]

PRUNINGS: tuple[str, str] = ("weak", "artifact")
"""How options are pruned: ``weak`` dominance and the cheapest per time bucket (the default,
issue 45), or the SOSP'24 ``artifact``'s strict dominance and most expensive per bucket (to
reproduce its published frontiers exactly)."""

ORDERS: tuple[str, str] = ("filter-then-subtract", "subtract-then-filter")
"""Orders of the Pareto filter and the effective-energy conversion; the first is the default."""

DEFAULT_NOISE_FACTOR = 0.95
"""η of the soft Pareto filter used when the strict one leaves three or fewer options."""

_SOFT_FILTER_THRESHOLD = 3
"""The soft filter is applied when the strict filter leaves this many options or fewer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One surviving execution option of a (stage, instruction) pair.

    Attributes:
        freq_mhz: The SM clock the option was measured at, in MHz.
        time_s: Measured mean time per execution, in seconds.
        energy_j: Measured mean energy per execution, in joules.
        quant: ``time_s`` floor-quantized to the time quantum: ``int(time_s // unit_time_s)``
            with IEEE float floor division (so 0.030 s at τ = 1 ms is 29, as in lowtime).
        eff_energy_j: Effective energy, ``energy_j - p_block_w * quant * unit_time_s``.
        knob: What else besides the clock the option sets, or ``None`` for a pure frequency
            option; Kareus options carry their execution mode and partition configurations
            (an object with ``to_plan() -> dict`` of plan fields).
    """

    freq_mhz: float
    time_s: float
    energy_j: float
    quant: int
    eff_energy_j: float
    knob: Any = field(default=None, compare=False)


def check_finite(name: str, value: float) -> float:
    """``value`` as a finite float.

    Raises:
        PlanError: Naming ``name``, when ``value`` is not a finite number.
    """
    try:
        out = float(value)
    except (TypeError, ValueError) as err:
        raise PlanError(f"{name} must be a number, got {value!r}") from err
    if not math.isfinite(out):
        raise PlanError(f"{name} must be finite, got {value!r}")
    return out


def _pareto_keep(
    times: Sequence[float], costs: Sequence[float], eta: float, *, weak: bool = True
) -> list[int]:
    """Indices of the points no other point beats by the factor ``eta`` (weak dominance).

    With ``eta = 1`` point ``i`` is dropped if some ``j`` is no slower and no costlier and
    better in one of the two (``times[j] <= times[i]``, ``costs[j] <= costs[i]``, not both
    equal): a clock that takes the same time for less energy (a memory-bound instruction) wins
    over the faster-clocked one (issue 45). Of exact duplicates the first is kept. With
    ``eta < 1`` (the soft filter), or without ``weak`` (the artifact's strict filter), ``i`` is
    dropped if some ``j`` has ``times[j] < eta*times[i]`` and ``costs[j] < eta*costs[i]``.
    """
    keep = []
    for i, (t, e) in enumerate(zip(times, costs)):
        if eta < 1.0 or not weak:
            t_lim, e_lim = eta * t, eta * e
            beaten = any(tj < t_lim and ej < e_lim for tj, ej in zip(times, costs))
        else:
            beaten = any(
                tj <= t and ej <= e and (tj < t or ej < e or j < i)
                for j, (tj, ej) in enumerate(zip(times, costs))
                if j != i
            )
        if not beaten:
            keep.append(i)
    return keep


class _Measured(NamedTuple):
    """One pair's measured points, column by column, checked."""

    freqs: list[float]
    times: list[float]
    energies: list[float]
    knobs: list[Any]


def _checked_parameters(
    unit_time_s: float, p_block_w: float, order: str, noise_factor: float
) -> tuple[float, float, float]:
    """``(τ, P_block, η)`` as floats, checked.

    Raises:
        PlanError: A non-finite or out-of-range value, or an unknown order.
    """
    tau = check_finite("unit_time_s", unit_time_s)
    if tau <= 0.0:
        raise PlanError(f"unit_time_s must be positive, got {unit_time_s!r}")
    p_block = check_finite("p_block_w", p_block_w)
    if p_block < 0.0:
        raise PlanError(f"p_block_w must be non-negative, got {p_block_w!r}")
    if order not in ORDERS:
        raise PlanError(f"order must be one of {ORDERS}, got {order!r}")
    eta = check_finite("noise_factor", noise_factor)
    if not 0.0 < eta <= 1.0:
        raise PlanError(f"noise_factor must be in (0, 1], got {noise_factor!r}")
    return tau, p_block, eta


def _measured(points: Sequence[tuple[Any, ...]]) -> _Measured:
    """The points as checked columns.

    Raises:
        PlanError: A malformed point, a repeated frequency without knobs, or fewer than two
            points.
    """
    out = _Measured([], [], [], [])
    for k, point in enumerate(points):
        knob: list[Any]
        try:
            f_raw, t_raw, e_raw, *knob = point
            if len(knob) > 1:
                raise ValueError("too many fields")
        except (TypeError, ValueError) as err:
            raise PlanError(
                f"point {k} must be a (freq_mhz, time_s, energy_j) triple, got {point!r}"
            ) from err
        out.knobs.append(knob[0] if knob else None)
        f = check_finite(f"point {k} frequency", f_raw)
        t = check_finite(f"point {k} time", t_raw)
        e = check_finite(f"point {k} energy", e_raw)
        if f <= 0.0 or t <= 0.0:
            raise PlanError(f"point {k} needs a positive frequency and time, got {point!r}")
        out.freqs.append(f)
        out.times.append(t)
        out.energies.append(e)
    with_knobs = any(knob is not None for knob in out.knobs)
    if not with_knobs and len(set(out.freqs)) != len(out.freqs):
        raise PlanError("points must have distinct frequencies (one row per frequency)")
    if len(out.freqs) < 2:
        raise PlanError(f"need at least two measured options, got {len(out.freqs)}")
    return out


def _pareto_options(
    measured: _Measured, tau: float, p_block: float, eta: float, order: str, pruning: str
) -> list[Option]:
    """Steps 1-5 of :func:`prepare_options`: the filtered, de-duplicated options, fastest first."""
    freqs, times, energies, knobs = measured
    quants = [int(t // tau) for t in times]
    effs = [e - p_block * q * tau for e, q in zip(energies, quants)]
    filter_costs = energies if order == "filter-then-subtract" else effs
    weak = pruning == "weak"

    def rank(i: int, fastest: int) -> tuple[float, float]:
        """Lower is kept (the artifact: the most expensive per bucket; ``weak``: the cheapest).

        Under ``weak`` the fastest bucket keeps its fastest point: all-max must stay
        reachable, it is the guard's last resort.
        """
        if not weak:
            return (-energies[i], 0.0)
        return (times[i], energies[i]) if quants[i] == fastest else (energies[i], times[i])

    def survivors(factor: float) -> dict[int, int]:
        kept = _pareto_keep(times, filter_costs, factor, weak=weak)
        fastest = min(quants[i] for i in kept)
        best: dict[int, int] = {}  # quant -> index of the survivor kept
        for i in kept:
            j = best.get(quants[i])
            if j is None or rank(i, fastest) < rank(j, fastest):
                best[quants[i]] = i
        return best

    best = survivors(1.0)
    if len(best) <= _SOFT_FILTER_THRESHOLD:
        best = survivors(eta)
    return [
        Option(
            freq_mhz=freqs[i],
            time_s=times[i],
            energy_j=energies[i],
            quant=quants[i],
            eff_energy_j=effs[i],
            knob=knobs[i],
        )
        for _, i in sorted(best.items())
    ]


def prepare_options(
    points: Sequence[tuple[float, float, float]],
    *,
    unit_time_s: float,
    p_block_w: float,
    order: str = "filter-then-subtract",
    noise_factor: float = DEFAULT_NOISE_FACTOR,
    pruning: str = "weak",
) -> list[Option]:
    """Filter, quantize and de-duplicate the measured options of one (stage, instruction).

    Steps (reference §2.1 steps 2-4):

    1. Pareto filter on ``(time, energy)`` by weak dominance: drop a point if another is no
       slower and no costlier, and better in one (issue 45; the SOSP'24 artifact's filter is
       strict, and threw away a clock 21 % cheaper at the same time on a memory-bound
       instruction).
    2. Floor-quantize: ``quant = int(time_s // unit_time_s)`` (IEEE float floor division).
    3. Among survivors sharing a ``quant``, keep the one with the lowest energy (the artifact
       keeps the highest, whose real time is closest to ``quant·τ``; the slowdown guard replays
       real times, so the cheaper one is never a risk it does not see), except in the fastest
       ``quant``, which keeps its fastest point: the guard's last resort is all-max's time.
    4. If three or fewer options are left, redo steps 1-3 on all points with the soft filter
       ``eta = noise_factor``: drop a point only if another is below ``eta`` times it in both
       time and energy (a guard against measurement noise). The count is taken after
       de-duplication, as lowtime's ``CandidateExecutionOptions`` reports its options.
    5. Sort by ``quant`` ascending (fastest first) and attach the effective energy
       ``energy - p_block_w·quant·unit_time_s``.

    ``order`` selects what the filter compares. ``"filter-then-subtract"`` (default; the SOSP'24
    artifact) compares raw energy. ``"subtract-then-filter"`` (Zeus's example and Kareus)
    compares effective energy, which keeps slow frequencies that are dominated in raw energy but
    cheaper in effective energy. The de-duplication in step 3 is the same in both orders: within
    one ``quant`` the subtracted term ``p_block_w·quant·τ`` is a constant, so the lowest raw
    energy is also the lowest effective energy.

    Args:
        points: ``(freq_mhz, time_s, energy_j)`` per measured frequency; frequencies must be
            distinct, times positive and energies finite. Or ``(freq_mhz, time_s, energy_j,
            knob)``: several options per clock that differ in ``knob`` (Kareus), which then
            need not have distinct frequencies.
        unit_time_s: The time quantum τ in seconds (1 ms in the paper's A100 runs).
        p_block_w: The GPU's power while blocked on communication, in watts (e.g. 83.64 on
            A100 in the paper artifact).
        order: One of :data:`ORDERS`.
        noise_factor: η of the soft fallback filter, in ``(0, 1]``.
        pruning: One of :data:`PRUNINGS`: ``weak`` (steps 1 and 3 as above) or ``artifact``
            (strict dominance in step 1, the most expensive per ``quant`` in step 3: the
            SOSP'24 artifact's, to reproduce its frontiers).

    Returns:
        The surviving options, sorted by ``quant`` ascending; ``quant`` values are distinct.

    Raises:
        PlanError: On malformed input, fewer than two measured frequencies, or if an option
            quantizes to zero units (τ too coarse).
    """
    tau, p_block, eta = _checked_parameters(unit_time_s, p_block_w, order, noise_factor)
    if pruning not in PRUNINGS:
        raise PlanError(f"pruning must be one of {PRUNINGS}, got {pruning!r}")
    options = _pareto_options(_measured(points), tau, p_block, eta, order, pruning)
    if options and options[0].quant < 1:
        raise PlanError(
            f"{options[0].freq_mhz:g} MHz takes {options[0].time_s:g} s, less than one time "
            f"quantum ({tau:g} s); use a smaller unit_time_s"
        )
    # A single survivor is legitimate: every slower clock was both slower and costlier (or
    # quantizes to the same duration), so the instruction has one useful duration.
    return options


def frequency_for(options: Sequence[Option], duration_q: int) -> Option:
    """The option to run for a planned duration: the slowest whose ``quant`` fits.

    Args:
        options: The options of one (stage, instruction), e.g. from :func:`prepare_options`
            (any order).
        duration_q: Planned duration in time quanta.

    Returns:
        The option with the largest ``quant <= duration_q`` (the first such if several share
        it); the fastest option (smallest ``quant``) if none fits.

    Raises:
        PlanError: If ``options`` is empty.
    """
    if not options:
        raise PlanError("frequency_for needs at least one option")
    d = operator.index(duration_q)
    chosen: Option | None = None
    fastest = options[0]
    for o in options:
        if o.quant <= d and (chosen is None or o.quant > chosen.quant):
            chosen = o
        if o.quant < fastest.quant:
            fastest = o
    return fastest if chosen is None else chosen
