"""The noise-free fluid model of one GPU running a partition: exact ground truth for searches.

The formulas are in :mod:`powerlib.emulator.partition_model`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from powerlib.emulator.partition_params import A100, OverlapDeviceParams
from powerlib.errors import PlanError
from powerlib.planning.kareus.partition import Collective, Config, Op, PartitionType, Segment

__all__ = ["OverlapResult", "model", "model_compute", "model_power", "model_sequential", "simulate"]


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
    """One noise-free execution of ``ptype`` under ``config``.

    Raises:
        PlanError: On a slot the partition does not have, an SM count outside ``1..N_sm−1`` or a
            clock outside the device's range.
    """
    f = _check_freq(config.freq_mhz, params)
    sms = _check_sms(config.sm_count, params)
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
    return _run(_prepare(ptype.ops, params), ptype.comm, start, sms, f, params)


def model(
    ptype: PartitionType, config: Config, *, params: OverlapDeviceParams = A100
) -> tuple[float, float]:
    """Noise-free ``(time_s, energy_j)`` of one execution of ``ptype`` under ``config``."""
    r = simulate(ptype, config, params=params)
    return r.time_s, r.energy_j


def model_power(
    ptype: PartitionType, config: Config, *, params: OverlapDeviceParams = A100
) -> tuple[float, float, float]:
    """Noise-free ``(time_s, energy_j, avg_power_w)`` of one execution."""
    r = simulate(ptype, config, params=params)
    return r.time_s, r.energy_j, r.avg_power_w


def model_sequential(
    segments: Sequence[Segment],
    freq_mhz: float,
    sm_count: int | None = None,
    *,
    params: OverlapDeviceParams = A100,
) -> tuple[float, float]:
    """Noise-free ``(time_s, energy_j)`` of segments run without overlap.

    Each segment's compute runs on all SMs, then its collective alone with ``sm_count`` CTAs
    (default: the stock collective's :attr:`OverlapDeviceParams.default_comm_sms`), fully exposed.
    """
    f = _check_freq(freq_mhz, params)
    sms = _check_sms(params.default_comm_sms if sm_count is None else sm_count, params)
    time_s = energy_j = 0.0
    for seg in segments:
        r = _run(_prepare(seg.ops, params), seg.comm, None, sms, f, params)
        time_s += r.time_s
        energy_j += r.energy_j
    return time_s, energy_j


def model_compute(
    ops: Sequence[Op], freq_mhz: float, *, params: OverlapDeviceParams = A100
) -> tuple[float, float]:
    """Noise-free ``(time_s, energy_j)`` of compute ops alone on all SMs."""
    f = _check_freq(freq_mhz, params)
    r = _run(_prepare(tuple(ops), params), None, None, 1, f, params)
    return r.time_s, r.energy_j
