"""The session's profile phase: a frequency sweep whose energy comes from counter intervals.

:class:`ProfilePhase` holds everything profiling needs and nothing else. Its hooks only record:
``begin`` and ``end`` note the time (the session's clock; on a GPU, the moment a CUDA event on
the compute stream completes, stamped by a waiter thread), ``step`` closes the iteration. No
device synchronize and no driver call runs in a hook: the clock changes go through the
frequency controller, and the device is read by the session's
:class:`~powerlib.measurement.sampler.DeviceSampler`.

Energy is attributed afterwards, the way :mod:`powerlib.measurement` attributes windows: the
sampler's reads locate every counter update in time (:mod:`powerlib.measurement.timeline`),
and :func:`~powerlib.measurement.attribution.solve_powers` solves each (kind, clock)'s power
and the blocking power from which spans and gaps each counter interval covered, each with its
interval (issue 32; docs/measurement.md). The sweep (:mod:`powerlib.profiling.sweep`) ends a
clock's block when its rows resolve, and the ranks vote on it at the end of every measured
iteration.

While warming up, the phase measures the clock-change latency: it alternates the clock at every
other instruction end and times, from the sampler's reads, when each request lands. The plan's
slowdown guard uses the measured figure (docs/measurement.md §8).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from powerlib.device import Device
from powerlib.errors import InvalidArgumentError
from powerlib.measurement.attribution import REST, Spans, solve_powers
from powerlib.measurement.markers import Stamps
from powerlib.measurement.sampler import DeviceSampler
from powerlib.planning.profile import ProfileRow
from powerlib.profiling.sweep import FrequencySweep, ProfileRecorder, SweepConfig
from powerlib.progress import Progress
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import Coordinator, Future
from powerlib.runtime.planning_step import GIVE_UP_FACTOR, rows_to_payload

__all__ = ["ProfileConfig", "ProfilePhase"]



@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileConfig:
    """How the session profiles (checked when it is made, before any device is opened).

    Attributes:
        freqs_mhz: Candidate clocks; ``None`` (or empty): every supported clock.
        warmup_iterations: Discarded iterations at the highest frequency (the clock-change
            latency is measured there).
        settle_iterations: Discarded iterations after each clock change.
        iterations_per_freq: Measured iterations per frequency, at least.
        max_iterations_per_freq: Measured iterations per frequency, at most.
        target_error: Rows resolve to this (relative half-width of the 95 % interval).
        stop_after_rises: End the coarse pass after this many clocks of rising energy.
        coarse_stride: Every how many candidates the coarse pass visits.
    """

    freqs_mhz: tuple[float, ...] | None = None
    warmup_iterations: int = 2
    settle_iterations: int = 0
    iterations_per_freq: int = 1
    max_iterations_per_freq: int = 4
    target_error: float = 0.02
    stop_after_rises: int = 2
    coarse_stride: int = 3

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
            max_iterations_per_freq=self.max_iterations_per_freq,
            target_error=self.target_error,
            stop_after_rises=self.stop_after_rises,
            coarse_stride=self.coarse_stride,
        )


@dataclass(slots=True)
class _Block:
    """One clock's measured iterations."""

    freq_mhz: float
    requested_s: float
    landed_s: float | None = None
    windows: list[tuple[list[float], list[float]]] | None = None
    """Each measured iteration's (start, end) cells; measured from the landing on."""
    iterations: int = 0
    ran_mhz: float | None = None
    temperature_c: float | None = None
    dropped: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "freq_mhz": self.freq_mhz,
            "iterations": self.iterations,
            "ran_mhz": self.ran_mhz,
            "temperature_c": self.temperature_c,
            "dropped": self.dropped,
        }


