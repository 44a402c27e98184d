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

A rank that fails while profiling (the device refused a clock change, or a read or a clock
stamp raised a :class:`~powerlib.errors.PowerlibError`) does not leave the sweep: :meth:`fail`
resets its clocks and stops its requests, and it keeps counting the sweep's iterations and
voting at the same iterations as the others, with the vote's last element, *healthy*, False.
The vote is element-wise over the ranks, so at that vote every rank stops profiling, resets
its clocks and sends rank 0 a stop payload (``{"stage", "stopped", "reason"}``) instead of its
profile; rank 0 answers with one baseline verdict naming the failing rank's reason, which rank 0
warns once (docs/real-gpu.md §3). No rank waits in a collective another skipped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from powerlib.device import Device
from powerlib.errors import InvalidArgumentError, PowerlibError
from powerlib.measurement.attribution import REST, Spans, solve_powers
from powerlib.measurement.markers import Stamps
from powerlib.measurement.sampler import DeviceSampler
from powerlib.planning.profile import ProfileRow
from powerlib.profiling.sweep import FrequencySweep, ProfileRecorder, SweepConfig
from powerlib.progress import Progress
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import Coordinator, Future
from powerlib.runtime.planning_step import GIVE_UP_FACTOR
from powerlib.runtime.records import ProfilePayload

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
    energy_j: float | None = None
    """Instruction energy per iteration, once the block ended."""

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
        on_finished: Called once with the payload for rank 0 when the sweep is over (a stop
            payload, ``{"stage", "stopped": True, "reason"}``, when a rank failed).
        on_refused: Called once with a reason when this rank fails (the device refused a
            clock change, a read raised): the phase has reset the clocks and keeps voting,
            marked unhealthy, until every rank stops at the same vote.

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
        on_finished: Callable[[ProfilePayload | dict[str, Any]], None],
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
        self._spans: list[list[tuple[str, list[float], list[float]]]] = []  # per block
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
        self._rises = 0  # coarse blocks in a row whose energy per iteration rose
        self.time_se: float | None = None
        """Median relative standard error of a row's mean time (the guard draws it)."""
        self.position = 0
        """Instructions begun in this iteration."""
        self.failed: str | None = None
        """Why this rank stopped profiling (it still votes, unhealthy), or ``None``."""
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
        self.position += 1
        if self.failed is not None:
            return
        try:
            t = self._stamps.stamp()
        except PowerlibError as err:
            self._failed_here(f"stage {self._stage}: timing an instruction failed: {err}")
            return
        if self._iter_start is None:
            self._iter_start = t
        self._open = (kind, t)
        self._order_now.append((chunk, microbatch, kind))

    def end(self) -> None:
        """The open instruction ends: keep its span (and probe the clock while warming up)."""
        if self._open is None or self.failed is not None:
            self._open = None
            return
        kind, t0 = self._open
        self._open = None
        try:
            t = self._stamps.stamp()
            if self.sweep.measuring and self._blocks:
                self._spans[-1].append((kind, t0, t))
            elif self.sweep.warming_up and self._probe_freqs is not None:
                self._ends += 1
                if self._ends % 2 == 0:  # every other end: changes at least one instruction apart
                    freq = self._probe_freqs[(self._ends // 2) % 2]
                    self._probes.append((self._clock(), freq))
                    self._controller.request(freq)
        except PowerlibError as err:
            self._failed_here(f"stage {self._stage}: timing an instruction failed: {err}")

    def step(self) -> None:
        """The iteration ended: close its window and, when a block may end, vote.

        The sweep counts the iteration and the vote is cast on every rank, failed or not: the
        ranks' collectives stay matched whatever this rank's device does.
        """
        sweep = self.sweep
        t: list[float] | None = None
        if self.failed is None:
            try:
                t = self._record_step()
            except PowerlibError as err:
                self._failed_here(f"stage {self._stage}: measuring an iteration failed: {err}")
        was_warming = sweep.warming_up
        if sweep.iteration_ended():
            self._vote = self._coordinator.all_agree(self._healthy_vote())
        elif was_warming and not sweep.warming_up and self.failed is None:
            try:
                self._measure_latency()
            except PowerlibError as err:
                self._failed_here(f"stage {self._stage}: measuring the clock latency failed: {err}")
        self.position = 0
        self._open = None
        self._iter_start = t

    def _record_step(self) -> list[float]:
        """Close the iteration's window (the block's measured iterations); its end time."""
        t = self._stamps.stamp()
        sweep = self.sweep
        self._recorded_order, self._order_now = self._order_now, []
        self._check_refusals()
        self._check_reads()
        if self.failed is not None:
            return t
        measuring = sweep.measuring and bool(self._blocks)
        start = self._iter_start if self._iter_start is not None else t
        if measuring:
            block = self._blocks[-1]
            assert block.windows is not None
            block.windows.append((start, t))
            block.iterations += 1
        return t

    def _healthy_vote(self) -> tuple[bool, bool, bool, bool]:
        """``(block done, end the coarse pass, can resolve, healthy)``: this rank's vote."""
        if self.failed is None:
            try:
                return (*self._block_vote(), True)
            except PowerlibError as err:
                self._failed_here(f"stage {self._stage}: attributing the energy failed: {err}")
        return (False, False, True, False)

    def fail(self, reason: str) -> None:
        """This rank stops profiling: clocks reset, no more requests; it keeps voting, unhealthy.

        Idempotent: the first reason is kept.
        """
        if self.failed is not None:
            return
        self.failed = reason
        self._open = None
        self._controller.reset()

    def _failed_here(self, reason: str) -> None:
        """A failure this phase found itself: :meth:`fail`, then tell the session once."""
        if self.failed is None:
            self.fail(reason)
            self._on_refused(reason)

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
            done, rose, resolvable, healthy = vote
            if not healthy:  # a rank failed: every rank stops here, at the same vote
                self._stop()
                return
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
        if self.failed is not None:
            return  # no block, no clock: the device stays at its baseline
        if sweep.measuring and (not self._blocks or self._blocks[-1].freq_mhz != sweep.freq_mhz):
            self._blocks.append(_Block(sweep.freq_mhz, self._clock(), windows=[]))
            self._spans.append([])
        if self._controller.last_requested != sweep.freq_mhz:
            try:
                self._controller.request(sweep.freq_mhz)
            except PowerlibError as err:
                self._failed_here(f"stage {self._stage}: {sweep.freq_mhz:g} MHz failed: {err}")
                return
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
            self._failed_here(f"stage {self._stage}: {refused[0].failure()} (while profiling)")

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
        """``(block done, end the coarse pass, can resolve)`` for the current block."""
        sweep = self.sweep
        index = len(self._blocks) - 1
        block = self._blocks[index]
        target = sweep.config.target_error
        powers = self._solve([index], recent=True)
        error = self._block_error(index, powers)
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
        stop_coarse = False
        if done:
            block.energy_j = self._iteration_energy(index, powers)
            if sweep.coarse:
                # rises in a row: a block that did not rise starts the count again
                self._rises = self._rises + 1 if self._energy_rose(index) else 0
                rises = sweep.config.stop_after_rises
                stop_coarse = rises > 0 and self._rises >= rises
        return done, stop_coarse, resolvable

    def _block_error(self, index: int, powers: dict[Any, tuple[float, float]]) -> float:
        """Worst relative 95 % half-width of block ``index``'s rows."""
        freq = self._blocks[index].freq_mhz
        kinds = {kind for kind, _, _ in self._spans[index]}
        errors = [powers[(k, freq)][1] for k in kinds if (k, freq) in powers]
        if not errors or len(errors) < len(kinds):
            return math.inf
        return max(errors)

    def _energy_rose(self, index: int) -> bool:
        """Block ``index``'s energy per iteration exceeds the best earlier coarse clock's."""
        energy = self._blocks[index].energy_j
        before = [
            b.energy_j
            for b in self._blocks[:index]
            if b.energy_j is not None and b.freq_mhz in self.sweep.visited
        ]
        return energy is not None and bool(before) and energy > min(before)

    def _iteration_energy(self, index: int, powers: dict[Any, tuple[float, float]]) -> float | None:
        """Instruction energy per iteration of block ``index`` (power x time of its spans)."""
        b = self._blocks[index]
        if not b.iterations:
            return None
        total = 0.0
        for kind, t0, t1 in self._spans[index]:
            if (kind, b.freq_mhz) not in powers or not math.isfinite(t1[0] - t0[0]):
                return None
            total += powers[(kind, b.freq_mhz)][0] * (t1[0] - t0[0])
        return total / b.iterations

    def _solve(self, blocks: list[int], *, recent: bool) -> dict[Any, tuple[float, float]]:
        """``{(kind, freq) or REST: (power_w, relative error)}`` over ``blocks``' windows.

        ``recent``: a quick solve from the blocks' own reads (the per-iteration vote); else
        from the whole sweep's reads.
        """
        spans = Spans()
        start = math.inf
        for index in blocks:
            for w0, w1 in self._windows(self._blocks[index]):
                spans.add_window(w0, w1)
                start = min(start, w0)
        if not spans.windows:
            return {}
        for index in blocks:
            freq = self._blocks[index].freq_mhz
            for kind, t0, t1 in self._spans[index]:
                if math.isfinite(t0[0]) and math.isfinite(t1[0]):
                    spans.add((kind, freq), t0[0], t1[0])
        # Knots from the periodic fit only: the power-shaped placement needs power readings
        # that follow the workload, which NVML's (averaged) readings do not.
        timeline = self.sampler.timeline(since_s=start - 0.5 if recent else -math.inf, refine=False)
        powers, _ = solve_powers(timeline.knot_times_s, timeline.knot_energy_j, spans)
        return {label: (p.power_w, p.rel_error) for label, p in powers.items()}

    def _counter_period_s(self) -> float | None:
        tau = self.sampler.timeline(since_s=self._clock() - 5.0, refine=False).knot_times_s
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

    def _stop(self) -> None:
        """A rank failed: the sweep ends here on every rank, clocks reset, a stop payload."""
        self.sweep.finished = True
        self._controller.reset()
        self._on_finished(self._stop_payload())

    def _stop_payload(self) -> dict[str, Any]:
        """What every rank sends rank 0 when a rank failed (``reason``: this rank's failure)."""
        return {"stage": self._stage, "stopped": True, "reason": self.failed}

    def _check_reads(self) -> None:
        """A device the sampler stopped reading fails this rank, with that reason.

        A profile without reads cannot resolve either; naming the device's failure keeps the
        warning from blaming the counter's resolution (docs/real-gpu.md §3).
        """
        if self.failed is None and self.sampler.failure is not None:
            self._failed_here(f"stage {self._stage}: {self.sampler.failure}")

    def _give_up(self) -> None:
        self._check_reads()
        self.sweep.finished = True
        self._controller.reset()
        self._on_finished(
            self._stop_payload()
            if self.failed is not None  # failed after voting healthy: the exchange says so
            else ProfilePayload(
                stage=self._stage,
                gave_up=True,
                unresolved=self.unresolved,  # None on the ranks that did resolve
                idle_power_w=self._idle_power_w,
            )
        )

    def _finish(self) -> None:
        self._check_reads()
        self._controller.reset()
        payload: ProfilePayload | dict[str, Any] | None = None
        if self.failed is None:
            try:
                payload = self._profile_payload()
            except PowerlibError as err:
                self._failed_here(f"stage {self._stage}: attributing the energy failed: {err}")
        # exactly one exchange on every rank, failed or not
        self._on_finished(self._stop_payload() if payload is None else payload)

    def _profile_payload(self) -> ProfilePayload:
        """This rank's resolved profile (the whole sweep solved at once)."""
        rows, errors, p_block, p_block_error, time_cv = self._rows()
        self.recorder.set(rows, errors, p_block, p_block_error)
        return ProfilePayload(
            stage=self._stage,
            rows=tuple(rows),
            errors=errors,
            p_block_w=p_block,
            p_block_error=p_block_error,
            order=tuple(self._recorded_order),  # what the loop really ran
            idle_power_w=self._idle_power_w,
            latency_s=self.latency_s,
            blocks=tuple(b.to_json() for b in self._blocks),
            counter_period_s=self._counter_period_s(),
            time_cv=time_cv,
            time_se=self.time_se,
            target_error=self.sweep.config.target_error,
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
        standard_errors: list[float] = []
        errors: dict[tuple[str, float], float] = {}
        times: dict[tuple[str, float], list[float]] = {}
        for bi in kept:
            freq = self._blocks[bi].freq_mhz
            for kind, c0, c1 in self._spans[bi]:
                t0, t1 = c0[0], c1[0]
                if math.isfinite(t1 - t0) and any(w0 <= t0 and t1 <= w1 for w0, w1 in windows[bi]):
                    times.setdefault((kind, freq), []).append(t1 - t0)
        monotone = _monotone_times({key: d for key, d in times.items() if key in powers})
        for (kind, freq), durations in sorted(times.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
            if (kind, freq) not in powers:
                continue
            power, error = powers[(kind, freq)]
            time_s = monotone[(kind, freq)]
            if len(durations) >= 3:
                spread = statistics.stdev(durations) / time_s
                spreads.append(spread)
                standard_errors.append(spread / math.sqrt(len(durations)))
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
        self.time_se = statistics.median(standard_errors) if standard_errors else None
        return (
            rows,
            errors,
            None if rest is None else rest[0],
            None if rest is None else rest[1],
            time_cv,
        )


def _monotone_times(
    times: dict[tuple[str, float], list[float]],
) -> dict[tuple[str, float], float]:
    """Each (kind, clock)'s mean time, made non-increasing in the clock (weighted isotonic fit).

    A higher clock never makes an instruction slower, but with run-to-run noise its mean can
    measure slower than a neighbour's; the planner would then lower a clock for a "saving" that
    only the noise promised (the guard compares against all-max, which runs the top clock). The
    pool-adjacent-violators fit averages such neighbours, weighted by their samples: it leaves a
    monotone profile alone and pools the noise where the clocks are too close to tell apart.
    """
    out: dict[tuple[str, float], float] = {}
    for kind in {k for k, _ in times}:
        # from the top clock down, times must not decrease
        keys = sorted((key for key in times if key[0] == kind), key=lambda key: -key[1])
        blocks: list[list[float]] = []  # [weighted sum, weight, count of keys]
        for key in keys:
            d = times[key]
            blocks.append([math.fsum(d), float(len(d)), 1.0])
            while len(blocks) > 1 and (
                blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]
            ):
                total, weight, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += weight
                blocks[-1][2] += count
        i = 0
        for total, weight, count in blocks:
            for _ in range(int(count)):
                out[keys[i]] = total / weight
                i += 1
    return out


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
