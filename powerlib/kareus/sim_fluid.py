"""The noise-free fluid model of one GPU running a partition: exact ground truth for searches.

The formulas are in :mod:`powerlib.kareus.sim_model`'s docstring. :func:`simulate` is the
physics at one clock; :func:`model`, :func:`model_power`, :func:`model_sequential` and
:func:`model_compute` keep the device's power limit in force, as a real GPU does: work that would
draw more than the limit at its locked clock runs at the lower clock where it fits
(:func:`throttled_clock`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from powerlib.errors import PlanError
from powerlib.kareus.partition_types import Collective, Config, Op, PartitionType, Segment
from powerlib.kareus.sim_params import A100, OverlapDeviceParams

__all__ = [
    "OverlapResult",
    "model",
    "model_compute",
    "model_power",
    "model_sequential",
    "simulate",
    "simulate_capped",
    "throttled_clock",
]


# --------------------------------------------------------------------------------------------
# Noise-free model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapResult:
    """One noise-free execution.

    Attributes:
        time_s: Wall time of one execution (sync overhead included).
        energy_j: Total energy (static included).
        dynamic_energy_j: ``energy_j − P_static · time_s``.
        compute_end_s: When the last compute kernel finished.
        comm_end_s: When the last collective finished (0 without one).
        exposed_comm_s: Collective time not hidden behind compute.
    """

    time_s: float
    energy_j: float
    dynamic_energy_j: float
    compute_end_s: float
    comm_end_s: float
    exposed_comm_s: float

    @property
    def avg_power_w(self) -> float:
        """Average power over the execution."""
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0


# A prepared op: (flops, hbm_bytes, max usable SMs, efficiency)
_PreOp = tuple[float, float, float, float]


@lru_cache(maxsize=4096)
def _prepare(ops: tuple[Op, ...], params: OverlapDeviceParams) -> tuple[_PreOp, ...]:
    out = []
    for op in ops:
        flops = float(op.flops)
        eta = params.eta_max * flops / (flops + params.flops_half) if flops > 0 else 1.0
        out.append((flops, float(op.hbm_bytes), max(1.0, op.ctas / params.ctas_per_sm), eta))
    return tuple(out)


def _check_freq(freq_mhz: float, params: OverlapDeviceParams) -> float:
    f = float(freq_mhz)
    if not (math.isfinite(f) and params.min_freq_mhz - 1e-9 <= f <= params.max_freq_mhz + 1e-9):
        raise PlanError(
            f"clock {freq_mhz!r} MHz is outside the {params.name}'s range "
            f"{params.min_freq_mhz:g}-{params.max_freq_mhz:g} MHz"
        )
    return f


def _check_sms(sm_count: int, params: OverlapDeviceParams) -> int:
    if isinstance(sm_count, bool) or not isinstance(sm_count, int | np.integer):
        raise PlanError(f"SM count must be an integer, got {sm_count!r}")
    if not 1 <= sm_count < params.num_sms:
        raise PlanError(
            f"SM count {sm_count} for the collective must be in 1-{params.num_sms - 1} "
            f"(the {params.name} has {params.num_sms} SMs)"
        )
    return int(sm_count)


def _run(
    pre: tuple[_PreOp, ...],
    comm: Collective | None,
    start: int | None,
    sms: int,
    freq_mhz: float,
    params: OverlapDeviceParams,
    trace: list[tuple[float, float]] | None = None,
) -> OverlapResult:
    """The event-driven fluid simulation of one partition (or of compute alone: ``comm=None``).

    ``start`` is the op index the collective launches with; ``None`` runs it after the compute.
    With ``trace``, every phase's ``(duration_s, dynamic_power_w)`` is appended to it.
    """
    p = params.smooth_p
    inv_p = 1.0 / p
    fr = freq_mhz / params.max_freq_mhz
    phi_sm = params.sm_power_w * params.phi(freq_mhz)
    sm_rate = params.flops_per_sm_cycle * freq_mhz * 1e6  # FLOP/s per SM at full efficiency
    hbm_cap = params.eta_mem * params.hbm_bw_bps
    kappa = params.hbm_bytes_per_wire_byte
    launch = params.launch_overhead_s
    hbm_w = params.hbm_power_w / params.hbm_bw_bps
    n_all = float(params.num_sms)

    if comm is not None:
        r_sm = sms * params.sm_link_bw_bps * fr**params.comm_freq_gamma
        q = params.comm_smooth_p
        r_link = (params.link_bw_bps**-q + r_sm**-q) ** (-1.0 / q)
        link_w = params.link_power_w / params.link_bw_bps
        comm_sm_w = phi_sm * sms * params.comm_busy
        lat_left = params.comm_latency_s
        bytes_left = comm.wire_bytes
    else:
        r_link = link_w = comm_sm_w = lat_left = bytes_left = 0.0
    comm_on = False
    comm_done = comm is None
    comm_end = 0.0
    t = 0.0
    e = 0.0

    for i, (flops, nbytes, max_sms, eta) in enumerate(pre):
        if not comm_done and start == i:
            comm_on = True
        x = 1.0  # remaining fraction of the op
        while x > 1e-12:
            n = n_all - sms if comm_on else n_all
            n_used = n if n < max_sms else max_sms
            t_comp = flops / (eta * n_used * sm_rate) if flops > 0 else 0.0
            if comm_on and lat_left <= 0.0:
                # Max-min fair HBM sharing between the kernel's demand and the collective's.
                t_mem_full = nbytes / hbm_cap
                t_full = (t_comp**p + t_mem_full**p) ** inv_p + launch
                d_c = nbytes / t_full
                d_m = kappa * r_link
                if d_c + d_m > hbm_cap:
                    half = 0.5 * hbm_cap
                    if d_c <= half:
                        a_c, a_m = d_c, hbm_cap - d_c
                    elif d_m <= half:
                        a_c, a_m = hbm_cap - d_m, d_m
                    else:
                        a_c = a_m = half
                else:
                    a_c, a_m = hbm_cap, d_m
                t_mem = nbytes / a_c
                rate = min(r_link, a_m / kappa)
            else:
                t_mem = nbytes / hbm_cap
                rate = 0.0
            t_i = (t_comp**p + t_mem**p) ** inv_p + launch
            dt = x * t_i
            if comm_on:
                dt_comm = lat_left if lat_left > 0.0 else bytes_left / rate
                if dt_comm < dt:
                    dt = dt_comm
            power = phi_sm * n_used * (t_comp / t_i) + hbm_w * (nbytes / t_i)
            if comm_on:
                power += comm_sm_w + rate * (kappa * hbm_w + link_w)
                if lat_left > 0.0:
                    lat_left -= dt
                    if lat_left <= 1e-15:
                        lat_left = 0.0
                else:
                    bytes_left -= rate * dt
                    if bytes_left <= 1e-6:
                        comm_on, comm_done, comm_end = False, True, t + dt
            e += power * dt
            t += dt
            x -= dt / t_i
            if trace is not None:
                trace.append((dt, power))
    compute_end = t
    if not comm_done:
        # The collective runs alone (never started, or still in flight): full HBM, idle SMs.
        rate = min(r_link, hbm_cap / kappa)
        t_alone = lat_left + bytes_left / rate
        e_alone = comm_sm_w * t_alone + (rate * (kappa * hbm_w + link_w)) * (bytes_left / rate)
        e += e_alone
        t += t_alone
        if trace is not None and t_alone > 0:
            trace.append((t_alone, e_alone / t_alone))
        comm_end = t
    exposed = max(0.0, comm_end - compute_end)
    if comm is not None:
        t += params.sync_overhead_s
        if trace is not None:
            trace.append((params.sync_overhead_s, 0.0))
    energy = e + params.p_static_w * t
    return OverlapResult(
        time_s=t,
        energy_j=energy,
        dynamic_energy_j=e,
        compute_end_s=compute_end,
        comm_end_s=comm_end,
        exposed_comm_s=exposed,
    )


def simulate(
    ptype: PartitionType, config: Config, *, params: OverlapDeviceParams = A100
) -> OverlapResult:
    """One noise-free execution of ``ptype`` at exactly ``config``'s clock, whatever it draws.

    The raw physics at one clock, without the power limit: :func:`model` and the evaluator
    throttle (:func:`throttled_clock`).

    Raises:
        PlanError: On a slot the partition does not have, an SM count outside ``1..N_sm−1`` or a
            clock outside the device's range.
    """
    f = _check_freq(config.freq_mhz, params)
    sms = _check_sms(config.sm_count, params)
    return _simulate_at(ptype, config, sms, f, params)


def _simulate_at(
    ptype: PartitionType, config: Config, sms: int, freq_mhz: float, params: OverlapDeviceParams
) -> OverlapResult:
    if config.slot is None:
        start = None
    else:
        slot_ops = ptype.slot_ops
        if config.slot not in slot_ops:
            raise PlanError(
                f"partition {ptype.key!r} has no launch slot {config.slot!r}; "
                f"it has {', '.join(slot_ops)}"
            )
        start = slot_ops[config.slot]
    return _run(_prepare(ptype.ops, params), ptype.comm, start, sms, freq_mhz, params)


def _cap_of(power_cap_w: float | None, params: OverlapDeviceParams) -> float:
    """The power limit in force: the device's by default; ``math.inf`` turns it off."""
    cap = params.power_cap_w if power_cap_w is None else float(power_cap_w)
    if not cap > 0:  # also rejects NaN
        raise PlanError(f"power_cap_w must be positive (math.inf: no limit), got {power_cap_w!r}")
    return cap


