"""Simulated partition evaluator: a fluid model of one GPU running Kareus's overlap partitions.

The model is kareus.md §5.1 (formulas), calibrated against the phenomena of §5.3 on the real
workloads of :mod:`powerlib.planning.kareus.partition`. It reads the GPUs' clocks, voltage
curve, static power, power cap, thermal constants and energy-counter period from the table the
simulated backend reads (:data:`powerlib.gpu_models.GPU_SPECS`), so the two simulators agree.

**Compute kernel** ``i`` (FLOPs ``F``, HBM bytes ``B``, CTAs ``G``) on ``n`` SMs at clock ``f``
with HBM bandwidth ``BW_a`` available::

    t_comp = F / (η_c(F) · min(n, G/o) · π_sm · f),   η_c(F) = η_max · F / (F + F_half)
    t_mem  = B / BW_a
    t_i    = (t_comp^p + t_mem^p)^(1/p) + t_launch          (smooth max, p = 3)

**Collective** with ``s`` CTAs: ``t = α + wire_bytes / r``, where
``r = smoothmin(BW_link, s · b_sm · (f/f_max)^γ)``; it holds its ``s`` SMs for its lifetime and
moves ``κ · r`` bytes/s through HBM.

**Overlap.** Compute ops run in order; the collective starts with the first op of its launch slot
(or after the last op with no overlap). While it runs, compute has ``N_sm − s`` SMs and HBM is
shared max-min fair between the running kernel's demand and the collective's ``κ·r``. Rates are
recomputed at every event (kernel end, collective latency end, collective end). The partition ends
at ``max(compute end, comm end)`` plus a sync overhead.

**Power**: ``P = P_s(θ) + c_sm·φ(f)·(Σ_compute u_c + s·u_comm) + c_hbm·BW/BW_hbm + c_link·r/BW_link``
with ``φ(f) = (f/f_max)(v(f)/v_max)²`` (flat voltage below the knee) and ``u_c = t_comp / t_i``;
idle SMs draw nothing beyond static power.

The noise-free functions (:func:`model`, :func:`simulate`, :func:`model_sequential`,
:func:`model_compute`) are exact ground truth for exhaustive searches. The
:class:`SimulatedOverlapEvaluator` wraps them in the thermally stable measurement protocol
(kareus.md §2.1) in virtual time: settle, warm-up, window, cool-down; temperature-dependent static
power; an NVML-like energy counter updated every 100 ms; multiplicative noise. Power-cap throttling
and Theorem 1 (kareus.md §2.4) are reproduced by :func:`run_capped` and :func:`run_locked`.

Pure Python + numpy (for the seeded random generator); no sleeping.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from powerlib.dvfs import VoltageCurve
from powerlib.errors import PlanError
from powerlib.gpu_models import GPU_SPECS, GpuSpec
from powerlib.planning.kareus.evaluator import Measurement, MeasureProtocol
from powerlib.planning.kareus.partition import Collective, Config, Op, PartitionType, Segment

__all__ = [
    "A100",
    "H100",
    "CappedRun",
    "LockedRun",
    "OverlapDeviceParams",
    "OverlapResult",
    "SimulatedOverlapEvaluator",
    "Work",
    "model",
    "model_compute",
    "model_power",
    "model_sequential",
    "run_capped",
    "run_locked",
    "simulate",
]


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapDeviceParams(VoltageCurve):
    """One GPU model's parameters for the overlap simulator (kareus.md §5.1, §5.4).

    Attributes:
        name: Model name.
        num_sms: Streaming multiprocessors ``N_sm``.
        min_freq_mhz: Lowest supported (lockable) SM clock.
        max_freq_mhz: Highest supported SM clock ``f_max``.
        freq_step_mhz: Spacing of supported clocks (and of power-cap throttle steps).
        knee_freq_mhz: Clock below which the voltage stays at its floor.
        v_min_ratio: Voltage floor as a fraction of the voltage at ``f_max``.
        hbm_bw_bps: Peak HBM bandwidth, bytes/s (independent of the SM clock).
        eta_mem: Achievable fraction of peak HBM bandwidth ``η_m``.
        peak_flops: Dense BF16 tensor peak at ``f_max``, FLOP/s.
        eta_max: Compute efficiency of a large kernel ``η_max``.
        flops_half: ``F_half`` of the small-problem penalty ``η_c(F) = η_max·F/(F+F_half)``.
        ctas_per_sm: CTAs resident per SM ``o`` (a kernel of ``G`` CTAs uses ≤ ``G/o`` SMs).
        link_bw_bps: Effective per-GPU collective (bus) bandwidth applied to wire bytes, bytes/s.
        sm_link_bw_bps: Collective bandwidth one CTA drives at ``f_max`` ``b_sm``, bytes/s.
        comm_freq_gamma: ``γ`` of the per-CTA rate's clock dependence ``(f/f_max)^γ``.
        comm_latency_s: Collective start-up latency ``α``.
        hbm_bytes_per_wire_byte: HBM bytes per wire byte of a collective ``κ``.
        comm_busy: SM busy fraction of the collective's CTAs ``u_comm``.
        p_static_w: Static power ``P_s`` (powered, context resident, blocked on P2P).
        sm_power_w: ``c_sm``: power of one fully busy SM at ``f_max``.
        hbm_power_w: ``c_hbm``: power of HBM traffic at peak bandwidth.
        link_power_w: ``c_link``: power of the links at full collective bandwidth.
        power_cap_w: Default power limit (TDP).
        cap_period_s: Power-cap control period: the controller acts once per period.
        cap_window_s: The controller compares the average power over this trailing window.
        cap_margin_w: The controller raises the clock again below ``cap − margin``.
        thermal_resistance_c_per_w: ``R``: steady-state temperature rise per watt.
        thermal_capacitance_j_per_c: ``C``: heat capacity; ``τ = R·C``.
        ambient_c: Inlet temperature ``θ_amb``.
        static_temp_coeff_per_c: ``α_θ``: relative rise of static power per °C above the reference.
        static_ref_temp_c: Temperature at which static power equals ``p_static_w``.
        energy_update_period_s: How often the energy counter publishes a new value.
        energy_quantum_j: Resolution of the energy counter.
        noise: Default multiplicative measurement noise (relative standard deviation of energy).
        launch_overhead_s: Per-kernel launch overhead added to each compute kernel.
        sync_overhead_s: End-of-partition stream join.
        default_comm_sms: CTAs of a stock collective (NCCL) running alone (sequential execution).
        smooth_p: Exponent of the smooth max of compute and memory time.
        comm_smooth_p: Exponent of the smooth min of link and CTA-driven collective rates.
    """

    name: str
    num_sms: int
    min_freq_mhz: float
    max_freq_mhz: float
    freq_step_mhz: float
    knee_freq_mhz: float
    v_min_ratio: float
    hbm_bw_bps: float
    eta_mem: float
    peak_flops: float
    eta_max: float
    flops_half: float
    ctas_per_sm: float
    link_bw_bps: float
    sm_link_bw_bps: float
    comm_freq_gamma: float
    comm_latency_s: float
    hbm_bytes_per_wire_byte: float
    comm_busy: float
    p_static_w: float
    sm_power_w: float
    hbm_power_w: float
    link_power_w: float
    power_cap_w: float
    cap_period_s: float
    cap_window_s: float
    cap_margin_w: float
    thermal_resistance_c_per_w: float
    thermal_capacitance_j_per_c: float
    ambient_c: float
    static_temp_coeff_per_c: float
    static_ref_temp_c: float
    energy_update_period_s: float
    energy_quantum_j: float
    noise: float
    launch_overhead_s: float
    sync_overhead_s: float
    default_comm_sms: int
    smooth_p: float = 3.0  # kareus.md §5.1: p ≈ 3
    comm_smooth_p: float = 8.0  # [assumption] a sharp knee: 24 CTAs reach ~90 % of the link

    @property
    def flops_per_sm_cycle(self) -> float:
        """``π_sm``: peak FLOP per SM per cycle (peak / (N_sm · f_max))."""
        return self.peak_flops / (self.num_sms * self.max_freq_mhz * 1e6)


def _from_spec(spec: GpuSpec, **model: float) -> OverlapDeviceParams:
    """The simulated GPU's shared parameters (:data:`~powerlib.gpu_models.GPU_SPECS`) plus ``model``.

    ``p_static_w`` is the spec's blocked power (idle plus clock power at ``f_max``), the power cap
    its default power limit; ``model`` holds the partition model's own calibration.
    """
    return OverlapDeviceParams(
        name=spec.product,
        num_sms=spec.num_sms,
        min_freq_mhz=spec.min_freq_mhz,
        max_freq_mhz=spec.max_freq_mhz,
        freq_step_mhz=spec.freq_step_mhz,
        knee_freq_mhz=spec.knee_freq_mhz,
        v_min_ratio=spec.v_min_ratio,
        p_static_w=spec.blocked_power_w,
        power_cap_w=spec.default_power_limit_w,
        thermal_resistance_c_per_w=spec.thermal_resistance_c_per_w,
        thermal_capacitance_j_per_c=spec.thermal_capacitance_j_per_c,
        ambient_c=spec.ambient_c,
        energy_update_period_s=spec.energy_update_period_s,
        **model,  # type: ignore[arg-type]
    )


_A100_CALIBRATED_SM_POWER_W = 3.0
"""The partition model's ``c_sm`` on the A100, calibrated; the spec's published estimate is 2.4 W.

