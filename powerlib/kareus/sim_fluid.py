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


@dataclass(slots=True, kw_only=True)
class _Link:
    """The partition's collective during a run: its rates, its power and what is left of it.

    Attributes:
        r_link: The wire rate (B/s) the link and the collective's SMs allow.
        link_w: Link power per wire byte per second.
        sm_w: Power of the SMs the collective holds busy.
        lat_left: Launch latency still to run (s).
        bytes_left: Wire bytes still to move.
        on: In flight now.
        done: Finished (at once without a collective).
        end_s: When it finished.
    """

    r_link: float = 0.0
    link_w: float = 0.0
    sm_w: float = 0.0
    lat_left: float = 0.0
    bytes_left: float = 0.0
    on: bool = False
    done: bool = True
    end_s: float = 0.0

    @classmethod
    def of(
        cls,
        comm: Collective | None,
        sms: int,
        freq_mhz: float,
        phi_sm: float,
        params: OverlapDeviceParams,
    ) -> _Link:
        """The collective ``comm`` on ``sms`` SMs at ``freq_mhz``, not yet launched."""
        if comm is None:
            return cls()
        fr = freq_mhz / params.max_freq_mhz
        r_sm = sms * params.sm_link_bw_bps * fr**params.comm_freq_gamma
        q = params.comm_smooth_p
        return cls(
            r_link=(params.link_bw_bps**-q + r_sm**-q) ** (-1.0 / q),
            link_w=params.link_power_w / params.link_bw_bps,
            sm_w=phi_sm * sms * params.comm_busy,
            lat_left=params.comm_latency_s,
            bytes_left=comm.wire_bytes,
            done=False,
        )

    def advance(self, dt: float, rate: float, t: float) -> None:
        """Run it ``dt`` seconds from ``t`` at ``rate`` wire bytes per second."""
        if self.lat_left > 0.0:
            self.lat_left -= dt
            if self.lat_left <= 1e-15:
                self.lat_left = 0.0
        else:
            self.bytes_left -= rate * dt
            if self.bytes_left <= 1e-6:
                self.on, self.done, self.end_s = False, True, t + dt

    def alone(self, hbm_cap: float, kappa: float, hbm_w: float) -> tuple[float, float]:
        """The rest of it run alone (full HBM, idle SMs): its time and dynamic energy."""
        rate = min(self.r_link, hbm_cap / kappa)
        t_alone = self.lat_left + self.bytes_left / rate
        e_alone = self.sm_w * t_alone + (rate * (kappa * hbm_w + self.link_w)) * (
            self.bytes_left / rate
        )
        return t_alone, e_alone


def _fair_hbm(d_c: float, d_m: float, hbm_cap: float) -> tuple[float, float]:
    """Max-min fair HBM sharing between a kernel's demand ``d_c`` and the collective's ``d_m``."""
    if d_c + d_m > hbm_cap:
        half = 0.5 * hbm_cap
        if d_c <= half:
            return d_c, hbm_cap - d_c
        if d_m <= half:
            return hbm_cap - d_m, d_m
        return half, half
    return hbm_cap, d_m


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
    phi_sm = params.sm_power_w * params.phi(freq_mhz)
    sm_rate = params.flops_per_sm_cycle * freq_mhz * 1e6  # FLOP/s per SM at full efficiency
    hbm_cap = params.eta_mem * params.hbm_bw_bps
    kappa = params.hbm_bytes_per_wire_byte
    launch = params.launch_overhead_s
    hbm_w = params.hbm_power_w / params.hbm_bw_bps
    n_all = float(params.num_sms)
    link = _Link.of(comm, sms, freq_mhz, phi_sm, params)
    t = 0.0
    e = 0.0

    for i, (flops, nbytes, max_sms, eta) in enumerate(pre):
        if not link.done and start == i:
            link.on = True
        x = 1.0  # remaining fraction of the op
        while x > 1e-12:
            n = n_all - sms if link.on else n_all
            n_used = n if n < max_sms else max_sms
            t_comp = flops / (eta * n_used * sm_rate) if flops > 0 else 0.0
            if link.on and link.lat_left <= 0.0:
                t_mem_full = nbytes / hbm_cap
                t_full = (t_comp**p + t_mem_full**p) ** inv_p + launch
                a_c, a_m = _fair_hbm(nbytes / t_full, kappa * link.r_link, hbm_cap)
                t_mem = nbytes / a_c
                rate = min(link.r_link, a_m / kappa)
            else:
                t_mem = nbytes / hbm_cap
                rate = 0.0
            t_i = (t_comp**p + t_mem**p) ** inv_p + launch
            dt = x * t_i
            power = phi_sm * n_used * (t_comp / t_i) + hbm_w * (nbytes / t_i)
            if link.on:
                dt_comm = link.lat_left if link.lat_left > 0.0 else link.bytes_left / rate
                if dt_comm < dt:
                    dt = dt_comm
                power += link.sm_w + rate * (kappa * hbm_w + link.link_w)
                link.advance(dt, rate, t)
            e += power * dt
            t += dt
            x -= dt / t_i
            if trace is not None:
                trace.append((dt, power))
    compute_end = t
    if not link.done:  # the collective runs alone (never started, or still in flight)
        t_alone, e_alone = link.alone(hbm_cap, kappa, hbm_w)
        e += e_alone
        t += t_alone
        if trace is not None and t_alone > 0:
            trace.append((t_alone, e_alone / t_alone))
        link.end_s = t
    if comm is not None:
        t += params.sync_overhead_s
        if trace is not None:
            trace.append((params.sync_overhead_s, 0.0))
    return OverlapResult(
        time_s=t,
        energy_j=e + params.p_static_w * t,
        dynamic_energy_j=e,
        compute_end_s=compute_end,
        comm_end_s=link.end_s,
        exposed_comm_s=max(0.0, link.end_s - compute_end),
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
