"""Table-driven emulated GPUs in virtual time (docs/perseus.md §5.5, docs/kareus.md §5.1).

An :class:`EmulatedDevice` runs one pipeline stage. Its instructions take the time and energy a
*profile table* gives for the clock in force, so a plan's realized cost is what the profile says
it is, plus what the table cannot know, modelled on NVML (docs/peers.md §4.2-4.3,
docs/measurement.md §1):

- a clock change lands ``switch_latency_s`` after it is requested (times ``U(1 - spread,
  1 + spread)`` with ``latency_spread``; the old clock runs meanwhile);
- the device draws ``p_block_w`` whenever it is not computing;
- its energy counter publishes every ``counter_period_s`` at phase ``counter_phase_s`` (a read
  returns the last published value); with ``duty < 1`` it only samples power during the last
  ``duty * counter_period_s`` of each period (A100/H100: 25 % of each 100 ms, Yang et al.,
  arXiv 2312.02741) and scales that window's energy by ``1 / duty``;
- with ``power_limit_w`` set (default ``None``), clocks throttle to hold it, on profiled powers
  (:func:`~powerlib.planning.power_budget.throttled_freq_mhz`); waiting draws ``min(p_block_w, it)``;
- every ``read_state()`` is counted; the emulator charges the reads a hook makes on the
  training thread ``read_cost_s`` each (an H200 read costs about 3 ms);
- optional multiplicative noise perturbs every execution (reseedable per iteration for paired
  comparisons): independent per instruction, or structured by a shared
  :class:`~powerlib.emulator.noise_model.NoiseDraws` (per iteration, per microbatch, persistent
  per-GPU offsets, fail-slows; docs/emulator.md "The noise model"); a slow thermal drift
  raises every power by up to ``drift``.

Unlocked, it runs at its highest clock (GPU boost under load). The defaults are the ideal device.

It implements the :class:`~powerlib.device.Device` contract, so sessions and the control layer
drive it exactly as they drive a real GPU.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence

from powerlib.backend import Backend, ProbeResult
from powerlib.config import Settings
from powerlib.device import (
    Capabilities,
    ClockLockState,
    Device,
    DeviceInfo,
    DeviceKind,
    PowerState,
)
from powerlib.emulator.noise_model import NoiseDraws
from powerlib.planning.power_budget import throttled_freq_mhz

__all__ = ["EmulatedBackend", "EmulatedDevice", "VirtualTime"]

Table = Mapping[str, Mapping[float, tuple[float, float]]]  # kind -> freq -> (time_s, energy_j)


class VirtualTime:
    """The emulator's clock with timers: a discrete-event clock every device and session reads.

    Time only moves forward through :meth:`advance_to`, which first runs the timers due (a
    sampler "thread" in virtual time: its reads cost the training thread nothing). ``now_s`` may
    still be assigned directly (tests do); timer ticks it skipped then run late, at ``now_s``.
    """

    def __init__(self) -> None:
        self.now_s = 0.0
        self._timers: list[tuple[float, int, int, _Timer]] = []  # (tick time, seq, k, timer)
        self._seq = itertools.count()

    def __call__(self) -> float:
        """The current virtual time in seconds."""
        return self.now_s

    def every(
        self, period_s: float, callback: Callable[[], None], *, phase_s: float = 0.0
    ) -> Callable[[], None]:
        """Call ``callback`` at every ``phase_s + k * period_s`` (integer ``k``) not before now.

        Returns:
            A function that cancels the timer (idempotent).
        """
        if not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"a timer period must be a positive number of seconds, not {period_s}")
        if not math.isfinite(phase_s):
            raise ValueError(f"a timer phase must be a finite number of seconds, not {phase_s}")
        timer = _Timer(period_s, phase_s, callback)
        k = math.ceil((self.now_s - phase_s) / period_s)
        while phase_s + (k - 1) * period_s >= self.now_s:  # float rounding of the ceil
            k -= 1
        while phase_s + k * period_s < self.now_s:
            k += 1
        self._push(timer, k)

        def cancel() -> None:
            timer.cancelled = True

        return cancel

    def at(self, t_s: float, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once, at ``t_s`` (at the next advance if ``t_s`` is already past).

        Returns:
            A function that cancels the timer (idempotent; nothing once it ran).
        """
        if not math.isfinite(t_s):
            raise ValueError(f"a timer time must be a finite number of seconds, not {t_s}")
        timer = _Timer(0.0, t_s, callback)
        self._push(timer, 0)

        def cancel() -> None:
            timer.cancelled = True

        return cancel

    def next_due_s(self) -> float | None:
        """When the next timer is due (``None``: none is pending)."""
        timers = self._timers  # cancelled ones go
        while timers and timers[0][3].cancelled:
            heapq.heappop(timers)
        return timers[0][0] if timers else None

    def _push(self, timer: _Timer, k: int) -> None:
        tick = timer.phase_s + k * timer.period_s
        heapq.heappush(self._timers, (tick, next(self._seq), k, timer))

    def advance_to(self, t_s: float) -> None:
        """Run every timer tick due by ``t_s`` in time order (``now_s`` = its tick), then stand at ``t_s``.

        Raises:
            ValueError: ``t_s`` is earlier than now, or not finite (time is monotone).
        """
        if not (math.isfinite(t_s) and t_s >= self.now_s):
            raise ValueError(f"virtual time only moves forward: {t_s} is before now ({self.now_s})")
        while self._timers and self._timers[0][0] <= t_s:
            tick, _, k, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self.now_s = max(self.now_s, tick)
            timer.callback()
            if not timer.cancelled and timer.period_s > 0:
                self._push(timer, k + 1)
        self.now_s = t_s