def throttled_clock(
    power_at_w: Callable[[float], float],
    freq_lock_mhz: float,
    power_cap_w: float,
    params: OverlapDeviceParams = A100,
) -> float:
    """The clock repeated work settles at under a power limit, with the clock locked at a value.

    A GPU whose average power exceeds its limit lowers its clock until the power fits
    (docs/kareus.md §2.4); in steady state the clock averages the one where the work's average
    power ``power_at_w(f)`` meets the limit (off the supported grid in general: the controller
    of :func:`~powerlib.kareus.sim_capping.run_capped` oscillates around it, and by
    Theorem 1 a lock at that average takes the same time). Returns ``freq_lock_mhz`` when the
    work fits at the lock, the highest clock in ``[min_freq_mhz, freq_lock_mhz]`` whose power
    fits (bisection to 0.01 MHz) otherwise, and ``min_freq_mhz`` if even that clock does not fit.
    """
    if not math.isfinite(power_cap_w) or power_at_w(freq_lock_mhz) <= power_cap_w:
        return freq_lock_mhz
    lo, hi = params.min_freq_mhz, freq_lock_mhz
    if power_at_w(lo) > power_cap_w:
        return lo
    while hi - lo > 0.01:
        mid = 0.5 * (lo + hi)
        if power_at_w(mid) <= power_cap_w:
            lo = mid
        else:
            hi = mid
    return lo