kareus.md §5.4's (380-85-30)/108 subtracts the clock power twice; (400-85-15)/108 ≈ 2.8 W puts a
large GEMM at the TDP. 3.0 W with the HBM and link terms below makes nanobatched overlap at
1410 MHz throttle to ~1350 MHz under 400 W while sequential execution does not (kareus.md §2.4,
§5.3 item 6).
"""

_A100_MODEL: dict[str, float] = {
    "hbm_bw_bps": 1555e9,  # kareus.md §5.4: 1,555 GB/s
    "eta_mem": 0.85,  # [assumption] STREAM-like kernels reach ~1.3 TB/s on A100
    "peak_flops": 312e12,  # kareus.md §5.4: dense BF16 312 TFLOP/s -> π_sm = 2048 FLOP/cycle/SM
    "eta_max": 0.80,  # [assumption] large cuBLAS GEMMs reach ~80 % of peak
    "flops_half": 1.0e9,  # [assumption] a 1 GFLOP kernel runs at half of η_max (kareus.md §5.1)
    "ctas_per_sm": 1.0,  # [assumption] one 128x128-tile CTA per SM; kareus.md §7: one CTA per SM
    "link_bw_bps": 230e9,  # [assumption] NCCL all-reduce bus bandwidth on 8xA100 NVLink3 (300 GB/s/dir raw)
    "sm_link_bw_bps": 230e9
    / 25.0,  # kareus.md §5.1: b_sm ≈ BW_link_eff / 25 (saturates at 20-30 SMs)
    "comm_freq_gamma": 0.3,  # kareus.md §5.1: γ ≈ 0-0.5
    "comm_latency_s": 15e-6,  # [assumption] NVLink collective start-up latency
    "hbm_bytes_per_wire_byte": 2.5,  # kareus.md §5.1: κ ≈ 2-3
    "comm_busy": 0.3,  # kareus.md §5.1: u_comm ≈ 0.2-0.4
    "sm_power_w": _A100_CALIBRATED_SM_POWER_W,  # [assumption, calibrated]
    "hbm_power_w": 160.0,  # [assumption, calibrated] HBM2 + L2/crossbar/LSU traffic at peak bandwidth
    "link_power_w": 90.0,  # [assumption, calibrated] NVLink SerDes + copy engines at full collective rate
    "cap_period_s": 0.01,  # kareus.md §5.1: control period 10-100 ms [assumption]
    "cap_window_s": 0.1,  # [assumption] NVML's power average window; longer than a layer
    "cap_margin_w": 5.0,  # [assumption] hysteresis of the throttle controller
    "static_temp_coeff_per_c": 0.006,  # [assumption] leakage +0.6 %/°C (kareus.md §5.1 P_s(θ))
    "static_ref_temp_c": 30.0,  # [assumption] P_static (85 W) is measured on a cool (~30 °C) GPU
    "energy_quantum_j": 1e-3,  # NVML counts whole millijoules
    "noise": 0.01,  # kareus.md §5.1: ±1-2 % multiplicative
    "launch_overhead_s": 4e-6,  # [assumption] per-kernel launch gap
    "sync_overhead_s": 10e-6,  # [assumption] event-based stream join at partition end
    "default_comm_sms": 24,  # [assumption] NCCL's channel count on an NVSwitch A100 node
}

A100 = _from_spec(GPU_SPECS["a100"], **_A100_MODEL)
"""A100 SXM4 40GB, the paper's testbed GPU."""

