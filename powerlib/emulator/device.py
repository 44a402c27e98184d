"""Table-driven emulated GPUs in virtual time (docs/perseus.md §5.5, docs/kareus.md §5.1).

An :class:`EmulatedDevice` runs one pipeline stage. Its instructions take the time and energy a
*profile table* gives for the clock in force, so a plan's realized cost is what the profile says
it is, plus what the table cannot know: a clock change lands ``switch_latency_s`` after it is
requested (the old clock runs meanwhile), the device draws ``p_block_w`` whenever it is not
computing, its energy counter only moves every ``counter_period_s``, and optional multiplicative
noise perturbs every execution. Unlocked, it runs at its highest clock (GPU boost under load).

It implements the :class:`~powerlib.device.Device` contract, so sessions and the control layer
drive it exactly as they drive a real GPU.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping, Sequence

from powerlib.config import Settings
from powerlib.device import (
    Backend,
    Capabilities,
    Device,
    DeviceInfo,
    DeviceKind,
    PowerState,
    ProbeResult,
)

__all__ = ["EmulatedBackend", "EmulatedDevice", "VirtualTime"]

Table = Mapping[str, Mapping[float, tuple[float, float]]]  # kind -> freq -> (time_s, energy_j)


class VirtualTime:
    """The emulator's clock; every emulated device and session reads it."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        """The current virtual time in seconds."""
        return self.now_s


class EmulatedDevice(Device):
    """One emulated GPU running one stage's instructions from a profile table.

    Args:
        index: Device index (= stage).
        table: ``table[kind][freq_mhz] = (time_s, energy_j)`` at that locked clock.
        clock: The shared virtual time.
        p_block_w: Power while not computing.
        switch_latency_s: Delay between a clock request and its effect.
        counter_period_s: Update period of the energy counter (0: exact).
        noise: Standard deviation of the multiplicative noise on time and energy (0: none).
        seed: Noise seed.
        name: Marketing name.
    """

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
    ) -> None:
        freq_sets = [set(by_freq) for by_freq in table.values()]
        if not freq_sets or not all(freq_sets):
            raise ValueError("the table needs at least one frequency per kind")
        common = set.intersection(*freq_sets)
        freqs = tuple(sorted(common))
        if not freqs:
            raise ValueError("the instruction kinds share no frequency")
        super().__init__(
            DeviceInfo(
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
                    has_temperature=False,
                ),
                is_simulated=True,
            )
        )
        self._table = {k: dict(v) for k, v in table.items()}
        self._clock = clock
        self.p_block_w = p_block_w
        self.switch_latency_s = switch_latency_s
        self.counter_period_s = counter_period_s
        self.noise = noise
        self._rng = random.Random(seed)
        self._locked: float | None = None
        # clock timeline: (effective time, frequency); None = unlocked (max)
        self._switch_t: list[float] = [-math.inf]
        self._switch_f: list[float | None] = [None]
        # cumulative energy, piecewise linear: breakpoints (t, energy, power from t on)
        self._bp_t: list[float] = [0.0]
        self._bp_e: list[float] = [0.0]
        self._bp_p: list[float] = [p_block_w]
        self.switches = 0

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

    def execute(
        self, kind: str, start_s: float
    ) -> tuple[float, float, list[tuple[float, float, float]]]:
        """Run one instruction from ``start_s``.

        Returns:
            ``(end_s, energy_j, segments)``; each segment is ``(start_s, end_s, freq_mhz)``.
        """
        by_freq = self._table[kind]
        if self.noise:
            t_factor = max(0.5, 1.0 + self._rng.gauss(0.0, self.noise))
            e_factor = max(0.5, 1.0 + self._rng.gauss(0.0, self.noise))
        else:
            t_factor = e_factor = 1.0
        t = start_s
        remaining = 1.0
        energy = 0.0
        segments = []
        while True:
            f = self.freq_at(t)
            j = bisect.bisect_right(self._switch_t, t)
            next_switch = self._switch_t[j] if j < len(self._switch_t) else math.inf
            time_f, energy_f = by_freq[f]
            time_f *= t_factor
            power = energy_f * e_factor / time_f
            self._mark(t, power)
            done = t + remaining * time_f
            if done <= next_switch:
                energy += power * (done - t)
                segments.append((t, done, f))
                t = done
                break
            remaining -= (next_switch - t) / time_f
            energy += power * (next_switch - t)
            segments.append((t, next_switch, f))
            t = next_switch
        self._mark(t, self.p_block_w)
        return t, energy, segments

    # -- the Device contract ---------------------------------------------------------------------

    def _read_state(self) -> PowerState:
        now = self._clock()
        if self.counter_period_s > 0:
            counted = math.floor(now / self.counter_period_s) * self.counter_period_s
        else:
            counted = now
        i = max(bisect.bisect_right(self._bp_t, now) - 1, 0)
        return PowerState(
            device_id=self.device_id,
            timestamp_s=now,
            power_w=self._bp_p[i],
            energy_j=self.energy_at(counted),
            sm_freq_mhz=self.freq_at(now),
            power_limit_w=None,
            temperature_c=None,
            locked_sm_freqs_mhz=None if self._locked is None else (self._locked, self._locked),
        )

    def _schedule(self, freq: float | None) -> None:
        t = self._clock() + self.switch_latency_s
        # a newer request overrides the ones that have not landed yet
        while len(self._switch_t) > 1 and self._switch_t[-1] >= t:
            self._switch_t.pop()
            self._switch_f.pop()
        if self._switch_f[-1] != freq:
            self._switch_t.append(t)
            self._switch_f.append(freq)
            self.switches += 1

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