class _Timer:
    """One callback of a :class:`VirtualTime`: periodic, or once (``period_s`` 0)."""

    __slots__ = ("period_s", "phase_s", "callback", "cancelled")

    def __init__(self, period_s: float, phase_s: float, callback: Callable[[], None]) -> None:
        self.period_s, self.phase_s, self.callback = period_s, phase_s, callback
        self.cancelled = False


class _Execution:
    """One instruction as an :class:`EmulatedDevice` runs it: what re-timing it needs."""

    __slots__ = ("kind", "start_s", "t_factor", "e_factor", "end_s", "energy_j", "segments")

    def __init__(self, kind: str, start_s: float, t_factor: float, e_factor: float) -> None:
        self.kind, self.start_s, self.t_factor, self.e_factor = kind, start_s, t_factor, e_factor
        self.end_s = self.energy_j = 0.0
        self.segments: tuple[tuple[float, float, float], ...] = ()


class EmulatedDevice(Device):
    """One emulated GPU running one stage's instructions from a profile table.

    Args:
        index: Device index (= stage).
        table: ``table[kind][freq_mhz] = (time_s, energy_j)`` at that locked clock.
        clock: The shared virtual time.
        p_block_w: Power while not computing.
        switch_latency_s: Mean delay between a clock request and its effect.
        counter_period_s: Publication period of the energy counter (0: exact at every read).
        noise: Standard deviation of the independent multiplicative noise on time and energy
            (0: none).
        seed: Noise seed (the latency draws use a stream of their own, seeded from it).
        name: Marketing name.
        read_cost_s: What one ``read_state()`` costs the thread that makes it (the emulator
            charges a hook's reads to its stage; see :attr:`reads`, :attr:`stall_s`).
        counter_phase_s: The counter publishes at ``counter_phase_s + k * counter_period_s``.
        duty: Share of each counter period, at its end, during which power is sampled (1: all).
        latency_spread: A clock change lands after ``switch_latency_s * U(1 - spread, 1 + spread)``.
        drift: Thermal drift: powers are scaled by ``1 + drift * (1 - exp(-t / drift_tau_s))``.
        drift_tau_s: Time constant of the drift (and of the reported temperature).
        noise_draws: The pipeline's shared structured noise (one object for every device);
            ``None`` or a model without structure: independent factors of ``noise`` only.
    """

    _running: _Execution | None = None  # the last instruction executed (:attr:`execution`)
    retimed = 0
    """Instructions re-timed by a clock change that landed while they ran."""

    def __init__(
        self,
        *,
        index: int,
        table: Table,
        clock: VirtualTime,
        p_block_w: float,
        switch_latency_s: float = 0.0,
        counter_period_s: float = 0.0,
        noise: float = 0.0,
        seed: int = 0,
        name: str = "Emulated GPU",
        read_cost_s: float = 0.0,
        counter_phase_s: float = 0.0,
        duty: float = 1.0,
        latency_spread: float = 0.0,
        drift: float = 0.0,
        drift_tau_s: float = 60.0,
        noise_draws: NoiseDraws | None = None,
    ) -> None:
        freqs = _common_freqs(table)
        _check_knobs(
            counter_period_s=counter_period_s,
            counter_phase_s=counter_phase_s,
            duty=duty,
            read_cost_s=read_cost_s,
            switch_latency_s=switch_latency_s,
            latency_spread=latency_spread,
            noise=noise,
            drift=drift,
            drift_tau_s=drift_tau_s,
        )
        super().__init__(_device_info(index, name, freqs, has_temperature=drift > 0, duty=duty))
        self._table = {k: dict(v) for k, v in table.items()}
        self._clock = clock
        self.p_block_w = p_block_w
        self.switch_latency_s = switch_latency_s
        self.latency_spread = latency_spread
        self.counter_period_s = counter_period_s
        self.counter_phase_s = counter_phase_s
        self.duty = duty
        self.read_cost_s = read_cost_s
        self.noise = noise
        self.drift = drift
        self.drift_tau_s = drift_tau_s
        self._seed = seed
        self._rng = random.Random(seed)
        self.noise_draws = None if noise_draws is None or noise_draws.model.is_iid else noise_draws
        self._noise_key: int | None = None  # the iteration whose shared factors apply
        offsets = (1.0, 1.0) if self.noise_draws is None else self.noise_draws.gpu_offsets(index)
        self.gpu_time_factor, self.gpu_power_factor = offsets
        self._shared_time = self.gpu_time_factor  # iteration x offset x fail-slow, this key
        self._latency_rng = random.Random(f"{seed}:latency")
        self._locked: float | None = None
        # clock timeline: (effective time, frequency); None = unlocked (max)
        self._switch_t: list[float] = [-math.inf]
        self._switch_f: list[float | None] = [None]
        # cumulative energy, piecewise linear: breakpoints (t, energy, power from t on)
        self._bp_t: list[float] = [0.0]
        self._bp_e: list[float] = [0.0]
        self._bp_p: list[float] = [p_block_w]
        # duty < 1: the last publication folded into the counter, (k, published energy)
        self._published: tuple[int, float] = (-1, 0.0)
        self.switches = 0
        self.reads = 0  # read_state() calls, from any thread
        self.stall_s = 0.0  # what the emulator charged this device's hooks for their reads
        self.power_limit_w: float | None = None  # set between iterations: next instruction on

    # -- the model -------------------------------------------------------------------------------

    def freq_at(self, t: float) -> float:
        """The clock in force at virtual time ``t``."""
        i = bisect.bisect_right(self._switch_t, t) - 1
        f = self._switch_f[i]
        return self.info.supported_sm_freqs_mhz[-1] if f is None else f

    def energy_at(self, t: float) -> float:
        """Exact cumulative energy at ``t`` (idle at ``p_block_w`` after the last instruction)."""
        i = bisect.bisect_right(self._bp_t, t) - 1
        i = max(i, 0)
        return self._bp_e[i] + self._bp_p[i] * (t - self._bp_t[i])

    def drift_factor(self, t: float) -> float:
        """The thermal drift's power factor at ``t``: ``1 + drift * (1 - exp(-t / tau))``."""
        if not self.drift:
            return 1.0
        return 1.0 + self.drift * (1.0 - math.exp(-max(t, 0.0) / self.drift_tau_s))

    def counter_at(self, t: float) -> float:
        """What the energy counter reads at ``t``: the value published last, at or before ``t``.

        Publications are at ``counter_phase_s + k * counter_period_s`` (``k >= 0``; nothing is
        published before the first, the counter reads 0). With ``duty == 1`` a publication is the
        exact energy at its time; otherwise it adds the energy of the sampled window (the last
        ``duty * counter_period_s`` before it) divided by ``duty``.
        """
        period = self.counter_period_s
        if period <= 0:
            return self.energy_at(t)
        k = math.floor((t - self.counter_phase_s) / period)
        if k < 0:
            return 0.0
        if self.duty >= 1.0:
            return self.energy_at(self.counter_phase_s + k * period)
        done, energy = self._published
        if k < done:  # a read back in time: fold again from the start
            done, energy = -1, 0.0
        window = self.duty * period
        while done < k:
            done += 1
            t_pub = self.counter_phase_s + done * period
            lo = max(t_pub - window, 0.0)
            energy += (self.energy_at(t_pub) - self.energy_at(lo)) / self.duty
        self._published = (done, energy)
        return energy

    def reseed_noise(self, key: int) -> None:
        """Draw the noise from now on from ``(seed, index, key)`` (paired runs see equal noise).

        With structured noise, ``key`` is also the iteration whose shared factors (per
        iteration and drift, per microbatch, this GPU's fail-slow) apply from now on.
        """
        self._rng = random.Random(f"{self._seed}:{self.index}:{key}")
        draws = self.noise_draws
        if draws is not None:
            self._noise_key = key
            self._shared_time = (
                draws.iteration_factor(key)
                * self.gpu_time_factor
                * draws.fail_slow_factor(self.index, key)
            )

    def _mark(self, t: float, power_w: float) -> None:
        energy = self.energy_at(t)
        if t == self._bp_t[-1]:
            self._bp_e[-1], self._bp_p[-1] = energy, power_w
        else:
            self._bp_t.append(t)
            self._bp_e.append(energy)
            self._bp_p.append(power_w)
        if len(self._bp_t) > 4096:  # reads only look back a few instructions
            del self._bp_t[:2048], self._bp_e[:2048], self._bp_p[:2048]

    def noise_factors(self, kind: str, microbatch: int) -> tuple[float, float]:
        """This execution's multiplicative ``(time, energy)`` noise factors.

        Without structure, independent factors ``1 + noise z``; with it
        (:mod:`powerlib.emulator.noise_model`), time = the key's shared factors x ``1 + noise z``
        and energy = time x this GPU's power offset x ``1 + energy_cv z`` (z in execution order).
        """
        draws = self.noise_draws
        if draws is None:
            if not self.noise:
                return 1.0, 1.0
            t_factor = max(0.5, 1.0 + self._rng.gauss(0.0, self.noise))
            e_factor = max(0.5, 1.0 + self._rng.gauss(0.0, self.noise))
            return t_factor, e_factor
        energy_cv = draws.model.energy_cv
        own_t = max(0.5, 1.0 + self._rng.gauss(0.0, self.noise))
        own_p = max(0.5, 1.0 + self._rng.gauss(0.0, self.noise if energy_cv is None else energy_cv))
        t_factor = self._shared_time * own_t
        if self._noise_key is not None:
            t_factor *= draws.microbatch_factor(self._noise_key, microbatch)
        return t_factor, t_factor * self.gpu_power_factor * own_p

    def execute(
        self, kind: str, start_s: float, *, microbatch: int = 0
    ) -> tuple[float, float, list[tuple[float, float, float]]]:
        """Run one instruction from ``start_s``.

        The clock timeline known now decides it; a change that lands while it still runs
        (requested later, e.g. from a timer) re-times it (:attr:`execution`): the part before
        the landing stands, the rest runs at the new clock. Its powers, and the blocking power
        after it, carry the drift factor of its start and of its end; its time does not drift.
        Its noise comes from :meth:`noise_factors`, drawn once (a re-timing reuses it).

        Returns:
            ``(end_s, energy_j, segments)``; each segment is ``(start_s, end_s, freq_mhz)``.
        """
        t_factor, e_factor = self.noise_factors(kind, microbatch)
        e_factor *= self.drift_factor(start_s)
        run = self._running = _Execution(kind, start_s, t_factor, e_factor)
        self._play(run, start_s)
        return run.end_s, run.energy_j, list(run.segments)

    @property
    def execution(self) -> tuple[float, float, tuple[tuple[float, float, float], ...]] | None:
        """The last instruction run, as re-timed so far: ``(end_s, energy_j, segments)``."""
        run = self._running
        return None if run is None else (run.end_s, run.energy_j, run.segments)

    def _play(self, run: _Execution, cut_s: float) -> None:
        """Run ``run`` from its start on the clock timeline; breakpoints from ``cut_s`` on."""
        by_freq = self._table[run.kind]
        t = run.start_s
        remaining = 1.0
        energy = 0.0
        segments = []
        while True:
            f = self.freq_at(t)
            if self.power_limit_w is not None:  # the clock the power limit lets it run at
                f = throttled_freq_mhz(by_freq, f, self.power_limit_w)
            j = bisect.bisect_right(self._switch_t, t)
            next_switch = self._switch_t[j] if j < len(self._switch_t) else math.inf
            time_f, energy_f = by_freq[f]
            time_f *= run.t_factor
            power = energy_f * run.e_factor / time_f
            done = t + remaining * time_f
            if t >= cut_s or min(done, next_switch) > cut_s:
                self._mark(max(t, cut_s), power)
            if done <= next_switch:
                energy += power * (done - t)
                segments.append((t, done, f))
                t = done
                break
            remaining -= (next_switch - t) / time_f
            energy += power * (next_switch - t)
            segments.append((t, next_switch, f))
            t = next_switch
        p_block, limit = self.p_block_w * self.drift_factor(t), self.power_limit_w
        self._mark(t, p_block if limit is None else min(p_block, limit))
        run.end_s, run.energy_j, run.segments = t, energy, tuple(segments)

    def _retime(self, landing_s: float) -> None:
        """The clocks changed from ``landing_s`` on: re-run the instruction running then.

        What ran before stands (same timeline, same noise); breakpoints after it are rewritten.
        """
        run = self._running
        if run is None or landing_s >= run.end_s:
            return  # it ended before the change lands: untouched
        cut = max(landing_s, run.start_s)
        i = max(bisect.bisect_left(self._bp_t, cut), 1)  # keep the first: energy_at needs one
        del self._bp_t[i:], self._bp_e[i:], self._bp_p[i:]
        self._play(run, cut)
        self.retimed += 1

    # -- the Device contract ---------------------------------------------------------------------

    def _read_state(self) -> PowerState:
        self.reads += 1
        now = self._clock()
        i = max(bisect.bisect_right(self._bp_t, now) - 1, 0)
        temperature = None
        if self.drift > 0:
            temperature = 35.0 + 40.0 * (1.0 - math.exp(-max(now, 0.0) / self.drift_tau_s))
        return PowerState(
            device_id=self.device_id,
            timestamp_s=now,
            power_w=self._bp_p[i],
            energy_j=self.counter_at(now),
            sm_freq_mhz=self.freq_at(now),
            power_limit_w=None,
            temperature_c=temperature,
            locked_sm_freqs_mhz=None if self._locked is None else (self._locked, self._locked),
        )

    def _read_sm_lock(self) -> ClockLockState:
        """The lock setting, at no cost.

        The real runtime reads the lock back on its controller thread, which the emulator does
        not charge (reads on the training thread cost ``read_cost_s``).
        """
        locked = None if self._locked is None else (self._locked, self._locked)
        return ClockLockState(locked=locked is not None, range_mhz=locked)

    def _schedule(self, freq: float | None) -> None:
        latency = self.switch_latency_s
        if self.latency_spread and latency:
            spread = self.latency_spread
            latency *= self._latency_rng.uniform(1.0 - spread, 1.0 + spread)
        t = self._clock() + latency
        # a newer request overrides the ones that have not landed yet (and would land after it)
        changed = False
        while len(self._switch_t) > 1 and self._switch_t[-1] >= t:
            self._switch_t.pop()
            self._switch_f.pop()
            changed = True
        if self._switch_f[-1] != freq:
            self._switch_t.append(t)
            self._switch_f.append(freq)
            self.switches += 1
            changed = True
        if changed:  # the timeline differs from t on: an instruction running then is re-timed
            self._retime(t)

    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None:
        self._locked = max_mhz
        self._schedule(max_mhz)

    def _reset_sm_clocks(self) -> None:
        self._locked = None
        self._schedule(None)

    def _set_power_limit(self, power_limit_w: float) -> float:  # pragma: no cover - not advertised
        raise AssertionError("unreachable: the capability is not advertised")

    def _reset_power_limit(self) -> None:  # pragma: no cover - not advertised
        raise AssertionError("unreachable: the capability is not advertised")