H100 = _from_spec(
    GPU_SPECS["h100"],
    **{
        **_A100_MODEL,
        "hbm_bw_bps": 3.35e12,  # kareus.md §5.4
        "peak_flops": 989e12,  # kareus.md §5.4 dense BF16
        "flops_half": 3.0e9,  # [assumption] scaled with peak
        "link_bw_bps": 360e9,  # [assumption] NVLink4 all-reduce bus bandwidth (450 GB/s/dir raw)
        "sm_link_bw_bps": 360e9 / 25.0,  # [assumption] kareus.md §5.4 "re-calibrate"
        "sm_power_w": GPU_SPECS["h100"].sm_power_w,  # 3.6 W: kareus.md §5.4
        "hbm_power_w": 120.0,  # [assumption]
        "link_power_w": 60.0,  # [assumption]
        "default_comm_sms": 32,  # [assumption]
    },
)
"""H100 SXM5 80GB: unvalidated starting values (kareus.md §5.4 marks most as [D])."""


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


# --------------------------------------------------------------------------------------------
# Repeated work, power-cap throttling and Theorem 1
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Work:
    """A unit of work run back to back: partitions, sequential segments and plain compute.

    Each item is ``(PartitionType, Config)`` (the config's clock is ignored: the run sets it),
    ``(tuple[Segment, ...], sm_count)`` for sequential execution, or ``tuple[Op, ...]``.

    Raises:
        PlanError: On an item of none of these forms (when the work is run).
    """

    items: tuple[object, ...]
    params: OverlapDeviceParams = field(default=A100)

    def trace(self, freq_mhz: float) -> list[tuple[float, float]]:
        """One unit's phases at a (possibly off-grid) clock: ``(duration_s, total_power_w)``."""
        f = _check_freq(freq_mhz, self.params)
        dyn: list[tuple[float, float]] = []
        for item in self.items:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], PartitionType):
                ptype, cfg = item
                if not isinstance(cfg, Config):
                    raise PlanError(f"work item {item!r}: expected (PartitionType, Config)")
                simulate(ptype, cfg, params=self.params)  # validates the slot and SM count
                start = None if cfg.slot is None else ptype.slot_ops[cfg.slot]
                _run(
                    _prepare(ptype.ops, self.params),
                    ptype.comm,
                    start,
                    cfg.sm_count,
                    f,
                    self.params,
                    dyn,
                )
            elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], int):
                sms = _check_sms(item[1], self.params)
                for seg in item[0]:
                    _run(_prepare(seg.ops, self.params), seg.comm, None, sms, f, self.params, dyn)
            elif isinstance(item, tuple) and item and all(isinstance(op, Op) for op in item):
                _run(_prepare(item, self.params), None, None, 1, f, self.params, dyn)
            else:
                raise PlanError(f"cannot run work item {item!r}")
        p_s = self.params.p_static_w
        return [(dt, p + p_s) for dt, p in dyn if dt > 0]

    def at(self, freq_mhz: float) -> tuple[float, float]:
        """``(time_s, energy_j)`` of one unit at a (possibly off-grid) clock."""
        phases = self.trace(freq_mhz)
        return sum(dt for dt, _ in phases), sum(dt * p for dt, p in phases)