class ProfilePhase:
    """Sweeps the clocks and attributes every instruction's energy for this rank.

    Args:
        config: The profile settings.
        stage: This rank's pipeline stage.
        device: The profiled device.
        controller: Applies the sweep's clocks (off the training thread when threaded).
        sampler: Reads the device (energy counter, clock, temperature).
        stamps: Times the hooks' points (host clock, or CUDA events completed on the stream).
        coordinator: Carries the ranks' votes.
        clock: Time source in seconds (the sampler's).
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
        controller: FrequencyController,
        sampler: DeviceSampler,
        stamps: Stamps,
        coordinator: Coordinator,
        clock: Callable[[], float],
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
        self._controller = controller
        self.sampler = sampler
        self._stamps = stamps
        self._coordinator = coordinator
        self._clock = clock
        self._idle_power_w = idle_power_w
        self._progress = progress
        self._on_finished = on_finished
        self._on_refused = on_refused
        self.sweep = FrequencySweep(sweep_config)
        self.recorder = ProfileRecorder()
        self._spans: list[tuple[int, str, list[float], list[float]]] = []  # block, kind, cells
        self._blocks: list[_Block] = []
        self._open: tuple[str, list[float]] | None = None
        self._iter_start: list[float] | None = None
        self._vote: Future | None = None
        self._applied_seen = 0
        self._order_now: list[tuple[int, int, str]] = []
        self._recorded_order: list[tuple[int, int, str]] = []
        self._ends = 0
        self._probes: list[tuple[float, float]] = []  # (request time, clock)
        self._probe_freqs = _probe_pair(sweep_config.freqs_mhz)
        self.latency_s: float | None = None
        """The clock-change latency measured while warming up (request to landing)."""
        self.unresolved: str | None = None
        self.position = 0
        """Instructions begun in this iteration."""
        progress.say(
            f"profiling up to {len(sweep_config.freqs_mhz)} clocks, {sweep_config.freqs_mhz[0]:g}"
            f"-{sweep_config.freqs_mhz[-1]:g} MHz, interleaved, each until its energy resolves "
            f"to +-{100 * sweep_config.target_error:g} %"
            + ("" if sampler.has_counter else " (energy integrated from power)")
        )

    @property
    def wants_start(self) -> bool:
        """A vote is pending: the next begin must resolve it first."""
        return self._vote is not None

    # -- hooks: record only ----------------------------------------------------------------------

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """An instruction starts: note the time."""
        t = self._stamps.stamp()
        if self._iter_start is None:
            self._iter_start = t
        self._open = (kind, t)
        self._order_now.append((chunk, microbatch, kind))
        self.position += 1

    def end(self) -> None:
        """The open instruction ends: keep its span (and probe the clock while warming up)."""
        if self._open is None:
            return
        t = self._stamps.stamp()
        kind, t0 = self._open
        self._open = None
        if self.sweep.measuring and self._blocks:
            self._spans.append((len(self._blocks) - 1, kind, t0, t))
        elif self.sweep.warming_up and self._probe_freqs is not None:
            self._ends += 1
            if self._ends % 2 == 0:  # every other end: changes at least one instruction apart
                freq = self._probe_freqs[(self._ends // 2) % 2]
                self._probes.append((self._clock(), freq))
                self._controller.request(freq)

    def step(self) -> None:
        """The iteration ended: close its window and, when a block may end, vote."""
        t = self._stamps.stamp()
        sweep = self.sweep
        self._recorded_order, self._order_now = self._order_now, []
        self._check_refusals()
        measuring = sweep.measuring and bool(self._blocks)
        start = self._iter_start if self._iter_start is not None else t
        if measuring:
            block = self._blocks[-1]
            assert block.windows is not None
            block.windows.append((start, t))
            block.iterations += 1
        was_warming = sweep.warming_up
        if sweep.iteration_ended():
            self._vote = self._coordinator.all_agree(self._block_vote())
        elif was_warming and not sweep.warming_up:
            self._measure_latency()
        self.position = 0
        self._open = None
        self._iter_start = t

    def _windows(self, block: _Block) -> list[tuple[float, float]]:
        """The block's measured windows in seconds: resolved, and after its clock landed."""
        self._land(block)
        if block.landed_s is None:
            return []
        out = []
        for start, end in block.windows or ():
            a, b = max(start[0], block.landed_s), end[0]
            if math.isfinite(a) and math.isfinite(b) and b > a:
                out.append((a, b))
        return out

    def start_iteration(self) -> None:
        """Resolve a pending vote and lock the iteration's clock (through the controller)."""
        sweep = self.sweep
        if self._vote is not None:
            vote = self._vote()
            if vote is None:
                return  # not every rank has voted yet; retried by the next call
            self._vote = None
            done, rose, resolvable = vote
            if not resolvable:
                self._give_up()
                return
            if done:
                before = sweep.freq_mhz
                was_coarse = sweep.coarse
                sweep.end_block(stop_coarse=bool(rose) and sweep.coarse)
                if was_coarse and not sweep.coarse and rose:
                    self._progress.say(
                        f"energy per iteration rose for {sweep.config.stop_after_rises} coarse "
                        f"clocks in a row (down to {before:g} MHz); filling in above them"
                    )
                if sweep.finished:
                    self._finish()
                    return
                num, total = sweep.position
                self._progress.say(f"profiling at {sweep.freq_mhz:g} MHz ({num}/{total})")
        if sweep.measuring and (not self._blocks or self._blocks[-1].freq_mhz != sweep.freq_mhz):
            self._blocks.append(_Block(sweep.freq_mhz, self._clock(), windows=[]))
        if self._controller.last_requested != sweep.freq_mhz:
            self._controller.request(sweep.freq_mhz)
            if self._blocks and self._blocks[-1].freq_mhz == sweep.freq_mhz:
                self._blocks[-1].requested_s = self._clock()

    def close(self) -> None:
        """Stop the stamps' waiter (the session owns the sampler)."""
        self._stamps.close()

    # -- decisions -------------------------------------------------------------------------------

    def _check_refusals(self) -> None:
        applied = self._controller.applied
        refused = [a for a in applied[self._applied_seen :] if not a.ok]
        self._applied_seen = len(applied)
        if refused:
            self._on_refused("the device refused a clock change while profiling")

    def _land(self, block: _Block) -> None:
        """When the block's clock landed, from the sampler's reads (``None``: not yet)."""
        if block.landed_s is None:
            if not self.sampler.reports_clock:  # no clock to watch: wait out a late landing
                block.landed_s = block.requested_s + max(self.latency_s or 0.0, 0.1)
                return
            seen = self.sampler.first_clock_at(block.freq_mhz, block.requested_s)
            if seen is not None:
                block.landed_s = seen[1]

    def _block_vote(self) -> tuple[bool, bool, bool]:
        """``(block done, energy rose, can resolve)`` for the current block."""
        sweep = self.sweep
        block = self._blocks[-1]
        target = sweep.config.target_error
        error = self._block_error(block)
        done = error <= target or sweep.must_end_block()
        resolvable = True
        if sweep.must_end_block() and error > GIVE_UP_FACTOR * target:
            resolvable = False
            n = max(block.iterations, 1)
            more = math.ceil(n * (error / target) ** 2) if math.isfinite(error) else None
            period = self._counter_period_s()
            self.unresolved = (
                f"stage {self._stage}: after {n} iterations at {block.freq_mhz:g} MHz its "
                f"instruction energy is known to +-{_pct(error)} (target "
                f"+-{100 * target:g} %)"
                + (
                    ""
                    if period is None
                    else f" with an energy counter that updates every {period * 1e3:.0f} ms"
                )
                + "; it would resolve with "
                + (f"about {more} iterations per clock" if more else "many more iterations")
                + " (max_iterations_per_freq) or longer instructions (larger microbatches)"
            )
        rose = False
        if sweep.coarse and done:
            rose = self._energy_rose(block)
        return done, rose, resolvable

    def _block_error(self, block: _Block) -> float:
        """Worst relative 95 % half-width of the block's rows, from a local solve."""
        powers = self._solve([len(self._blocks) - 1], recent=True)
        if not powers:
            return math.inf
        kinds = {k for b, k, _, _ in self._spans if b == len(self._blocks) - 1}
        errors = [powers[(k, block.freq_mhz)][1] for k in kinds if (k, block.freq_mhz) in powers]
        if not errors or len(errors) < len(kinds):
            return math.inf
        return max(errors)

    def _energy_rose(self, block: _Block) -> bool:
        """This block's energy per iteration exceeds the best coarse clock's before it."""
        index = len(self._blocks) - 1
        energy = self._iteration_energy([index]).get(index)
        if energy is None:
            return False
        before = self._iteration_energy(
            [i for i, b in enumerate(self._blocks[:-1]) if b.freq_mhz in self.sweep.visited]
        )
        return bool(before) and energy > min(before.values())

    def _iteration_energy(self, blocks: list[int]) -> dict[int, float]:
        """Instruction energy per iteration of each block (power x time of its spans)."""
        out: dict[int, float] = {}
        powers = self._solve(blocks, recent=False)
        for index in blocks:
            b = self._blocks[index]
            if not b.iterations:
                continue
            total = 0.0
            for bi, kind, t0, t1 in self._spans:
                if bi == index and (kind, b.freq_mhz) in powers and math.isfinite(t1[0] - t0[0]):
                    total += powers[(kind, b.freq_mhz)][0] * (t1[0] - t0[0])
            out[index] = total / b.iterations
        return out

    def _solve(self, blocks: list[int], *, recent: bool) -> dict[Any, tuple[float, float]]:
        """``{(kind, freq) or REST: (power_w, relative error)}`` over ``blocks``' windows."""
        spans = Spans()
        start = math.inf
        for index in blocks:
            for w0, w1 in self._windows(self._blocks[index]):
                spans.add_window(w0, w1)
                start = min(start, w0)
        if not spans.windows:
            return {}
        chosen = set(blocks)
        for bi, kind, t0, t1 in self._spans:
            if bi in chosen and math.isfinite(t0[0]) and math.isfinite(t1[0]):
                spans.add((kind, self._blocks[bi].freq_mhz), t0[0], t1[0])
        timeline = self.sampler.timeline(since_s=start - 1.0 if recent else -math.inf)
        powers, _ = solve_powers(timeline.knot_times_s, timeline.knot_energy_j, spans)
        return {label: (p.power_w, p.rel_error) for label, p in powers.items()}

    def _counter_period_s(self) -> float | None:
        tau = self.sampler.timeline(since_s=self._clock() - 5.0).knot_times_s
        if tau.size < 3:
            return None
        return float(statistics.median(tau[1:] - tau[:-1]))

    def _measure_latency(self) -> None:
        """Request-to-landing time of the warm-up's clock probes (median, and the worst)."""
        self._controller.request(self.sweep.freq_mhz)
        landed: list[float] = []
        for i, (t_request, freq) in enumerate(self._probes):
            seen = self.sampler.first_clock_at(freq, t_request)
            limit = self._probes[i + 1][0] if i + 1 < len(self._probes) else math.inf
            if seen is not None and seen[1] <= limit:
                before, first = seen
                landed.append(max(0.0, 0.5 * (max(before, t_request) + first) - t_request))
        if len(landed) >= 3:
            landed.sort()
            # the guard plans for a late landing, not the typical one
            self.latency_s = landed[min(len(landed) - 1, math.ceil(0.9 * len(landed)) - 1)]
            self._progress.say(
                f"clock changes land {statistics.median(landed) * 1e3:.0f} ms after the request "
                f"(90th percentile {self.latency_s * 1e3:.0f} ms, {len(landed)} probes)"
            )

    def _give_up(self) -> None:
        self.sweep.finished = True
        self._controller.reset()
        self._on_finished(
            {
                "stage": self._stage,
                "rows": [],
                "unresolved": self.unresolved
                or "another rank's instruction energy did not resolve",
                "idle_power_w": self._idle_power_w,
            }
        )

    def _finish(self) -> None:
        self._controller.reset()
        rows, errors, p_block, p_block_error, time_cv = self._rows()
        self.recorder.set(rows, errors, p_block, p_block_error)
        self._on_finished(
            {
                "stage": self._stage,
                "rows": rows_to_payload(rows),
                "errors": [[k, f, e] for (k, f), e in errors.items()],
                "p_block_w": p_block,
                "p_block_error": p_block_error,
                "order": [list(k) for k in self._recorded_order],  # what the loop really ran
                "idle_power_w": self._idle_power_w,
                "latency_s": self.latency_s,
                "blocks": [b.to_json() for b in self._blocks],
                "counter_period_s": self._counter_period_s(),
                "time_cv": time_cv,
                "target_error": self.sweep.config.target_error,
            }
        )

    def _rows(
        self,
    ) -> tuple[
        list[ProfileRow], dict[tuple[str, float], float], float | None, float | None, float | None
    ]:
        """The whole sweep solved at once: every row, its error, and the blocking power."""
        kept = []
        step = _clock_step(self.sweep.config.freqs_mhz)
        windows: dict[int, list[tuple[float, float]]] = {}
        for index, b in enumerate(self._blocks):
            windows[index] = self._windows(b)
            if not windows[index]:
                b.dropped = b.dropped or "the clock never landed"
                continue
            reading = self.sampler.reading(windows[index][0][0], windows[index][-1][1])
            b.ran_mhz, b.temperature_c = reading.freq_mhz, reading.temperature_c
            if reading.freq_mhz is not None and reading.freq_mhz < b.freq_mhz - 0.5 * step:
                b.dropped = f"throttled: ran {reading.freq_mhz:g} MHz"
                continue
            kept.append(index)
        powers = self._solve(kept, recent=False)
        rows = []
        spreads: list[float] = []
        errors: dict[tuple[str, float], float] = {}
        times: dict[tuple[str, float], list[float]] = {}
        for bi, kind, c0, c1 in self._spans:
            t0, t1 = c0[0], c1[0]
            if bi in kept and math.isfinite(t1 - t0):
                b = self._blocks[bi]
                if any(w0 <= t0 and t1 <= w1 for w0, w1 in windows[bi]):
                    times.setdefault((kind, b.freq_mhz), []).append(t1 - t0)
        for (kind, freq), durations in sorted(times.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
            if (kind, freq) not in powers:
                continue
            power, error = powers[(kind, freq)]
            time_s = statistics.fmean(durations)
            if len(durations) >= 3:
                spreads.append(statistics.stdev(durations) / time_s)
            rows.append(
                ProfileRow(
                    stage=self._stage,
                    instruction=kind,
                    freq_mhz=freq,
                    time_s=time_s,
                    energy_j=power * time_s,
                )
            )
            errors[(kind, freq)] = error
        rest = powers.get(REST)
        # the run-to-run spread of an instruction's time: the guard's noise margin
        time_cv = statistics.median(spreads) if spreads else None
        return (
            rows,
            errors,
            None if rest is None else rest[0],
            None if rest is None else rest[1],
            time_cv,
        )


def _probe_pair(freqs_desc: Sequence[float]) -> tuple[float, float] | None:
    """The two clocks the latency probe alternates between (the top and a middle one)."""
    if len(freqs_desc) < 2:
        return None
    return freqs_desc[len(freqs_desc) // 2], freqs_desc[0]


def _clock_step(freqs_desc: Sequence[float]) -> float:
    if len(freqs_desc) < 2:
        return 1.0
    return min(a - b for a, b in zip(freqs_desc, freqs_desc[1:]))


def _pct(error: float) -> str:
    return f"{100 * error:.0f} %" if math.isfinite(error) else "nothing (no counter update)"
