"""Parameters of the partition model's simulated GPUs (docs/kareus.md §5.1, §5.4).

The numbers the simulated backend shares come from :data:`powerlib.gpu_specs.GPU_SPECS`; the
partition model's own calibration (HBM and link terms, efficiencies, the power-cap controller,
overheads) is typed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from powerlib.gpu_specs import GPU_SPECS, GpuSpec, VoltageCurve

__all__ = ["A100", "GPUS", "H100", "OverlapDeviceParams"]


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapDeviceParams(VoltageCurve):
    """One GPU model's parameters for the overlap simulator (docs/kareus.md §5.1, §5.4).

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
    smooth_p: float = 3.0  # docs/kareus.md §5.1: p ≈ 3
    comm_smooth_p: float = 8.0  # [assumption] a sharp knee: 24 CTAs reach ~90 % of the link

    @property
    def flops_per_sm_cycle(self) -> float:
        """``π_sm``: peak FLOP per SM per cycle (peak / (N_sm · f_max))."""
        return self.peak_flops / (self.num_sms * self.max_freq_mhz * 1e6)


def _from_spec(spec: GpuSpec, **model: float) -> OverlapDeviceParams:
    """The simulated GPU's shared parameters (:data:`~powerlib.gpu_specs.GPU_SPECS`) plus ``model``.

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

docs/kareus.md §5.4's (380-85-30)/108 subtracts the clock power twice; (400-85-15)/108 ≈ 2.8 W puts a
large GEMM at the TDP. 3.0 W with the HBM and link terms below makes nanobatched overlap at
1410 MHz throttle to ~1350 MHz under 400 W while sequential execution does not (docs/kareus.md §2.4,
§5.3 item 6).
"""

_A100_MODEL: dict[str, float] = {
    "hbm_bw_bps": 1555e9,  # docs/kareus.md §5.4: 1,555 GB/s
    "eta_mem": 0.85,  # [assumption] STREAM-like kernels reach ~1.3 TB/s on A100
    "peak_flops": 312e12,  # docs/kareus.md §5.4: dense BF16 312 TFLOP/s -> π_sm = 2048 FLOP/cycle/SM
    "eta_max": 0.80,  # [assumption] large cuBLAS GEMMs reach ~80 % of peak
    "flops_half": 1.0e9,  # [assumption] a 1 GFLOP kernel runs at half of η_max (docs/kareus.md §5.1)
    "ctas_per_sm": 1.0,  # [assumption] one 128x128-tile CTA per SM; docs/kareus.md §7: one CTA per SM
    "link_bw_bps": 230e9,  # [assumption] NCCL all-reduce bus bandwidth on 8xA100 NVLink3 (300 GB/s/dir raw)
    "sm_link_bw_bps": 230e9
    / 25.0,  # docs/kareus.md §5.1: b_sm ≈ BW_link_eff / 25 (saturates at 20-30 SMs)
    "comm_freq_gamma": 0.3,  # docs/kareus.md §5.1: γ ≈ 0-0.5
    "comm_latency_s": 15e-6,  # [assumption] NVLink collective start-up latency
    "hbm_bytes_per_wire_byte": 2.5,  # docs/kareus.md §5.1: κ ≈ 2-3
    "comm_busy": 0.3,  # docs/kareus.md §5.1: u_comm ≈ 0.2-0.4
    "sm_power_w": _A100_CALIBRATED_SM_POWER_W,  # [assumption, calibrated]
    "hbm_power_w": 160.0,  # [assumption, calibrated] HBM2 + L2/crossbar/LSU traffic at peak bandwidth
    "link_power_w": 90.0,  # [assumption, calibrated] NVLink SerDes + copy engines at full collective rate
    "cap_period_s": 0.01,  # docs/kareus.md §5.1: control period 10-100 ms [assumption]
    "cap_window_s": 0.1,  # [assumption] NVML's power average window; longer than a layer
    "cap_margin_w": 5.0,  # [assumption] hysteresis of the throttle controller
    "static_temp_coeff_per_c": 0.006,  # [assumption] leakage +0.6 %/°C (docs/kareus.md §5.1 P_s(θ))
    "static_ref_temp_c": 30.0,  # [assumption] P_static (85 W) is measured on a cool (~30 °C) GPU
    "energy_quantum_j": 1e-3,  # NVML counts whole millijoules
    "noise": 0.01,  # docs/kareus.md §5.1: ±1-2 % multiplicative
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
        "hbm_bw_bps": 3.35e12,  # docs/kareus.md §5.4
        "peak_flops": 989e12,  # docs/kareus.md §5.4 dense BF16
        "flops_half": 3.0e9,  # [assumption] scaled with peak
        "link_bw_bps": 360e9,  # [assumption] NVLink4 all-reduce bus bandwidth (450 GB/s/dir raw)
        "sm_link_bw_bps": 360e9 / 25.0,  # [assumption] docs/kareus.md §5.4 "re-calibrate"
        "sm_power_w": GPU_SPECS["h100"].sm_power_w,  # 3.6 W: docs/kareus.md §5.4
        "hbm_power_w": 120.0,  # [assumption]
        "link_power_w": 60.0,  # [assumption]
        "default_comm_sms": 32,  # [assumption]
    },
)
"""H100 SXM5 80GB: unvalidated starting values (docs/kareus.md §5.4 marks most as [D])."""

GPUS: dict[str, OverlapDeviceParams] = {"a100": A100, "h100": H100}
"""The simulated GPUs by the name ``powerlib kareus search --gpu`` takes."""