WorkLike = Work | Callable[[float], tuple[float, float]]
"""A :class:`Work`, or any ``freq_mhz -> (time_s, energy_j)`` of one unit (constant power)."""


class _Phases:
    """One unit's phases at one clock, for walking through time."""

    __slots__ = ("ends", "powers", "time_s", "energy_j")

    def __init__(self, phases: list[tuple[float, float]]) -> None:
        self.ends: list[float] = []
        self.powers: list[float] = []
        t = e = 0.0
        for dt, p in phases:
            t += dt
            e += dt * p
            self.ends.append(t)
            self.powers.append(p)
        self.time_s = t
        self.energy_j = e

    def energy_between(self, t0: float, dur: float) -> float:
        """Energy from ``t0`` (within the unit) for ``dur`` seconds, wrapping around units."""
        energy = 0.0
        t = t0 % self.time_s
        idx = bisect.bisect_right(self.ends, t)
        left = dur
        n = len(self.ends)
        while left > 1e-15:
            if idx >= n:
                idx, t = 0, 0.0
            step = min(self.ends[idx] - t, left)
            energy += self.powers[idx] * step
            left -= step
            t += step
            if t >= self.ends[idx] - 1e-15:
                idx += 1
        return energy


def _phases_fn(work: WorkLike) -> Callable[[float], _Phases]:
    cache: dict[float, _Phases] = {}

    def at(freq_mhz: float) -> _Phases:
        if freq_mhz not in cache:
            if isinstance(work, Work):
                cache[freq_mhz] = _Phases(work.trace(freq_mhz))
            else:
                t, e = work(freq_mhz)
                cache[freq_mhz] = _Phases([(t, e / t)])
        return cache[freq_mhz]

    return at


