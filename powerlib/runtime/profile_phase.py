"""The session's profile phase: a frequency sweep that times and meters every instruction.

:class:`ProfilePhase` holds everything profiling needs and nothing else: the energy meter, the
sweep (``powerlib.profiling.sweep``), the recorder, the gaps between instructions, the order the
loop ran, and the stop vote the ranks take at the end of every frequency block. The session
hands it the instruction hooks while it profiles; when the sweep is over it resets the clocks and
passes the payload for rank 0 (:mod:`powerlib.runtime.planning_step`) to ``on_finished``.

Every instruction's time is read after a device sync, its energy is a counter delta (or
integrated power, when the device has no counter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from powerlib.control import ControlSession
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError
from powerlib.profiling.meter import EnergyMeter
from powerlib.profiling.sweep import FrequencySweep, ProfileRecorder, SweepConfig
from powerlib.progress import Progress
from powerlib.runtime.coordination import Coordinator, Future
from powerlib.runtime.planning_step import rows_to_payload

__all__ = ["ProfileConfig", "ProfilePhase"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileConfig:
    """How the session profiles (checked when it is made, before any device is opened).

    Attributes:
        freqs_mhz: Candidate clocks; ``None`` (or empty): every supported clock, top down.
        warmup_iterations: Discarded iterations at the highest frequency.
        settle_iterations: Discarded iterations after each clock change.
        iterations_per_freq: Measured iterations per frequency.
        stop_after_rises: Stop the sweep after this many frequencies of rising energy.
    """

    freqs_mhz: tuple[float, ...] | None = None
    warmup_iterations: int = 2
    settle_iterations: int = 1
    iterations_per_freq: int = 2
    stop_after_rises: int = 3

    def __post_init__(self) -> None:
        if self.freqs_mhz is not None:
            object.__setattr__(self, "freqs_mhz", tuple(self.freqs_mhz) or None)
        self.sweep_config((1.0,))  # validate now, not at the with line

    def sweep_config(self, supported_mhz: Sequence[float]) -> SweepConfig:
        """The sweep over :attr:`freqs_mhz`, or over ``supported_mhz`` when none were given."""
        return SweepConfig(
            freqs_mhz=self.freqs_mhz or tuple(supported_mhz),
            warmup_iterations=self.warmup_iterations,
            settle_iterations=self.settle_iterations,
            iterations_per_freq=self.iterations_per_freq,
            stop_after_rises=self.stop_after_rises,
        )


class ProfilePhase:
    """Sweeps the clocks from high to low and records every instruction of this rank.

    Args:
        config: The profile settings.
        stage: This rank's pipeline stage.
        device: The profiled device.
        control: Journals every clock change.
        coordinator: Carries the ranks' stop vote.
        clock: Time source in seconds.
        sync: Waits for the device before a time is read.
        idle_power_w: The device's power before the session changed anything.
        progress: Where progress lines go.
        on_finished: Called once with the payload for rank 0 when the sweep is over.
        on_refused: Called with a reason when the device refuses a clock change.

    Raises:
        InvalidArgumentError: The device cannot lock its SM clock, or a candidate clock is not
            one it supports.
    """

    phase = "profile"

    def __init__(
        self,
        config: ProfileConfig,
        *,
        stage: int,
        device: Device,
        control: ControlSession,
        coordinator: Coordinator,
        clock: Callable[[], float],
        sync: Callable[[], None],
        idle_power_w: float | None,
        progress: Progress,
        on_finished: Callable[[dict[str, Any]], None],
        on_refused: Callable[[str], None],
    ) -> None:
        supported = device.info.supported_sm_freqs_mhz
        if not supported:
            raise InvalidArgumentError(
                f"{device.info.name} cannot lock its SM clock, so it cannot be profiled",
                device=device.device_id,
            )
        sweep_config = config.sweep_config(supported)
        for f in sweep_config.freqs_mhz:
            device.validate_sm_clocks(f)
        self._stage = stage
        self._device = device
        self._control = control
        self._coordinator = coordinator
        self._clock = clock
        self._sync = sync
        self._idle_power_w = idle_power_w
        self._progress = progress
        self._on_finished = on_finished
        self._on_refused = on_refused
        self.meter = EnergyMeter(device, clock=clock)
        self.sweep = FrequencySweep(sweep_config)
        self.recorder = ProfileRecorder()
        self._sample_counts: dict[tuple[str, float], int] = {}
        self._open: tuple[str, float, float] | None = None
        self._last_end: tuple[float, float] | None = None
        self._iter_energy = 0.0
        self._vote: Future | None = None
        self._locked: float | None = None
        self._order_now: list[tuple[int, int, str]] = []
        self._recorded_order: list[tuple[int, int, str]] = []
        self.position = 0
        """Instructions begun in this iteration."""
        progress.say(
            f"profiling {len(sweep_config.freqs_mhz)} frequencies, {sweep_config.freqs_mhz[0]:g}"
            f"-{sweep_config.freqs_mhz[-1]:g} MHz, up to {sweep_config.max_iterations} iterations"
            + (" (energy integrated from power)" if self.meter.integrated else "")
        )

    @property
    def wants_start(self) -> bool:
        """The ranks' stop vote is pending: the next begin must resolve it first."""
        return self._vote is not None

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """An instruction starts: note the time, the energy and the gap since the last one."""
        self._sync()
        t = self._clock()
        e = self.meter.read_j(t)
        if self._last_end is not None:
            self.recorder.add_gap(t - self._last_end[0], e - self._last_end[1])
        self._open = (kind, t, e)
        self._order_now.append((chunk, microbatch, kind))
        self.position += 1

    def end(self) -> None:
        """The open instruction ends: record its time and energy while the sweep measures."""
        if self._open is None:
            return
        self._sync()
        t = self._clock()
        e = self.meter.read_j(t)
        kind, t0, e0 = self._open
        self._open = None
        self._last_end = (t, e)
        sweep = self.sweep
        if sweep.measuring:
            freq = sweep.freq_mhz
            self.recorder.add(kind, freq, t - t0, e - e0)
            self._sample_counts[(kind, freq)] = self._sample_counts.get((kind, freq), 0) + 1
            self._iter_energy += e - e0

    def step(self) -> None:
        """The iteration ended: record it, and vote at the end of a frequency block."""
        sweep = self.sweep
        self._recorded_order, self._order_now = self._order_now, []
        if sweep.measuring:
            self.recorder.add_iteration(sweep.freq_mhz, self._iter_energy)
        if sweep.block_complete_after_this():
            stop = False
            rules = sweep.config.stop_after_rises
            if not sweep.warming_up and rules:
                rises = self.recorder.energy_rose(sweep.config.freqs_mhz, sweep.freq_mhz)
                stop = rises >= rules
            self._vote = self._coordinator.all_agree(stop)
        else:
            sweep.advance()
        self._iter_energy = 0.0
        self.position = 0
        self._open = None
        self._last_end = None

    def start_iteration(self) -> None:
        """Resolve the stop vote (when every rank has voted) and lock the iteration's clock."""
        sweep = self.sweep
        if self._vote is not None:
            stop = self._vote()
            if stop is None:
                return  # not every rank has voted yet; retried by the next call
            self._vote = None
            before = sweep.freq_mhz
            sweep.advance(bool(stop))
            if sweep.finished:
                if stop:
                    self._progress.say(
                        f"energy per iteration rose for {sweep.config.stop_after_rises} "
                        f"frequencies in a row (down to {before:g} MHz); sweep stopped"
                    )
                self._finish()
                return
            num, total = sweep.position
            self._progress.say(f"profiling at {sweep.freq_mhz:g} MHz ({num}/{total})")
        if self._locked != sweep.freq_mhz:
            if not self._control.apply_sm_clocks(self._device, sweep.freq_mhz):
                self._on_refused("the device refused a clock change while profiling")
                return
            self._locked = sweep.freq_mhz

    def close(self) -> None:
        """Release the meter (its power sampler, when energy is integrated)."""
        self.meter.close()

    def _finish(self) -> None:
        self._control.reset_sm_clocks(self._device)
        self._locked = None
        self._on_finished(
            {
                "stage": self._stage,
                "rows": rows_to_payload(self.recorder.rows(self._stage)),
                "gap_time_s": self.recorder.gap_time_s,
                "gap_energy_j": self.recorder.gap_energy_j,
                "order": [list(k) for k in self._recorded_order],  # what the loop really ran
                "idle_power_w": self._idle_power_w,
                # how finely the energy counter moved, for the planner's resolution check
                "counter": self.meter.resolution().to_json(),
                "samples": [[k, f, n] for (k, f), n in self._sample_counts.items()],
            }
        )
