"""Simulated partition evaluator: a fluid model of one GPU running Kareus's overlap partitions.

The model is docs/kareus.md §5.1 (formulas), calibrated against the phenomena of §5.3 on the real
workloads of :mod:`powerlib.kareus.partition`. It reads the GPUs' clocks, voltage
curve, static power, power cap, thermal constants and energy-counter period from the table the
simulated backend reads (:data:`powerlib.gpu_specs.GPU_SPECS`), so the two simulators agree.

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
(docs/kareus.md §2.1) in virtual time: settle, warm-up, window, cool-down; temperature-dependent static
power; an NVML-like energy counter updated every 100 ms; multiplicative noise.

**Power limit.** A real GPU always has its power limit in force, and so do the evaluator and the
noise-free functions by default (the device's :attr:`~OverlapDeviceParams.power_cap_w`, 400 W
on the A100): the evaluator runs the stepping clock controller of :func:`run_capped` on the power
the die actually draws (static power at its temperature included), so a locked clock whose power
exceeds the limit drops until it fits, the measured time grows and ``avg_freq_mhz`` falls below
the lock; :func:`model` and its siblings run at the clock where the work's average power meets
the limit (:func:`throttled_clock`). :func:`simulate` and :meth:`Work.at` stay the raw physics at
one clock. Theorem 1 (docs/kareus.md §2.4) is reproduced by :func:`run_capped` and
:func:`run_locked`.

The parameters are in :mod:`~powerlib.kareus.sim_params`, the noise-free model in
:mod:`~powerlib.kareus.sim_fluid`, repeated and capped runs in
:mod:`~powerlib.kareus.sim_capping`; this module holds the evaluator and re-exports their
public names. Pure Python + numpy (for the seeded random generator); no sleeping.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from powerlib.errors import PlanError
from powerlib.kareus.evaluator import Measurement, MeasureProtocol
from powerlib.kareus.partition_types import Config, Op, PartitionType, Segment
from powerlib.kareus.sim_capping import (
    Work,
    WorkLike,
    _Phases,
    _phases_fn,
    _Throttle,
)
from powerlib.kareus.sim_fluid import (
    _check_freq,
    _check_sms,
    simulate,
)
from powerlib.kareus.sim_params import A100, OverlapDeviceParams

__all__ = ["SimulatedOverlapEvaluator"]


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
        power_cap_w: Power limit; ``None``: the device's (:attr:`OverlapDeviceParams.power_cap_w`),
            as on a real GPU; ``math.inf``: none (locked clocks never throttle).
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
        cap = params.power_cap_w if power_cap_w is None else float(power_cap_w)
        if not cap > 0:  # also rejects NaN
            raise PlanError(f"power_cap_w must be positive (math.inf: no limit), got {power_cap_w}")
        self._params = params
        self._protocol = protocol if protocol is not None else MeasureProtocol()
        self._noise = float(noise)
        self._rng = np.random.default_rng(seed)
        self._thermal = bool(thermal)
        self._cap = cap
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
        self._window_powers: list[float] = []
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
    def power_cap_w(self) -> float:
        """The power limit in force (``math.inf``: none)."""
        return self._cap

    @property
    def window_powers_w(self) -> tuple[float, ...]:
        """Average power the device drew in each measurement window so far, in order.

        The die's true energy over the window divided by its length: what the power limit acts
        on, without the energy counter's quantisation and the measurement noise.
        """
        return tuple(self._window_powers)

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

    def _advance(self, dur: float, p0: float) -> float:
        """Run ``dur`` seconds with non-static power ``p0`` (exact first-order thermal model).

        Returns the energy drawn, static power at the die's temperature included.
        """
        if dur <= 0:
            return 0.0
        self._pieces.append(_Piece(self._now_s, dur, p0, self._theta, self._energy_j))
        theta, energy = self._integrate(p0, self._theta, dur)
        self._theta = theta
        self._energy_j += energy
        self._now_s += dur
        return energy

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
        """Run repeated work for ``dur``; returns ``(units, ∫(f_lock − f) dt)``.

        The clock is integrated as its shortfall from the lock, so a run that never throttled
        averages exactly the lock.
        """
        p = self._params
        if dur <= 0:
            return 0.0, 0.0
        if throttle is None:
            ph = _phases_fn(work)(f_lock)
            self._advance(dur, ph.energy_j / ph.time_s - p.p_static_w)
            return dur / ph.time_s, 0.0
        shortfall = [0.0]

        def sink(dt: float, e: float, f: float) -> float:
            # ``e`` has static power at the reference temperature; the die draws it at θ, and
            # the controller limits what the die draws.
            shortfall[0] += (f_lock - f) * dt
            return self._advance(dt, e / dt - p.p_static_w)

        units = throttle.run(self._phases, dur, sink)
        return units, shortfall[0]

    def _may_throttle(self, f_lock: float) -> bool:
        """Whether the work can reach the power limit at ``f_lock`` during this measurement.

        A bound, not an estimate: the highest phase power, with static power at the hottest
        temperature the die can reach (now, or the steady state of that phase's power). Work
        below it runs at the lock without the controller (and costs no control steps).
        """
        if math.isinf(self._cap):
            return False
        p = self._params
        peak_dyn = max(self._phases(f_lock).powers) - p.p_static_w
        a, k = self._static_terms()
        theta_hi = self._theta
        if k:
            r, c = p.thermal_resistance_c_per_w, p.thermal_capacitance_j_per_c
            b = (k - 1.0 / r) / c
            theta_hi = max(theta_hi, -(peak_dyn + a + p.ambient_c / r) / c / b)
        return peak_dyn + a + k * theta_hi > self._cap

    def _measure(self, work: WorkLike, f_lock: float) -> Measurement:
        p, proto = self._params, self._protocol
        self._phases = _phases_fn(work)
        throttle = _Throttle(p, f_lock, self._cap) if self._may_throttle(f_lock) else None
        wall0 = self._now_s
        self._advance(proto.settle_s, 0.0)  # locked and idle: static power only
        self._run_work(work, f_lock, proto.warmup_s, throttle)
        start_temp = self._theta
        c0 = self._counter_j()
        e0 = self._energy_j
        units, shortfall = self._run_work(work, f_lock, proto.window_s, throttle)
        self._window_powers.append((self._energy_j - e0) / proto.window_s)
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
            avg_freq_mhz=f_lock - shortfall / proto.window_s,
            start_temp_c=start_temp,
        )
