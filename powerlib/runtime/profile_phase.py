"""The session's profile phase: a frequency sweep whose energy comes from counter intervals.

:class:`ProfilePhase` holds everything profiling needs and nothing else. Its hooks only record:
``begin`` and ``end`` note the time (the session's clock; on a GPU, the moment a CUDA event on
the compute stream completes, stamped by a waiter thread), ``step`` closes the iteration. No
device synchronize and no driver call runs in a hook: the clock changes go through the
frequency controller, and the device is read by the session's
:class:`~powerlib.measurement.sampler.DeviceSampler`.

Energy is attributed afterwards (:mod:`powerlib.runtime.profile_blocks` holds the clock blocks
and their attribution), the way :mod:`powerlib.measurement` attributes windows: the sampler's
reads locate every counter update in time (:mod:`powerlib.measurement.timeline`),
and :func:`~powerlib.measurement.attribution.solve_powers` solves each (kind, clock)'s power
and the blocking power from which spans and gaps each counter interval covered, each with its
interval (issue 32; docs/measurement.md). The sweep (:mod:`powerlib.runtime.sweep`) ends a
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
its clocks and sends rank 0 a :class:`~powerlib.runtime.records.StopPayload` instead of its
profile; rank 0 answers with one baseline verdict naming the failing rank's reason, which rank 0
warns once (docs/real-gpu.md §3). No rank waits in a collective another skipped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from powerlib.device import Device
from powerlib.errors import InvalidArgumentError, PowerlibError
from powerlib.measurement.markers import Stamps
from powerlib.measurement.sampler import DeviceSampler
from powerlib.planning.profile_rows import ProfileRow
from powerlib.progress import Progress
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import Coordinator, Future, Vote
from powerlib.runtime.gathered import GIVE_UP_FACTOR
from powerlib.runtime.noise_estimate import SpanTime, estimate_time_noise, row_time_se
from powerlib.runtime.phases import RankFailure, SessionPhase
from powerlib.runtime.planning_step import device_power_floor_w
from powerlib.runtime.power_budget_step import device_power_limit_w
from powerlib.runtime.profile_blocks import Blocks
from powerlib.runtime.records import ProfilePayload, StopPayload
from powerlib.runtime.sweep import FrequencySweep, ProfileRecorder, SweepConfig

__all__ = ["ProfilePhase", "SweepProgress"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepProgress:
    """How far a sweep got, for a run that ends before it finishes.

    Attributes:
        clocks_profiled: Candidates whose block ended (0 while warming up).
        clocks: Candidates.
        warming_up: The sweep is still warming up.
        warmup_iterations: Its warm-up iterations.
        max_iterations_per_clock: The most iterations one clock takes (settle + measured).
        iterations_needed: The most iterations the sweep takes (warm-up, then every clock at
            its maximum; resolving early or ending the coarse pass takes fewer).
    """

    clocks_profiled: int
    clocks: int
    warming_up: bool
    warmup_iterations: int
    max_iterations_per_clock: int
    iterations_needed: int

    def to_json(self) -> dict[str, int]:
        """The figures ``summary.json`` keeps (``warming_up`` aside)."""
        return {
            "clocks_profiled": self.clocks_profiled,
            "clocks": self.clocks,
            "warmup_iterations": self.warmup_iterations,
            "max_iterations_per_clock": self.max_iterations_per_clock,
            "iterations_needed": self.iterations_needed,
        }


class ProfilePhase:
    """Sweeps the clocks and attributes every instruction's energy for this rank.

    Args:
        config: The sweep's settings (its clocks, when it names none: every supported one).
        stage: This rank's pipeline stage.
        device: The profiled device.
        controller: Applies the sweep's clocks (off the training thread when threaded).
        sampler: Reads the device (energy counter, clock, temperature).
        stamps: Times the hooks' points (host clock, or CUDA events completed on the stream).
        coordinator: Carries the ranks' votes.
        clock: Time source in seconds (the sampler's).
        idle_power_w: The device's power before the session changed anything.
        progress: Where progress lines go.
        on_finished: Called once with the payload for rank 0 when the sweep is over (a
            :class:`~powerlib.runtime.records.StopPayload` when a rank failed).
        on_failure: Called once when this rank fails (the device refused a clock change, a read
            raised): the phase has reset the clocks and keeps voting, marked unhealthy, until
            every rank stops at the same vote.
        num_stages: Stages in the pipeline (one in turn is the sweep's reference,
            :class:`~powerlib.runtime.sweep.FrequencySweep`).

    Raises:
        InvalidArgumentError: The device cannot lock its SM clock, or a candidate clock is not
            one it supports.
    """

    phase = SessionPhase.PROFILE

    def __init__(
        self,
        config: SweepConfig,
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
        on_finished: Callable[[ProfilePayload | StopPayload], None],
        on_failure: Callable[[RankFailure], None],
        num_stages: int = 1,
    ) -> None:
        supported = device.info.supported_sm_freqs_mhz
        if not supported:
            raise InvalidArgumentError(
                f"{device.info.name} cannot lock its SM clock, so it cannot be profiled",
                device=device.device_id,
            )
        sweep_config = config.over(supported)
        freqs = sweep_config.candidates
        for f in freqs:
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
        self._on_failure = on_failure
        self.sweep = FrequencySweep(sweep_config, stage=stage, num_stages=num_stages)
        self.recorder = ProfileRecorder()
        self._record = Blocks(sampler)
        self._blocks = self._record.blocks  # the record's lists (tests read the blocks)
        self._spans = self._record.spans
        self._open: tuple[str, list[float]] | None = None
        self._open_mb = (0, 0, 0)
        # per block, each span's (sweep block, sweep iteration, microbatch)
        self._span_microbatches: list[list[tuple[int, int, int]]] = []
        self._iter_start: list[float] | None = None
        self._vote: Future[Vote] | None = None
        self._applied_seen = 0
        self._order_now: list[tuple[int, int, str]] = []
        self._recorded_order: list[tuple[int, int, str]] = []
        self._ends = 0
        self._probes: list[tuple[float, float]] = []  # (request time, clock)
        self._probe_freqs = _probe_pair(freqs)
        self.latency_s: float | None = None
        """The clock-change latency measured while warming up (request to landing, its 90th
        percentile: what the guard plans for)."""
        self.landing_s: float | None = None
        """The median of the same landings: when a change typically lands (the closed loop)."""
        self.latency_samples_s: tuple[float, ...] = ()
        """Every landing the warm-up's probes measured (the guard draws each switch's)."""
        self.unresolved: str | None = None
        self._rises = 0  # coarse blocks in a row whose energy per iteration rose
        self.time_se: float | None = None
        """Median relative standard error of a row's mean time (the guard draws it)."""
        self.position = 0
        """Instructions begun in this iteration."""
        self.failed: str | None = None
        """Why this rank stopped profiling (it still votes, unhealthy), or ``None``."""
        progress.say(
            f"profiling up to {len(freqs)} clocks, {freqs[0]:g}"
            f"-{freqs[-1]:g} MHz, interleaved, each until its energy resolves "
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
        self._open_mb = (self.sweep.block_index, self.sweep.iteration, microbatch)
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
                while len(self._span_microbatches) < len(self._spans):
                    self._span_microbatches.append([])
                self._span_microbatches[len(self._spans) - 1].append(self._open_mb)
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
            self._on_failure(RankFailure(reason))

    def start_iteration(self) -> None:
        """Resolve a pending vote and lock the iteration's clock (through the controller)."""
        sweep = self.sweep
        if self._vote is not None:
            vote = self._vote()
            if vote is None:
                return  # not every rank has voted yet; retried by the next call
            self._vote = None
            assert isinstance(vote, tuple)  # the sweep votes four things at once
            done, rose, resolvable, healthy = vote
            if not healthy:  # a rank failed: every rank stops here, at the same vote
                self._stop()
                return
            if not resolvable:
                self._give_up()
                return
            if done:
                before = sweep.block_freq_mhz
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
                self._progress.say(f"profiling at {sweep.block_freq_mhz:g} MHz ({num}/{total})")
        if self.failed is not None:
            return  # no block, no clock: the device stays at its baseline
        if sweep.measuring and (not self._blocks or self._blocks[-1].freq_mhz != sweep.freq_mhz):
            self._record.start(sweep.freq_mhz, self._clock())
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

    def so_far(self) -> SweepProgress:
        """How far the sweep got, for a run that ends before it finishes."""
        config = self.sweep.config
        return SweepProgress(
            clocks_profiled=len(self.sweep.visited),
            clocks=len(config.candidates),
            warming_up=self.sweep.warming_up,
            warmup_iterations=config.warmup_iterations,
            max_iterations_per_clock=config.settle_iterations + config.max_iterations_per_freq,
            iterations_needed=config.max_iterations,
        )

    def partial_rows(self) -> list[ProfileRow]:
        """This rank's rows from the clocks whose block ended (a run that ended mid-sweep).

        Raises:
            PowerlibError: Attributing the energy failed.
        """
        ended = len(self.sweep.visited)  # one block per clock, in the order the sweep ran them
        if self.failed is not None or not ended:
            return []
        solved = self._record.solve_rows(
            self._stage, self.sweep.config.candidates, self.latency_s, num_blocks=ended
        )
        return solved.rows

    # -- decisions -------------------------------------------------------------------------------

    def _check_refusals(self) -> None:
        applied = self._controller.applied
        refused = [a for a in applied[self._applied_seen :] if not a.ok]
        self._applied_seen = len(applied)
        if refused:
            self._failed_here(f"stage {self._stage}: {refused[0].failure()} (while profiling)")

    def _block_vote(self) -> tuple[bool, bool, bool]:
        """``(block done, end the coarse pass, can resolve)`` for the current block.

        The block's reference stage (at the top clock) leaves the decisions to the others.
        """
        sweep = self.sweep
        if sweep.is_reference:
            return True, True, True
        index = len(self._blocks) - 1
        block = self._blocks[index]
        target = sweep.config.target_error
        powers = self._record.solve([index], recent=True, latency_s=self.latency_s)
        error = self._record.error(index, powers)
        resolved = error <= target and self._time_error(index) <= sweep.config.target_time_error
        done = resolved or sweep.must_end_block()
        resolvable = True
        if sweep.must_end_block() and error > GIVE_UP_FACTOR * target:
            resolvable = False
            n = max(block.iterations, 1)
            more = math.ceil(n * (error / target) ** 2) if math.isfinite(error) else None
            period = self._record.counter_period_s(self._clock())
            self.unresolved = (
                f"stage {self._stage}: after {n} iterations at {block.freq_mhz:g} MHz its "
                + (
                    f"instruction energy is known to +-{100 * error:.0f} %"
                    if math.isfinite(error)
                    else "instruction energies are not resolved yet (fewer whole counter "
                    "intervals than instructions to solve for)"
                )
                + f" (target +-{100 * target:g} %)"
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
            block.energy_j = self._record.iteration_energy(index, powers)
            if sweep.coarse:
                # rises in a row: a block that did not rise starts the count again
                self._rises = self._rises + 1 if self._energy_rose(index) else 0
                rises = sweep.config.stop_after_rises
                stop_coarse = rises > 0 and self._rises >= rises
        return done, stop_coarse, resolvable

    def _time_error(self, index: int) -> float:
        """The worst relative standard error of a row's mean time in block ``index``.

        From the spread of the spans of one kind within each iteration (the factor an
        iteration shares is divided out at rank 0, docs/perseus.md §2.8): 0 where an iteration
        holds one span of a kind (nothing to tell from).
        """
        if index >= len(self._span_microbatches):
            return 0.0
        by_kind: dict[tuple[str, int], list[float]] = {}
        for (kind, c0, c1), (_, it, _) in zip(self._spans[index], self._span_microbatches[index]):
            if math.isfinite(c1[0] - c0[0]) and c1[0] > c0[0]:
                by_kind.setdefault((kind, it), []).append(math.log(c1[0] - c0[0]))
        pooled: dict[str, list[float]] = {}  # kind -> [sum of squares, dof, spans]
        for (kind, _), logs in by_kind.items():
            acc = pooled.setdefault(kind, [0.0, 0.0, 0.0])
            if len(logs) > 1:
                m = math.fsum(logs) / len(logs)
                acc[0] += math.fsum((x - m) ** 2 for x in logs)
                acc[1] += len(logs) - 1
            acc[2] += len(logs)
        errors = [math.sqrt(ss / dof / n) for ss, dof, n in pooled.values() if dof > 0]
        return max(errors, default=0.0)

    def _energy_rose(self, index: int) -> bool:
        """Block ``index``'s energy per iteration exceeds the best earlier coarse clock's."""
        energy = self._blocks[index].energy_j
        before = [
            b.energy_j
            for b in self._blocks[:index]
            if b.energy_j is not None and b.freq_mhz in self.sweep.visited
        ]
        return energy is not None and bool(before) and energy > min(before)

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
            self.latency_samples_s = tuple(landed)
            self.landing_s = statistics.median(landed)
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

    def _stop_payload(self) -> StopPayload:
        """What every rank sends rank 0 when a rank failed (``reason``: this rank's failure)."""
        return StopPayload(stage=self._stage, reason=self.failed)

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
        payload: ProfilePayload | None = None
        if self.failed is None:
            try:
                payload = self._profile_payload()
            except PowerlibError as err:
                self._failed_here(f"stage {self._stage}: attributing the energy failed: {err}")
        # exactly one exchange on every rank, failed or not
        self._on_finished(self._stop_payload() if payload is None else payload)

    def _profile_payload(self) -> ProfilePayload:
        """This rank's resolved profile (the whole sweep solved at once)."""
        solved = self._record.solve_rows(self._stage, self.sweep.config.candidates, self.latency_s)
        spans = self._span_times()
        noise = estimate_time_noise(spans)
        # a row's error from the noise's structure (its spans share their iterations' factor)
        se = None if noise is None else row_time_se(spans, noise)
        self.time_se = solved.time_se if se is None else max(se, solved.time_se or 0.0)
        rows, p_block, p_block_error = solved.rows, solved.p_block_w, solved.p_block_error
        self.recorder.set(rows, solved.errors, p_block, p_block_error)
        return ProfilePayload(
            stage=self._stage,
            rows=tuple(rows),
            errors=solved.errors,
            p_block_w=p_block,
            p_block_error=p_block_error,
            order=tuple(self._recorded_order),  # what the loop really ran
            idle_power_w=self._idle_power_w,
            latency_s=self.latency_s,
            blocks=tuple(b.summary() for b in self._blocks),
            counter_period_s=self._record.counter_period_s(self._clock()),
            time_cv=solved.time_cv,
            time_se=self.time_se,
            target_error=self.sweep.config.target_error,
            time_noise=noise,
            latency_samples_s=self.latency_samples_s,
            span_times=tuple(spans),
            power_floor_w=device_power_floor_w(self._device),
            power_limit_w=device_power_limit_w(self._device),
        )

    def _span_times(self) -> list[SpanTime]:
        """Every measured span with its block, iteration, microbatch, kind, clock and time."""
        out: list[SpanTime] = []
        for bi, block in enumerate(self._blocks):
            if block.dropped is not None or bi >= len(self._span_microbatches):
                continue
            windows = self._record.windows(block, self.latency_s)
            spans = self._spans[bi]
            for (kind, c0, c1), (sweep_block, it, mb) in zip(spans, self._span_microbatches[bi]):
                t0, t1 = c0[0], c1[0]
                if math.isfinite(t1 - t0) and any(w0 <= t0 and t1 <= w1 for w0, w1 in windows):
                    out.append((sweep_block, it, mb, kind, block.freq_mhz, t1 - t0))
        return out


def _probe_pair(freqs_desc: Sequence[float]) -> tuple[float, float] | None:
    """The two clocks the latency probe alternates between (the top and a middle one)."""
    if len(freqs_desc) < 2:
        return None
    return freqs_desc[len(freqs_desc) // 2], freqs_desc[0]