@dataclass(frozen=True, slots=True, kw_only=True)
class CappedRun:
    """A power-capped run.

    Attributes:
        time_s: Duration.
        energy_j: Total energy.
        work_units: Units of work completed (fractional).
        avg_freq_mhz: Time-weighted average clock (off the supported grid in general).
        avg_power_w: Average power.
        freq_trace_mhz: Clock in each control period.
        power_trace_w: Average power in each control period.
        period_s: Control period.
    """

    time_s: float
    energy_j: float
    work_units: float
    avg_freq_mhz: float
    avg_power_w: float
    freq_trace_mhz: tuple[float, ...]
    power_trace_w: tuple[float, ...]
    period_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LockedRun:
    """A run at one locked clock.

    Attributes:
        time_s: Duration.
        energy_j: Total energy.
        work_units: Units of work completed.
        freq_mhz: The clock (as given: off-grid clocks are allowed, see :func:`run_locked`).
        avg_power_w: Average power.
    """

    time_s: float
    energy_j: float
    work_units: float
    freq_mhz: float
    avg_power_w: float


class _Throttle:
    """The power-cap controller: steps the clock by one grid step per control period."""

    def __init__(self, params: OverlapDeviceParams, f_lock: float, cap_w: float) -> None:
        self.params = params
        self.f_lock = f_lock
        self.cap_w = cap_w
        self.freq_mhz = f_lock
        self.pos = 0.0  # position within the current unit, as a fraction of it
        self._window: deque[tuple[float, float]] = deque()
        self._win_t = 0.0
        self._win_e = 0.0

    def run(
        self,
        phases: Callable[[float], _Phases],
        duration_s: float,
        sink: Callable[[float, float, float], None],
    ) -> float:
        """Run for ``duration_s``; ``sink(dt, energy, freq)`` per period. Returns work units."""
        p = self.params
        units = 0.0
        done = 0.0
        while done < duration_s - 1e-12:
            dt = min(p.cap_period_s, duration_s - done)
            f = self.freq_mhz
            ph = phases(f)
            e = ph.energy_between(self.pos * ph.time_s, dt)
            units += dt / ph.time_s
            self.pos = (self.pos + dt / ph.time_s) % 1.0
            done += dt
            sink(dt, e, f)
            self._window.append((dt, e))
            self._win_t += dt
            self._win_e += e
            while self._win_t - self._window[0][0] >= p.cap_window_s - 1e-12:
                old_t, old_e = self._window.popleft()
                self._win_t -= old_t
                self._win_e -= old_e
            power = self._win_e / self._win_t
            if power > self.cap_w:
                self.freq_mhz = max(p.min_freq_mhz, f - p.freq_step_mhz)
            elif power < self.cap_w - p.cap_margin_w:
                self.freq_mhz = min(self.f_lock, f + p.freq_step_mhz)
        return units