def simulate_capped(
    ptype: PartitionType,
    config: Config,
    *,
    params: OverlapDeviceParams = A100,
    power_cap_w: float | None = None,
) -> tuple[OverlapResult, float]:
    """One noise-free execution of ``ptype`` locked at ``config``'s clock, under the power limit.

    Returns the execution at the clock the device settles at (:func:`throttled_clock`) and that
    clock (``config.freq_mhz`` unless it throttled).

    Args:
        ptype: The partition type.
        config: Its configuration; the clock is the lock.
        params: Device parameters.
        power_cap_w: Power limit; ``None``: the device's (:attr:`OverlapDeviceParams.power_cap_w`),
            as on a real GPU; ``math.inf``: none.

    Raises:
        PlanError: As :func:`simulate`, or on a non-positive limit.
    """
    f = _check_freq(config.freq_mhz, params)
    sms = _check_sms(config.sm_count, params)
    cap = _cap_of(power_cap_w, params)
    at = _simulate_at(ptype, config, sms, f, params)
    if at.avg_power_w <= cap:
        return at, f
    f_eff = throttled_clock(
        lambda x: _simulate_at(ptype, config, sms, x, params).avg_power_w, f, cap, params
    )
    return _simulate_at(ptype, config, sms, f_eff, params), f_eff


