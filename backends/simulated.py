"""Simulated GPUs with a physical model: the backend CI, the demo and the emulator run on.

Never chosen by ``auto``: select it with ``POWERLIB_BACKEND=simulated``. Pick the model and count
with ``POWERLIB_SIM_MODEL`` (``a100``, ``h100``, ``a40``) and ``POWERLIB_SIM_GPUS``.

The model: clocks, voltage, power and time from the equations of
:mod:`powerlib.backends.simulated_model` (parameters per GPU in
:data:`powerlib.gpu_specs.GPU_SPECS`, each number cited), the power cap as a clock throttled to
fit under the limit, and besides:

* **Temperature.** First-order thermal model ``C·dθ/dt = P − (θ − θ_amb)/R``.
* **Energy counter.** The exact integral of power over time, published like NVML's counter: it
  updates every ``energy_update_period_s`` (``POWERLIB_SIM_ENERGY_PERIOD_S``) and counts whole
  millijoules.

What NVML adds besides (issue 32; the emulator models the same, :mod:`powerlib.emulator.device`):

* **Clock-change latency.** A lock or reset changes the setting (``locked_sm_freqs_mhz``) at
  once, like NVML's applied clocks, but the running clock (``sm_freq_mhz``), and with it the
  time and power of work, changes when the request lands: ``switch_latency_s · U(1 − spread,
  1 + spread)`` later (model defaults 0.02 s and 0.5, docs/peers.md §4.3 "settle 5–50 ms";
  ``POWERLIB_SIM_SWITCH_LATENCY_S``, ``POWERLIB_SIM_LATENCY_SPREAD``). Each draw is keyed by the
  seed, the device and the request's number, and changes in flight persist with the state, so
  every process sees the same landing. A newer request overrides those that would land after it.
* **Read cost.** Each ``read_state`` takes ``POWERLIB_SIM_READ_COST_S`` (slept on the wall clock,
  advanced on a :class:`VirtualClock`). Default 0, because tests on the wall clock read often;
  NVML's is 2.6–3.1 ms on an H200 (``benchmarks/results/measure_h200.json``).
* **Run-to-run noise.** ``POWERLIB_SIM_NOISE`` (σ, default 0) scales each
  :class:`~powerlib.backends.simulated_model.WorkUnit`'s duration and energy by independent
  ``1 + N(0, σ)`` factors clipped to ±3 σ, drawn from ``POWERLIB_SIM_SEED`` (default 0).

Time is either wall-clock time (the default: state persists in ``POWERLIB_STATE_DIR`` so that
``powerlib set`` is seen by the next ``powerlib status``) or a :class:`VirtualClock` that advances only
when simulated work runs (tests, the emulator): no sleeping, fully deterministic.

On the wall clock the device follows a session's job (:meth:`SimulatedDevice.work_follower`,
:mod:`powerlib.backends._simulated_work`): power follows the work (each instruction runs its
kind's work unit), blocked between instructions (clock up, P2P-blocked power, as in a NCCL wait:
unlocked under load equals all-max), idle once the session ends. Time follows the clock
(``POWERLIB_SIM_TIME_FOLLOWS_CLOCK``, default 1): the host's time is the instruction's time at the maximum
clock, and the end hook sleeps what its clocks add. On a :class:`VirtualClock` nothing follows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar, Protocol

from powerlib.backend import Backend, ProbeResult
from powerlib.backends._simulated_state import (
    SimState,
    load_state,
    prepare_state_dir,
    save_state,
    state_lock,
)
from powerlib.backends._simulated_work import LandingLog, SimulatedWorkFollower
from powerlib.backends.simulated_model import GPU_MODELS, GpuModel, WorkResult, WorkUnit
from powerlib.config import Settings
from powerlib.device import Capabilities, ClockLockState, Device, DeviceInfo, DeviceKind, PowerState
from powerlib.errors import ConfigError, NotSupportedError

__all__ = ["SimulatedBackend", "SimulatedDevice", "VirtualClock", "WallClock"]


class SimClock(Protocol):
    """A source of time in seconds."""

    def now(self) -> float:
        """Current time in seconds."""
        ...


class WallClock:
    """Real time (``time.time()``), shared by every process: what makes persisted state coherent."""

    def now(self) -> float:
        """Current wall-clock time in seconds."""
        return time.time()


class VirtualClock:
    """Time that advances only when told to. Deterministic; nothing sleeps."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def now(self) -> float:
        """Current virtual time in seconds."""
        return self._now_s

    def advance(self, duration_s: float) -> None:
        """Move time forward by ``duration_s`` (≥ 0)."""
        if not (math.isfinite(duration_s) and duration_s >= 0):
            raise ValueError(f"can only advance by a finite, non-negative time, got {duration_s}")
        self._now_s += duration_s