def run_capped(
    work: WorkLike,
    freq_lock_mhz: float,
    power_cap_w: float | None = None,
    duration_s: float = 2.0,
    *,
    params: OverlapDeviceParams = A100,
) -> CappedRun:
    """Repeat ``work`` for ``duration_s`` at lock ``freq_lock_mhz`` under a power cap.

    Power follows the work's phases (a GEMM overlapped with a collective draws more than a norm).
    Every control period the average power over the trailing window is compared with the cap
    (default: the device's TDP): above it the clock drops one step; below ``cap − margin`` it
    rises one step toward the lock (kareus.md §5.1 "Power cap"). The window's lag makes the clock
    oscillate around the clock whose power meets the cap. Work progresses at the instantaneous
    clock's rate (its position within a unit is kept as a fraction of the unit).

    Raises:
        PlanError: On a clock outside the device range or a non-positive duration or cap.
    """
    f_lock = _check_freq(freq_lock_mhz, params)
    cap = params.power_cap_w if power_cap_w is None else float(power_cap_w)
    if not (cap > 0 and duration_s > 0):
        raise PlanError(f"power cap and duration must be positive, got {cap} W, {duration_s} s")
    freqs: list[float] = []
    powers: list[float] = []
    totals = [0.0, 0.0]  # energy, ∫f dt

    def sink(dt: float, e: float, f: float) -> None:
        totals[0] += e
        totals[1] += f * dt
        freqs.append(f)
        powers.append(e / dt)

    units = _Throttle(params, f_lock, cap).run(_phases_fn(work), float(duration_s), sink)
    return CappedRun(
        time_s=float(duration_s),
        energy_j=totals[0],
        work_units=units,
        avg_freq_mhz=totals[1] / duration_s,
        avg_power_w=totals[0] / duration_s,
        freq_trace_mhz=tuple(freqs),
        power_trace_w=tuple(powers),
        period_s=params.cap_period_s,
    )


def run_locked(
    work: WorkLike,
    freq_mhz: float,
    work_units: float | None = None,
    *,
    duration_s: float | None = None,
    params: OverlapDeviceParams = A100,
) -> LockedRun:
    """Run ``work`` at a constant clock: ``work_units`` of it, or for ``duration_s``.

    The clock may be off the 15 MHz grid (e.g. a capped run's average, to test Theorem 1 exactly);
    round it to :attr:`OverlapDeviceParams.supported_freqs_mhz` yourself for a lockable value.

    Raises:
        PlanError: Unless exactly one of ``work_units`` and ``duration_s`` is positive, or on a
            clock outside the device range.
    """
    f = _check_freq(freq_mhz, params)
    if (work_units is None) == (duration_s is None):
        raise PlanError("run_locked needs exactly one of work_units and duration_s")
    ph = _phases_fn(work)(f)
    t_unit, e_unit = ph.time_s, ph.energy_j
    if work_units is not None:
        if work_units <= 0:
            raise PlanError(f"work_units must be positive, got {work_units}")
        units = float(work_units)
    else:
        assert duration_s is not None
        if duration_s <= 0:
            raise PlanError(f"duration_s must be positive, got {duration_s}")
        units = duration_s / t_unit
    time_s = units * t_unit
    energy = units * e_unit
    return LockedRun(
        time_s=time_s, energy_j=energy, work_units=units, freq_mhz=f, avg_power_w=energy / time_s
    )


# --------------------------------------------------------------------------------------------
# The evaluator: thermally stable protocol in virtual time
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Piece:
    """A stretch of constant non-static power.

    Start time, duration, non-static power, start temperature and cumulative energy at start.
    """

    t0: float
    dur: float
    p0: float
    theta0: float
    e0: float