def model(
    ptype: PartitionType,
    config: Config,
    *,
    params: OverlapDeviceParams = A100,
    power_cap_w: float | None = None,
) -> tuple[float, float]:
    """Noise-free ``(time_s, energy_j)`` of one execution of ``ptype`` under ``config``.

    The device's power limit is in force (``power_cap_w``: see :func:`simulate_capped`): a
    configuration that would draw more runs at the lower clock where it fits.
    """
    r, _ = simulate_capped(ptype, config, params=params, power_cap_w=power_cap_w)
    return r.time_s, r.energy_j


def model_power(
    ptype: PartitionType,
    config: Config,
    *,
    params: OverlapDeviceParams = A100,
    power_cap_w: float | None = None,
) -> tuple[float, float, float]:
    """Noise-free ``(time_s, energy_j, avg_power_w)`` of one execution, under the power limit."""
    r, _ = simulate_capped(ptype, config, params=params, power_cap_w=power_cap_w)
    return r.time_s, r.energy_j, r.avg_power_w


def _capped_sum(
    runs: Callable[[float], list[OverlapResult]],
    freq_mhz: float,
    power_cap_w: float | None,
    params: OverlapDeviceParams,
) -> tuple[float, float]:
    """``(time_s, energy_j)`` of repeated work given per clock as a list of executions.

    The limit acts on the whole unit's average power, as a controller averaging over many units
    does.
    """
    cap = _cap_of(power_cap_w, params)

    def total(f: float) -> tuple[float, float]:
        rs = runs(f)
        return sum(r.time_s for r in rs), sum(r.energy_j for r in rs)

    def power(f: float) -> float:
        t, e = total(f)
        return e / t

    return total(throttled_clock(power, freq_mhz, cap, params))


def model_sequential(
    segments: Sequence[Segment],
    freq_mhz: float,
    sm_count: int | None = None,
    *,
    params: OverlapDeviceParams = A100,
    power_cap_w: float | None = None,
) -> tuple[float, float]:
    """Noise-free ``(time_s, energy_j)`` of segments run without overlap, under the power limit.

    Each segment's compute runs on all SMs, then its collective alone with ``sm_count`` CTAs
    (default: the stock collective's :attr:`OverlapDeviceParams.default_comm_sms`), fully exposed.
    The limit (``power_cap_w``: see :func:`simulate_capped`) acts on the segments' average power.
    """
    f = _check_freq(freq_mhz, params)
    sms = _check_sms(params.default_comm_sms if sm_count is None else sm_count, params)
    segs = tuple(segments)

    def runs(x: float) -> list[OverlapResult]:
        return [_run(_prepare(seg.ops, params), seg.comm, None, sms, x, params) for seg in segs]

    return _capped_sum(runs, f, power_cap_w, params)


def model_compute(
    ops: Sequence[Op],
    freq_mhz: float,
    *,
    params: OverlapDeviceParams = A100,
    power_cap_w: float | None = None,
) -> tuple[float, float]:
    """Noise-free ``(time_s, energy_j)`` of compute ops alone on all SMs, under the power limit."""
    f = _check_freq(freq_mhz, params)
    pre = _prepare(tuple(ops), params)
    return _capped_sum(lambda x: [_run(pre, None, None, 1, x, params)], f, power_cap_w, params)