class SimulatedDevice(Device):
    """One simulated GPU. See the module docstring for the model."""

    def __init__(
        self,
        *,
        index: int,
        model: GpuModel,
        clock: SimClock,
        state_path: Path | None,
        read_cost_s: float = 0.0,
        noise: float = 0.0,
        seed: int = 0,
        time_follows_clock: bool = False,
    ) -> None:
        """One simulated GPU.

        Args:
            index: Its index on the backend.
            model: Its model; clock changes land after ``model.switch_latency_s`` (spread by
                ``model.latency_spread``).
            clock: Its time source.
            state_path: Where its state persists (``None``: in memory).
            read_cost_s: What each ``read_state`` takes (slept on a wall clock, advanced on a
                :class:`VirtualClock`).
            noise: Standard deviation of the multiplicative noise on each work unit's duration
                and energy (clipped to ±3 σ).
            seed: Seed of the latency and noise draws.
            time_follows_clock: On a wall clock, a session's instructions last what the clocks
                they ran at make them (:meth:`work_follower`).
        """
        device_id = "GPU-" + str(
            uuid.uuid5(uuid.NAMESPACE_URL, f"powerlib-sim/{model.key}/{index}")
        )
        freqs = model.supported_freqs_mhz
        super().__init__(
            DeviceInfo(
                device_id=device_id,
                index=index,
                name=model.name,
                vendor="nvidia",
                kind=DeviceKind.GPU,
                backend="simulated",
                supported_sm_freqs_mhz=freqs,
                power_limit_range_w=(model.min_power_limit_w, model.max_power_limit_w),
                default_power_limit_w=model.default_power_limit_w,
                capabilities=Capabilities(
                    can_lock_sm_clocks=True,
                    can_set_power_limit=True,
                    can_reset_power_limit=True,
                    has_energy_counter=True,
                    has_power_reading=True,
                    has_temperature=True,
                ),
                is_simulated=True,
            )
        )
        self.model = model
        self.read_cost_s = read_cost_s
        self.noise = noise
        self.time_follows_clock = time_follows_clock
        self._seed = seed
        self._noise_rng = random.Random(f"{seed}:{index}:noise")
        self._clock = clock
        self._state_path = state_path
        self._work: WorkUnit | None = None
        self._power_scale = 1.0  # the running work's energy noise over its time noise
        self._memory_state: SimState | None = None
        self._landings = LandingLog()  # when the running lock changed, as this process saw it
        with self._transaction():  # the device exists, and draws idle power, from now on
            pass

    # -- model state ---------------------------------------------------------------------------

    def _fresh_state(self) -> SimState:
        now = self._clock.now()
        idle_w = self.model.power_w(self.model.min_freq_mhz)
        return SimState(
            locked_mhz=None,
            power_limit_w=self.model.default_power_limit_w,
            energy_j=0.0,
            counter_j=0.0,
            t_s=now,
            temperature_c=self.model.ambient_c + idle_w * self.model.thermal_resistance_c_per_w,
        )

    @contextlib.contextmanager
    def _transaction(self, *, save: bool = True) -> Iterator[SimState]:
        """Load the state, bring it up to now, let the caller change it, save it.

        A read (``save=False``) leaves the file alone: bringing a state up to now is the same
        integral whether it is done once or in pieces, as long as nothing changed in between,
        and every change saves. Reads cost a third as much, which the sampler of
        ``powerlib.measure`` notices.
        """
        if self._state_path is None:
            if self._memory_state is None:
                self._memory_state = self._fresh_state()
            self._advance(self._memory_state)
            yield self._memory_state
            return
        with state_lock(self._state_path):
            state = load_state(self._state_path)
            fresh = state is None
            if state is None:
                state = self._fresh_state()
            self._advance(state)
            yield state
            if save or fresh:  # a missing or unreadable file is rewritten even by a read
                save_state(self._state_path, state)

    def _freq_mhz(self, state: SimState) -> float:
        """The SM clock now: the one the running (landed) lock gives."""
        return self._freq_under(state.running_mhz, state.power_limit_w)

    def _freq_under(self, lock: tuple[float, float] | None, power_limit_w: float) -> float:
        """The SM clock under ``lock``.

        Idle: the lock floor (or the minimum). Loaded: the lock ceiling (or the maximum), reduced
        to fit under the power limit.
        """
        if self._work is None:
            return lock[0] if lock else self.model.min_freq_mhz
        target = lock[1] if lock else self.model.max_freq_mhz
        return self.model.throttled_freq_mhz(target, power_limit_w, self._work)

    def _power_w(self, state: SimState) -> float:
        power_w = self.model.power_w(self._freq_mhz(state), self._work)
        return power_w if self._work is None else power_w * self._power_scale

    def _advance(self, state: SimState) -> None:
        """Bring ``state`` up to now: land the clock changes due, integrate between them."""
        now = self._clock.now()
        while state.pending and state.pending[0][0] <= now:
            land_t, lock = state.pending.pop(0)
            self._integrate(state, land_t)
            state.running_mhz = lock
            self._landings.note(land_t, lock)
        self._integrate(state, now)
        self._landings.note(now, state.running_mhz)  # another process may have changed it

    def _integrate(self, state: SimState, now: float) -> None:
        """Integrate energy and temperature from ``state.t_s`` to ``now`` at the current power."""
        dt = now - state.t_s
        if dt <= 0:
            return
        power_w = self._power_w(state)
        period = self.model.energy_update_period_s
        last_tick = math.floor(now / period) * period if period > 0 else now
        if last_tick > state.t_s:
            exact = state.energy_j + power_w * (last_tick - state.t_s)
            state.counter_j = math.floor(exact * 1e3) / 1e3  # whole millijoules, like NVML
        elif period <= 0:
            state.counter_j = state.energy_j + power_w * dt
        state.energy_j += power_w * dt
        m = self.model
        steady_c = m.ambient_c + power_w * m.thermal_resistance_c_per_w
        tau_s = m.thermal_resistance_c_per_w * m.thermal_capacitance_j_per_c
        state.temperature_c = steady_c + (state.temperature_c - steady_c) * math.exp(-dt / tau_s)
        state.t_s = now

    # -- Device hooks ----------------------------------------------------------------------------

    def _schedule(self, state: SimState, lock: tuple[float, float] | None) -> None:
        """Request ``lock``: the setting changes now, the running clock when the change lands.

        The change lands ``switch_latency_s * U(1 - spread, 1 + spread)`` from now, drawn from
        the seed, the device and the request's number (the same in every process). A newer
        request overrides those in flight that would land after it, as in the emulator
        (:mod:`powerlib.emulator.device`).
        """
        state.locked_mhz = lock
        latency_s = self.model.switch_latency_s
        spread = self.model.latency_spread
        if latency_s > 0 and spread > 0:
            draw = random.Random(f"{self._seed}:{self.index}:latency:{state.switches}")
            latency_s *= draw.uniform(1.0 - spread, 1.0 + spread)
        state.switches += 1
        if latency_s <= 0:
            state.pending.clear()
            state.running_mhz = lock
            self._landings.note(self._clock.now(), lock)
            return
        land_t = self._clock.now() + latency_s
        while state.pending and state.pending[-1][0] >= land_t:
            state.pending.pop()
        if (state.pending[-1][1] if state.pending else state.running_mhz) != lock:
            state.pending.append((land_t, lock))

    def _pay_read_cost(self) -> None:
        """Take ``read_cost_s``: advance a virtual clock by it, sleep it on any other."""
        if self.read_cost_s <= 0:
            return
        if isinstance(self._clock, VirtualClock):
            self._clock.advance(self.read_cost_s)
        else:
            time.sleep(self.read_cost_s)

    def _read_state(self) -> PowerState:
        self._pay_read_cost()  # outside the lock: other processes may use the device meanwhile
        with self._transaction(save=False) as state:
            return PowerState(
                device_id=self.device_id,
                timestamp_s=state.t_s,
                power_w=self._power_w(state),
                energy_j=state.counter_j,
                sm_freq_mhz=self._freq_mhz(state),
                power_limit_w=state.power_limit_w,
                temperature_c=state.temperature_c,
                locked_sm_freqs_mhz=state.locked_mhz,
            )

    def _read_sm_lock(self) -> ClockLockState:
        """The lock setting and the running clock, at no read cost.

        The real runtime reads the lock back on its controller thread, off the training thread's
        path; the emulator drives the controller inline, so charging the read here would charge
        the training thread for work it never does. An in-memory state is read as it stands,
        without bringing it up to now: splitting the energy integral at the read would change
        the emulation's float rounding, and so its figures, for a read that observes nothing.
        """
        if self._state_path is None and self._memory_state is not None:
            state = self._memory_state
            running = state.pending[-1][1] if state.pending else state.running_mhz
            return ClockLockState(
                locked=state.locked_mhz is not None,
                range_mhz=state.locked_mhz,
                running_mhz=self._freq_under(running, state.power_limit_w)
                if not state.pending
                else None,
            )
        with self._transaction(save=False) as state:
            return ClockLockState(
                locked=state.locked_mhz is not None,
                range_mhz=state.locked_mhz,
                running_mhz=self._freq_mhz(state),
            )

    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None:
        with self._transaction() as state:
            self._schedule(state, (min_mhz, max_mhz))

    def _reset_sm_clocks(self) -> None:
        with self._transaction() as state:
            self._schedule(state, None)

    def _set_power_limit(self, power_limit_w: float) -> float:
        watts = float(round(power_limit_w, 3))  # NVML's granularity: whole milliwatts
        with self._transaction() as state:
            state.power_limit_w = watts
        return watts

    def _reset_power_limit(self) -> None:
        with self._transaction() as state:
            state.power_limit_w = self.model.default_power_limit_w

    def details(self) -> dict[str, object]:
        """Model parameters, for ``powerlib status``."""
        m = self.model
        return {
            "model": m.key,
            "num_sms": m.num_sms,
            "mem_freq_mhz": m.mem_freq_mhz,
            "knee_freq_mhz": m.knee_freq_mhz,
            "idle_power_w": round(m.power_w(m.min_freq_mhz), 3),
            "blocked_power_at_max_freq_w": round(m.power_w(m.max_freq_mhz), 3),
            "energy_update_period_s": m.energy_update_period_s,
            "switch_latency_s": m.switch_latency_s,
            "latency_spread": m.latency_spread,
            "read_cost_s": self.read_cost_s,
            "noise": self.noise,
            "state_file": None if self._state_path is None else str(self._state_path),
            "pci_bus_id": f"00000000:{0x10 + self.index:02x}:00.0",  # made up, stable per index
            "minor_number": self.index,
        }

    def exact_energy_j(self) -> float:
        """Ground truth: the exact integral of power since the device's state began (tests).

        The counter ``read_state`` reports is this value as the driver would publish it
        (every ``energy_update_period_s``, whole millijoules).
        """
        with self._transaction(save=False) as state:
            return state.energy_j

    # -- running simulated work ----------------------------------------------------------------

    def work_follower(self) -> SimulatedWorkFollower | None:
        """Makes this GPU follow a session's job (:mod:`powerlib.backends._simulated_work`).

        ``None`` on a :class:`VirtualClock`: the caller runs the work there (:meth:`run`).
        """
        if isinstance(self._clock, VirtualClock):
            return None
        return SimulatedWorkFollower(
            self, now=self._clock.now, time_follows_clock=self.time_follows_clock
        )

    def running_clocks_mhz(self, start_s: float) -> tuple[float, list[tuple[float, float]]]:
        """The running SM clock under the current work (and power limit) from ``start_s`` on.

        Returns:
            ``(now_s, [(from_s, freq_mhz), ...])``: the clock at ``start_s``, each change this
            process saw land since, then each in flight (``from_s`` after now).
        """
        with self._transaction(save=False) as state:
            limit_w = state.power_limit_w
            changes = [*self._landings.since(start_s), *state.pending]
            return state.t_s, [(t, self._freq_under(lock, limit_w)) for t, lock in changes]

    def begin_work(self, work: WorkUnit) -> float:
        """Start running ``work`` now; returns its duration at the clocks it will run at.

        The running clock until each clock change in flight lands, the new one after it; times
        the noise factor when ``noise`` is set. Energy up to now is integrated at the previous
        power first, so the caller can interleave several devices on one shared
        :class:`VirtualClock`.
        """
        return self._begin(work)[0]

    def _draw_noise(self) -> tuple[float, float]:
        """Factors on the next work unit's duration and energy: ``1 + N(0, noise)``, ±3 σ."""
        if self.noise <= 0:
            return 1.0, 1.0
        bound = 3.0 * self.noise
        t_factor, e_factor = (
            1.0 + min(max(self._noise_rng.gauss(0.0, self.noise), -bound), bound) for _ in range(2)
        )
        return t_factor, e_factor

    def _begin(self, work: WorkUnit) -> tuple[float, float, float]:
        """Start ``work``: its duration, its time-weighted mean clock and its power now."""
        t_factor, e_factor = self._draw_noise()
        with self._transaction() as state:
            self._work = work
            self._power_scale = e_factor / t_factor
            start_s = t_s = self._clock.now()
            remaining = 1.0  # share of the work still to run
            freq_time = 0.0  # ∫ clock dt, for the mean clock
            lock = state.running_mhz
            clocks_mhz = set()
            for land_t, next_lock in [*state.pending, (math.inf, None)]:
                freq = self._freq_under(lock, state.power_limit_w)
                clocks_mhz.add(freq)
                full_s = self.model.duration_s(work, freq) * t_factor
                if full_s <= 0 or t_s + remaining * full_s <= land_t:
                    freq_time += freq * remaining * full_s
                    t_s += remaining * full_s
                    break
                span_s = max(land_t - t_s, 0.0)
                remaining -= span_s / full_s
                freq_time += freq * span_s
                t_s += span_s
                lock = next_lock
            duration_s = t_s - start_s
            mean_mhz = freq_time / duration_s if len(clocks_mhz) > 1 else freq
            return duration_s, mean_mhz, self._power_w(state)

    def end_work(self) -> None:
        """Stop running work (the device idles at its current clock)."""
        with self._transaction():
            self._work = None
            self._power_scale = 1.0

    def run(self, work: WorkUnit) -> WorkResult:
        """Run ``work`` to completion on a virtual clock and report what it cost.

        Raises:
            NotSupportedError: The device runs on wall-clock time (nothing can be fast-forwarded).
        """
        if not isinstance(self._clock, VirtualClock):
            raise NotSupportedError(
                "run() needs a virtual clock (POWERLIB_SIM_CLOCK=virtual)",
                device=self.device_id,
                operation="run",
            )
        with self._transaction() as state:
            start_j = state.energy_j
        duration_s, freq_mhz, power_w = self._begin(work)
        self._clock.advance(duration_s)
        with self._transaction() as state:
            energy_j = state.energy_j - start_j
            self._work = None
            self._power_scale = 1.0
        if duration_s > 0:
            power_w = energy_j / duration_s  # the clock may have changed while it ran
        return WorkResult(time_s=duration_s, energy_j=energy_j, freq_mhz=freq_mhz, power_w=power_w)