class SimulatedOverlapEvaluator:
    """Measures partitions on a simulated GPU with the thermally stable protocol, in virtual time.

    Each evaluation locks the clock and idles ``settle_s``, runs the work for ``warmup_s``, then
    for ``window_s`` while an NVML-like counter (published every 100 ms, whole millijoules) is
    read at the window's edges, then idles ``cooldown_s``. Temperature follows
    ``C·dθ/dt = P − (θ − θ_amb)/R`` throughout (exactly, piece by piece) and static power rises
    with it; energy carries multiplicative noise. Without cooldown, the next candidate starts hot:
    measurements then depend on evaluation order.

    Args:
        params: Device parameters.
        protocol: Measurement durations.
        noise: Relative standard deviation of the energy noise (time gets half of it).
        seed: Seed of the noise generator (results are deterministic given it).
        thermal: Static power rises with temperature (off: constant ``p_static_w``).
        power_cap_w: Power limit; ``None``: no throttling (locked clocks never hit a cap).
        freqs_mhz: Clocks the search may use (default 900-1410 MHz in 30 MHz steps); any clock
            on the device's grid can still be evaluated.
    """

    def __init__(
        self,
        params: OverlapDeviceParams = A100,
        *,
        protocol: MeasureProtocol | None = None,
        noise: float = 0.01,
        seed: int = 0,
        thermal: bool = True,
        power_cap_w: float | None = None,
        freqs_mhz: Sequence[float] | None = None,
    ) -> None:
        if not (math.isfinite(noise) and 0 <= noise < 0.5):
            raise PlanError(f"noise must be a relative standard deviation in [0, 0.5), got {noise}")
        if power_cap_w is not None and not power_cap_w > 0:
            raise PlanError(f"power_cap_w must be positive, got {power_cap_w}")
        self._params = params
        self._protocol = protocol if protocol is not None else MeasureProtocol()
        self._noise = float(noise)
        self._rng = np.random.default_rng(seed)
        self._thermal = bool(thermal)
        self._cap = power_cap_w
        if freqs_mhz is None:
            top = params.max_freq_mhz
            lo = max(params.knee_freq_mhz, params.min_freq_mhz)
            count = int((top - lo) // 30) + 1
            freqs = [top - 30.0 * i for i in range(count)]
        else:
            freqs = [self._grid(f) for f in freqs_mhz]
        if not freqs:
            raise PlanError("freqs_mhz must not be empty")
        self._freqs = tuple(sorted(set(freqs)))
        self._now_s = 0.0
        self._theta = params.ambient_c
        self._energy_j = 0.0
        self._pieces: deque[_Piece] = deque(maxlen=4096)
        self._evaluations = 0
        self._phases: Callable[[float], _Phases] = _phases_fn(lambda f: (1.0, 0.0))

    # ---- the Evaluator protocol ---------------------------------------------------------

    @property
    def p_static_w(self) -> float:
        """Static power the planner subtracts (the device's ``p_static_w``)."""
        return self._params.p_static_w

    @property
    def freqs_mhz(self) -> tuple[float, ...]:
        """Clocks the search uses, ascending."""
        return self._freqs

    @property
    def params(self) -> OverlapDeviceParams:
        """Device parameters."""
        return self._params

    @property
    def virtual_time_s(self) -> float:
        """Total virtual wall time spent so far (for GPU-hour budgets)."""
        return self._now_s

    @property
    def evaluations(self) -> int:
        """Measurements taken so far."""
        return self._evaluations

    @property
    def temperature_c(self) -> float:
        """Current die temperature."""
        return self._theta

    def evaluate(self, ptype: PartitionType, config: Config) -> Measurement:
        """Measure one execution of ``ptype`` under ``config`` (thermally stable protocol).

        Raises:
            PlanError: On an invalid configuration or a clock off the device's grid.
        """
        f = self._grid(config.freq_mhz)
        simulate(ptype, config, params=self._params)  # validates before time passes
        return self._measure(Work(((ptype, config),), self._params), f)

    def evaluate_sequential(
        self, segments: tuple[Segment, ...], freq_mhz: float, sm_count: int
    ) -> Measurement:
        """Measure ``segments`` run without overlap (compute on all SMs, then each collective)."""
        f = self._grid(freq_mhz)
        _check_sms(sm_count, self._params)
        return self._measure(Work(((tuple(segments), int(sm_count)),), self._params), f)

    def evaluate_compute(self, ops: tuple[Op, ...], freq_mhz: float) -> Measurement:
        """Measure compute ``ops`` alone on all SMs."""
        f = self._grid(freq_mhz)
        return self._measure(Work((tuple(ops),), self._params), f)

    # ---- internals ------------------------------------------------------------------------

    def _grid(self, freq_mhz: float) -> float:
        p = self._params
        f = _check_freq(freq_mhz, p)
        steps = (f - p.min_freq_mhz) / p.freq_step_mhz
        if abs(steps - round(steps)) > 1e-6:
            raise PlanError(
                f"clock {freq_mhz!r} MHz is not a supported clock of the {p.name} "
                f"({p.min_freq_mhz:g}-{p.max_freq_mhz:g} MHz in {p.freq_step_mhz:g} MHz steps)"
            )
        return p.min_freq_mhz + round(steps) * p.freq_step_mhz

    def _static_terms(self) -> tuple[float, float]:
        """Static power as ``a + k·θ``: returns ``(a, k)``."""
        p = self._params
        if not self._thermal:
            return p.p_static_w, 0.0
        k = p.p_static_w * p.static_temp_coeff_per_c
        return p.p_static_w - k * p.static_ref_temp_c, k

    def _advance(self, dur: float, p0: float) -> None:
        """Run ``dur`` seconds with non-static power ``p0`` (exact first-order thermal model)."""
        if dur <= 0:
            return
        self._pieces.append(_Piece(self._now_s, dur, p0, self._theta, self._energy_j))
        theta, energy = self._integrate(p0, self._theta, dur)
        self._theta = theta
        self._energy_j += energy
        self._now_s += dur

    def _integrate(self, p0: float, theta0: float, dur: float) -> tuple[float, float]:
        p = self._params
        a, k = self._static_terms()
        r, c = p.thermal_resistance_c_per_w, p.thermal_capacitance_j_per_c
        base = p0 + a
        b = (k - 1.0 / r) / c
        theta_inf = -(base + p.ambient_c / r) / c / b
        decay = math.exp(b * dur)
        theta = theta_inf + (theta0 - theta_inf) * decay
        energy = (base + k * theta_inf) * dur + k * (theta0 - theta_inf) * (decay - 1.0) / b
        return theta, energy

    def _true_energy_at(self, t: float) -> float:
        for piece in reversed(self._pieces):
            if piece.t0 <= t:
                _, e = self._integrate(piece.p0, piece.theta0, min(t - piece.t0, piece.dur))
                return piece.e0 + e
        return 0.0

    def _counter_j(self) -> float:
        """What an NVML-like counter shows now: the energy at the last update, in quanta."""
        p = self._params
        tick = math.floor(self._now_s / p.energy_update_period_s + 1e-9) * p.energy_update_period_s
        q = p.energy_quantum_j
        return math.floor(self._true_energy_at(tick) / q) * q

    def _run_work(
        self, work: WorkLike, f_lock: float, dur: float, throttle: _Throttle | None
    ) -> tuple[float, float]:
        """Run repeated work for ``dur``; returns ``(units, ∫f dt)``."""
        p = self._params
        if dur <= 0:
            return 0.0, 0.0
        if throttle is None:
            ph = _phases_fn(work)(f_lock)
            self._advance(dur, ph.energy_j / ph.time_s - p.p_static_w)
            return dur / ph.time_s, f_lock * dur
        f_int = [0.0]

        def sink(dt: float, e: float, f: float) -> None:
            # The throttle sees static power at the reference; the die sees it at θ.
            self._advance(dt, e / dt - p.p_static_w)
            f_int[0] += f * dt

        units = throttle.run(self._phases, dur, sink)
        return units, f_int[0]

    def _measure(self, work: WorkLike, f_lock: float) -> Measurement:
        p, proto = self._params, self._protocol
        self._phases = _phases_fn(work)
        throttle = None if self._cap is None else _Throttle(p, f_lock, self._cap)
        wall0 = self._now_s
        self._advance(proto.settle_s, 0.0)  # locked and idle: static power only
        self._run_work(work, f_lock, proto.warmup_s, throttle)
        start_temp = self._theta
        c0 = self._counter_j()
        units, f_int = self._run_work(work, f_lock, proto.window_s, throttle)
        c1 = self._counter_j()
        self._advance(proto.cooldown_s, 0.0)
        self._evaluations += 1
        time_s = proto.window_s / units
        energy_j = (c1 - c0) / units
        if self._noise > 0:
            energy_j *= 1.0 + self._noise * float(self._rng.standard_normal())
            time_s *= 1.0 + 0.5 * self._noise * float(self._rng.standard_normal())
        return Measurement(
            time_s=time_s,
            energy_j=energy_j,
            p_static_w=p.p_static_w,
            wall_s=self._now_s - wall0,
            avg_freq_mhz=f_int / proto.window_s,
            start_temp_c=start_temp,
        )