class EmulatedBackend(Backend):
    """The devices of one emulated pipeline (one per stage).

    Not in the registry: the emulator builds it. Nothing outlives the process, so nothing is
    journaled.
    """

    name = "emulator"

    def __init__(self, devices: Sequence[EmulatedDevice], settings: Settings | None = None) -> None:
        super().__init__(settings or Settings())
        self.persistent = False
        self._devices = list(devices)

    @classmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Always available (it needs nothing)."""
        return ProbeResult(
            backend=cls.name, is_available=True, reason="emulated devices", num_devices=0
        )

    def devices(self) -> Sequence[EmulatedDevice]:
        """One device per stage."""
        return self._devices


def _common_freqs(table: Table) -> tuple[float, ...]:
    """The clocks every kind of ``table`` was profiled at, ascending.

    Raises:
        ValueError: A kind without clocks, or no clock common to all kinds.
    """
    freq_sets = [set(by_freq) for by_freq in table.values()]
    if not freq_sets or not all(freq_sets):
        raise ValueError("the table needs at least one frequency per kind")
    freqs = tuple(sorted(set.intersection(*freq_sets)))
    if not freqs:
        raise ValueError("the instruction kinds share no frequency")
    return freqs


def _device_info(
    index: int, name: str, freqs: tuple[float, ...], *, has_temperature: bool, duty: float = 1.0
) -> DeviceInfo:
    """What an emulated GPU says of itself: clocks lockable, counter and power readable.

    It declares the power-sampling ``duty`` it models, as a real A100/H100's backend declares
    its part's (:attr:`~powerlib.device.DeviceInfo.power_sampling_duty`).
    """
    return DeviceInfo(
        device_id=f"EMU-{index:04d}",
        index=index,
        name=name,
        vendor="emulated",
        kind=DeviceKind.GPU,
        backend="emulator",
        supported_sm_freqs_mhz=freqs,
        power_limit_range_w=None,
        default_power_limit_w=None,
        capabilities=Capabilities(
            can_lock_sm_clocks=True,
            can_set_power_limit=False,
            can_reset_power_limit=False,
            has_energy_counter=True,
            has_power_reading=True,
            has_temperature=has_temperature,
        ),
        is_simulated=True,
        power_sampling_duty=duty,
    )


def _check_knobs(
    *,
    counter_period_s: float,
    counter_phase_s: float,
    duty: float,
    read_cost_s: float,
    switch_latency_s: float,
    latency_spread: float,
    noise: float,
    drift: float,
    drift_tau_s: float,
) -> None:
    """Raise one ``ValueError`` line for the first NVML-model knob out of its range."""
    checks = (
        ("counter_period_s", counter_period_s, counter_period_s >= 0, ">= 0"),
        (
            "counter_phase_s",
            counter_phase_s,
            0 <= counter_phase_s < max(counter_period_s, 1e-300),
            "in [0, counter_period_s) (0 for an exact counter)",
        ),
        ("duty", duty, 0 < duty <= 1, "in (0, 1]"),
        ("read_cost_s", read_cost_s, read_cost_s >= 0, ">= 0"),
        ("switch_latency_s", switch_latency_s, switch_latency_s >= 0, ">= 0"),
        ("latency_spread", latency_spread, 0 <= latency_spread <= 1, "in [0, 1]"),
        ("noise", noise, noise >= 0, ">= 0"),
        ("drift", drift, drift >= 0, ">= 0"),
        ("drift_tau_s", drift_tau_s, drift_tau_s > 0, "> 0"),
    )
    for name, value, ok, want in checks:
        if not (ok and math.isfinite(value)):
            raise ValueError(f"{name} must be {want}, not {value}")