class SimulatedBackend(Backend):
    """``POWERLIB_SIM_GPUS`` simulated GPUs of model ``POWERLIB_SIM_MODEL``."""

    name: ClassVar[str] = "simulated"
    install_hint: ClassVar[str] = "always available; select it with POWERLIB_BACKEND=simulated"

    def __init__(
        self,
        settings: Settings,
        *,
        clock: SimClock | None = None,
        persist: bool | None = None,
    ) -> None:
        """Open the simulated GPUs.

        Args:
            settings: Model, count, clock kind and state directory.
            clock: Overrides ``settings.sim_clock``; pass a shared :class:`VirtualClock` to step
                several devices together.
            persist: Keep state in ``settings.state_dir`` (default: only with a wall clock).

        Raises:
            ConfigError: Unknown model, or the state directory cannot be used.
        """
        super().__init__(settings)
        model = GPU_MODELS.get(settings.sim_model)
        if model is None:
            raise ConfigError(
                f"unknown simulated GPU model {settings.sim_model!r} (POWERLIB_SIM_MODEL); "
                f"choose one of {', '.join(GPU_MODELS)}"
            )
        if clock is None:
            clock = VirtualClock() if settings.sim_clock == "virtual" else WallClock()
        self.clock = clock
        if settings.sim_energy_period_s is not None:
            model = dataclasses.replace(model, energy_update_period_s=settings.sim_energy_period_s)
        if settings.sim_switch_latency_s is not None:
            model = dataclasses.replace(model, switch_latency_s=settings.sim_switch_latency_s)
        if settings.sim_latency_spread is not None:
            model = dataclasses.replace(model, latency_spread=settings.sim_latency_spread)
        self.model = model
        if persist is None:
            persist = isinstance(clock, WallClock)
        self.persistent = persist  # in-memory devices vanish with the process: nothing to journal
        state_dir = prepare_state_dir(settings.state_dir / "simulated") if persist else None
        self._devices = [
            SimulatedDevice(
                index=i,
                model=model,
                clock=clock,
                state_path=None if state_dir is None else state_dir / f"{model.key}-{i}.json",
                read_cost_s=settings.sim_read_cost_s,
                noise=settings.sim_noise,
                seed=settings.sim_seed,
                time_follows_clock=settings.sim_time_follows_clock,
            )
            for i in range(settings.sim_gpus)
        ]

    @classmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Always available (never chosen by ``auto``)."""
        model = GPU_MODELS.get(settings.sim_model)
        if model is None:
            return ProbeResult(
                backend=cls.name,
                is_available=False,
                reason=f"unknown POWERLIB_SIM_MODEL {settings.sim_model!r}; choose one of {', '.join(GPU_MODELS)}",
            )
        return ProbeResult(
            backend=cls.name,
            is_available=True,
            reason=f"{settings.sim_gpus} x {model.name} (only when selected explicitly)",
            num_devices=settings.sim_gpus,
        )

    def devices(self) -> Sequence[SimulatedDevice]:
        """The simulated GPUs."""
        return self._devices

    def versions(self) -> dict[str, str | None]:
        """The simulated GPU model."""
        return {"model": f"{self.model.key} ({self.model.name})"}

    @property
    def virtual_time(self) -> bool:
        """Time moves only when told to (a :class:`VirtualClock`)."""
        return isinstance(self.clock, VirtualClock)

    @contextlib.contextmanager
    def _busy(self, device: SimulatedDevice) -> Iterator[str]:
        # Half the SMs busy: the top clock fits under every model's default power limit.
        device.begin_work(WorkUnit(time_at_max_s=3600.0, compute_fraction=1.0, sm_activity=0.5))
        try:
            yield "simulated work"
        finally:
            device.end_work()

    def steady_load(self, device: Device) -> contextlib.AbstractContextManager[str] | None:
        """Simulated work on one of this backend's GPUs while the context is open."""
        if not isinstance(device, SimulatedDevice) or device not in self._devices:
            return None
        return self._busy(device)
