"""The apply phase's closed loop: measure what the plan achieves against the baseline clocks.

A plan's saving is a prediction from the profile; what a job gets depends on what the profile
missed (a clock change that lands late, noise, drift). :class:`ClosedLoop` wraps the
:class:`~powerlib.runtime.apply_phase.ApplyPhase` and, after its first (order-checked)
iteration, runs ``rounds`` rounds of ``reference_iterations`` at the baseline clocks (clocks
unlocked: what the job runs without powerlib, docs/measurement.md §8) followed by
``plan_iterations`` with the plan. Every checked iteration is recorded: its instruction spans
(the session's stamps: CUDA events on a GPU), the clocks the device ran at (each change the
controller made, shifted by the clock-change latency measured while profiling), its energy
(the counter, through :mod:`powerlib.measurement.timeline`).

Rank 0 gathers every rank's records and estimates (:mod:`powerlib.runtime.estimator`): each
plan iteration against its own counterfactual at the baseline clocks (paired), with the
interleaved windows as the check of that estimate's bias. The verdict keeps the plan, keeps
it with a warning (``shortfall``), reverts it (every rank resets its clocks and runs at the
baseline, one warning), or, when the intervals are too wide to judge, first measures another
batch of rounds (up to ``max_rounds``) and then says ``inconclusive`` in one line and
withdraws the plan (what cannot be shown to save is not kept).

A rank that stops before the verdict (its loop does not run the plan's order, or its device
failed: a clock change refused, a read that raised) keeps counting the windows' iterations and
sends its part as ``stopped``, with the failure's reason: the verdict then reverts the plan on
every rank and rank 0 warns once with that reason (docs/real-gpu.md §3). No rank waits in the
exchange for one that left it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from powerlib.errors import DeviceError, PlanError, PowerlibError
from powerlib.measurement.markers import Stamps
from powerlib.measurement.sampler import DeviceSampler, first_read_showing
from powerlib.planning.perseus.counterfactual import IterationRecord, Replayer
from powerlib.planning.perseus.replay import ReplayModel
from powerlib.runtime.apply_phase import ApplyPhase
from powerlib.runtime.controller import AppliedChange
from powerlib.runtime.coordination import Coordinator, Future
from powerlib.runtime.estimator import interleaved, paired, verdict
from powerlib.runtime.phases import SessionPhase
from powerlib.runtime.records import (
    MeasuredIterations,
    MeasureMore,
    Outcome,
    Payload,
    Prediction,
    Realized,
    Verdict,
    Windows,
)

__all__ = ["CheckConfig", "ClosedLoop", "Judge", "MeasureOnly"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckConfig:
    """How the closed loop measures.

    Attributes:
        rounds: Reference/plan window pairs per batch (0: no check; the report then has no
            measurement).
        reference_iterations: Iterations at the baseline clocks per round.
        plan_iterations: Iterations with the plan per round.
        max_rounds: The most rounds measured when the first batches are too noisy to judge
            (default: four batches).
    """

    rounds: int = 3
    reference_iterations: int = 2
    plan_iterations: int = 8
    max_rounds: int | None = None

    def __post_init__(self) -> None:
        for name, minimum in (("rounds", 0), ("reference_iterations", 1), ("plan_iterations", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.max_rounds is not None and self.max_rounds < self.rounds:
            raise ValueError(f"max_rounds must be >= rounds, got {self.max_rounds!r}")

    @property
    def round_limit(self) -> int:
        """The most rounds measured in all (``max_rounds``, or four batches)."""
        return 4 * self.rounds if self.max_rounds is None else self.max_rounds

    @property
    def per_round(self) -> int:
        """Iterations in one round: its reference window, then its plan window."""
        return self.reference_iterations + self.plan_iterations

    @property
    def checked_iterations(self) -> int:
        """Iterations in the windows of one batch of rounds."""
        return self.rounds * self.per_round

    @property
    def exchange_iteration(self) -> int:
        """The loop's iteration at which the ranks exchange the first batch's windows.

        One past the last window's end: the counter has published past it by then.
        """
        return 2 + self.checked_iterations

    @property
    def most_iterations(self) -> int:
        """Iterations until the last possible verdict (every batch measured), from the plan."""
        batches = math.ceil(self.round_limit / self.rounds) if self.rounds else 0
        return batches * (self.checked_iterations + 1) + 2


class Judge:
    """Rank 0: gathers every batch of every rank's records and gives the verdict.

    Args:
        config: The windows.
        max_slowdown: The policy's bound (``None``: no bound).
        predicted: The planner's prediction.
        model: Rank 0's planned workload (``None``: a saved plan; only the interleaved windows
            measure then).
        held_by_reference: The baseline iteration is held by a straggler (``deadline``): its
            time is at least the reference windows' mean.
    """

    def __init__(
        self,
        config: CheckConfig,
        *,
        max_slowdown: float | None,
        predicted: Prediction | None,
        model: ReplayModel | None,
        held_by_reference: bool = False,
    ) -> None:
        self._config = config
        self._max_slowdown = max_slowdown
        self._predicted = predicted
        self._replayer = None if model is None else Replayer(model)
        self._held = held_by_reference
        # (slot, round) -> stage -> record, over every batch so far
        self._records: dict[tuple[str, int, int], dict[int, IterationRecord]] = {}
        self.rounds = 0

    def __call__(self, payloads: Sequence[Windows]) -> Outcome:
        """Every rank's windows of one batch in; a verdict, or ``MeasureMore``, out."""
        stopped = [p for p in payloads if p.stopped]
        if stopped:
            # a failure carries its reason; a loop off the plan's order carries none
            why = [p.reason for p in stopped if p.reason]
            off_order = sorted(p.stage for p in stopped if not p.reason)
            if off_order:
                named = ", ".join(map(str, off_order))
                why.append(f"stage(s) {named} do not run the plan's instruction order")
            return Verdict(realized=Realized.nothing("reverted", "; ".join(why)))
        stages = {p.stage for p in payloads}
        for p in payloads:
            for slot, rnd, iteration, record in p.iterations:
                self._records.setdefault((slot, rnd, iteration), {})[p.stage] = record
        self.rounds += self._config.rounds
        realized = self.realized(stages)
        if realized.verdict == "inconclusive" and self.rounds < self._config.round_limit:
            return MeasureMore(rounds=self.rounds)
        return Verdict(realized=realized)

    def _iterations(
        self, stages: set[int]
    ) -> dict[int, tuple[list[list[IterationRecord]], list[list[IterationRecord]]]]:
        """Per round its reference and plan iterations (each: every stage's record)."""
        out: dict[int, tuple[list[list[IterationRecord]], list[list[IterationRecord]]]] = {}
        for (slot, rnd, _), by_stage in sorted(self._records.items(), key=lambda kv: kv[0][2]):
            if set(by_stage) != stages:
                continue  # a rank could not time this iteration
            refs, plans = out.setdefault(rnd, ([], []))
            (refs if slot == "ref" else plans).append([by_stage[s] for s in sorted(stages)])
        return out

    def realized(self, stages: set[int]) -> Realized:
        """The estimate over every batch so far, and its verdict."""
        rounds = self._iterations(stages)
        check = interleaved([rounds[r] for r in sorted(rounds)])
        estimate = None
        if self._replayer is not None:
            refs = [it for r in rounds.values() for it in r[0]]
            plans = [it for r in rounds.values() for it in r[1]]
            held_s = None
            if self._held and refs:
                held_s = sum(max(x.end_s - x.start_s for x in it) for it in refs) / len(refs)
            estimate = paired(self._replayer, refs, plans, held_s=held_s)
        primary = estimate or check
        if primary is None:
            return Realized.nothing("inconclusive", "no window could be measured", self.rounds)
        note = None
        if estimate is not None and check is not None and not estimate.agrees_with(check):
            primary = check  # the paired figure shows a bias: the windows judge
            note = (
                f"the paired estimate ({estimate.saving_percent:.2f} +- "
                f"{estimate.saving_ci_percent:.2f} %, {estimate.slowdown_percent:+.3f} +- "
                f"{estimate.slowdown_ci_percent:.3f} %) disagrees with the interleaved windows; "
                "the windows judge"
            )
        p = self._predicted
        result, reason = verdict(
            primary,
            max_slowdown=self._max_slowdown,
            predicted_saving_percent=None if p is None else p.saving_percent,
        )
        if note is not None:
            reason = note if reason is None else f"{reason} ({note})"
        return Realized(
            saving_percent=primary.saving_percent,
            saving_ci_percent=primary.saving_ci_percent,
            slowdown_percent=primary.slowdown_percent,
            slowdown_ci_percent=primary.slowdown_ci_percent,
            predicted_saving_percent=None if p is None else p.saving_percent,
            predicted_slowdown_percent=None if p is None else p.slowdown_percent,
            rounds=len(rounds),
            verdict=result,
            reason=reason,
            method=primary.method,
            plan_iterations=sum(len(r[1]) for r in rounds.values()),
            check=check if primary is not check else None,
        )


Cell = list[float]
"""A stamp: the time the device reached a point (``nan`` until it did)."""


@dataclass(slots=True)
class _Checked:
    """One checked iteration as recorded on this rank (stamps resolve later)."""

    slot: str
    round: int
    iteration: int
    start: Cell
    end: Cell | None = None
    spans: list[tuple[int, int, str, Cell, Cell]] | None = None


class ClosedLoop:
    """The apply phase with its measurement: reference and plan windows, then the verdict.

    Args:
        applying: The plan's apply phase (hooks are passed to it in plan iterations).
        config: The windows.
        sampler: Reads this rank's device.
        stamps: Times instructions and iterations (the session's clock, or CUDA events on a
            GPU).
        coordinator: The job's ranks (rank 0 judges).
        judge: Rank 0's judge (``None`` elsewhere: only rank 0's is called).
        latency_s: When a clock change typically lands after the driver call, as this rank
            measured it (the median; ``None``: unknown, taken as 0).
        on_verdict: Called on every rank with the verdict once it arrives.
    """

    def __init__(
        self,
        applying: ApplyPhase,
        config: CheckConfig,
        *,
        sampler: DeviceSampler,
        stamps: Stamps,
        coordinator: Coordinator,
        judge: Judge | None,
        latency_s: float | None,
        on_verdict: Callable[[Realized], None],
    ) -> None:
        self.applying = applying
        self.config = config
        self._sampler = sampler
        self._stamps = stamps
        self._coordinator = coordinator
        self._judge = judge
        self._latency_s = latency_s or 0.0
        self._on_verdict = on_verdict
        self._iteration = 0  # iterations since the plan arrived
        self._batch_start = 1  # the iteration the current batch's first window starts at
        self._batches = 0  # batches measured before the current one
        self._start: Cell | None = None  # the current iteration's start
        self._checked: list[_Checked] = []  # the current batch's iterations
        self._open: tuple[int, int, str, Cell] | None = None
        self._future: Future[Outcome] | None = None
        self.realized: Realized | None = None

    # -- where we are in the schedule ------------------------------------------------------------

    def _slot(self, iteration: int) -> str | None:
        """``ref`` or ``plan`` for a checked iteration, ``None`` outside the check."""
        if self.realized is not None:
            return None
        k = iteration - self._batch_start
        if k < 0 or k >= self.config.checked_iterations:
            return None  # iteration 0: the order check; after a batch: the plan, unrecorded
        return "ref" if k % self.config.per_round < self.config.reference_iterations else "plan"

    @property
    def phase(self) -> SessionPhase:
        """``CHECK`` while windows are measured, then the apply phase's."""
        if not self.applying.active:
            return self.applying.phase
        return SessionPhase.CHECK if self.pending else SessionPhase.APPLY

    @property
    def pending(self) -> bool:
        """The verdict has not arrived yet (the ranks still owe each other the exchange)."""
        return self.config.rounds > 0 and self.realized is None

    @property
    def wants_start(self) -> bool:
        """The verdict is pending: the next begin resolves it first."""
        return self._future is not None

    @property
    def position(self) -> int:
        """Instructions begun in this iteration."""
        return self.applying.position

    @property
    def iterations_left(self) -> int:
        """Iterations until the current batch's exchange (0 once it was sent)."""
        return max(self._batch_start + self.config.checked_iterations + 1 - self._iteration, 0)

    # -- hooks -----------------------------------------------------------------------------------

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """Plan iterations hand the clock to the controller; reference ones leave it unlocked."""
        slot = self._slot(self._iteration)
        if slot == "ref":
            self.applying.position += 1
        else:
            self.applying.begin(kind, microbatch, chunk)
        if slot is not None and self.applying.active:
            self._open = (chunk, microbatch, kind, self._stamps.stamp())

    def end(self) -> None:
        """Time the instruction; prefetch the next clock (plan iterations only)."""
        slot = self._slot(self._iteration)
        if self._open is not None and slot is not None and self._checked:
            chunk, mb, kind, t0 = self._open
            spans = self._checked[-1].spans
            if spans is not None:
                spans.append((chunk, mb, kind, t0, self._stamps.stamp()))
        self._open = None
        if slot != "ref":
            self.applying.end()

    def step(self) -> None:
        """The iteration ended: close its record; after the batch's last, send the windows."""
        self.applying.check_changes()  # a failed change stops the plan (ref windows included)
        slot = self._slot(self._iteration)
        end = self._stamps.stamp()
        if slot is not None and self._checked and self._checked[-1].end is None:
            self._checked[-1].end = end
        if slot == "ref":
            self.applying.position = 0
        else:
            self.applying.step()
        self._iteration += 1
        self._start = end
        if (
            self.config.rounds
            and self.realized is None
            and self._future is None
            and self._iteration == self._batch_start + self.config.checked_iterations + 1
        ):
            self._send()

    def _send(self) -> None:
        iterations: tuple[tuple[str, int, int, IterationRecord], ...] = ()
        if self.applying.active:
            try:
                iterations = self._records()
            except PowerlibError as err:  # still sends its part: the others wait for it
                self.applying.fail(f"stage {self.applying.stage}: measuring failed: {err}")
        # stopped: this rank's order check failed, or its device failed (with the reason)
        stopped = not self.applying.active
        windows = Windows(
            stage=self.applying.stage,
            iterations=() if stopped else iterations,
            stopped=stopped,
            reason=self.applying.stopped_reason,
        )
        self._checked = []
        self._future = self._coordinator.exchange(windows, self._rank0)

    def start_iteration(self) -> None:
        """Set the clocks for the iteration's slot; resolve the verdict when it is pending."""
        if self._future is not None:
            try:
                outcome = self._future()
            except PlanError as err:  # rank 0 could not judge: every rank gets the same error
                outcome = Verdict(
                    realized=Realized.nothing("reverted", f"measuring the plan failed: {err}")
                )
            if outcome is None:
                return
            self._future = None
            if isinstance(outcome, MeasureMore):
                self._batches += 1
                self._batch_start = self._iteration  # every rank resolves at the same iteration
            elif isinstance(outcome, Verdict):
                self.realized = outcome.realized
                self._on_verdict(outcome.realized)
        if self._start is None:
            self._start = self._stamps.stamp()
        slot = self._slot(self._iteration)
        fresh = not self._checked or self._checked[-1].iteration != self._iteration
        if slot is not None and fresh:  # (called again before the first begin: once)
            k = self._iteration - self._batch_start
            rnd = self._batches * self.config.rounds + k // self.config.per_round
            self._checked.append(_Checked(slot, rnd, self._iteration, self._start, spans=[]))
        controller = self.applying.controller
        if slot == "ref" and controller.last_requested is not None:
            controller.reset()
        self.applying.start_iteration()

    def close(self) -> None:
        """Stop timing (the verdict arrived, or the session ends). Idempotent."""
        self._stamps.close()

    # -- the measurement -------------------------------------------------------------------------

    def _clocks(self, since_s: float) -> tuple[tuple[float, float | None], ...]:
        """When each clock change the controller made since ``since_s`` landed, and its clock.

        A change lands where the sampler's reads first show its clock (the middle of the
        bracketing reads), when they do before the next change could land; else the typical
        landing latency after the driver call (the median this rank measured while profiling).
        Changes land in the order they were made, each after the one before it: a read soon
        after a change requested ahead can still show its clock from before a short dip
        (issue 45), which put landings out of order and read the paired saving a point low.
        """
        changes = self.applied_since(since_s)
        times, freqs = self._sampler.clock_reads(since_s)
        clocks: list[tuple[float, float | None]] = [(-math.inf, None)]
        for k, change in enumerate(changes):
            freq = change.freq_mhz if change.ok else None
            after = max(change.time_s, clocks[-1][0])
            landing = change.time_s + self._latency_s
            if freq is not None:
                limit = (
                    changes[k + 1].time_s + self._latency_s if k + 1 < len(changes) else math.inf
                )
                seen = first_read_showing(times, freqs, freq, after, limit)
                if seen is not None:
                    landing = 0.5 * (seen[0] + seen[1])
            clocks.append((max(landing, clocks[-1][0]), freq))
        return tuple(clocks)

    def applied_since(self, since_s: float) -> list[AppliedChange]:
        """The controller's changes from the last one before ``since_s`` on, in time order."""
        applied = self.applying.controller.applied
        k = len(applied)
        while k > 0 and applied[k - 1].time_s >= since_s:
            k -= 1
        return list(applied[max(k - 1, 0) :])

    def _records(self) -> tuple[tuple[str, int, int, IterationRecord], ...]:
        """This batch's iterations as records: resolved stamps, clocks, energy.

        Raises:
            DeviceError: The sampler stopped reading the device (lost, or failing in a row).
        """
        if self._sampler.failure is not None:
            raise DeviceError(self._sampler.failure, device=self._sampler.device.device_id)
        done = [
            c for c in self._checked
            if c.end is not None and c.spans is not None
            and math.isfinite(c.start[0]) and math.isfinite(c.end[0])
            and all(math.isfinite(a[0]) and math.isfinite(b[0]) for *_, a, b in c.spans)
        ]  # fmt: skip
        if not done:
            return ()
        timeline = self._sampler.timeline(since_s=done[0].start[0] - 1.0)
        bounds = [t for c in done for t in (c.start[0], c.end[0] if c.end else math.nan)]
        energy = timeline.energy_at(bounds)
        clocks = self._clocks(since_s=done[0].start[0] - 1.0)
        times = [t for t, _ in clocks]
        stage = self.applying.stage
        out = []
        for k, c in enumerate(done):
            assert c.end is not None and c.spans is not None
            first = c.spans[0][3][0] if c.spans else c.start[0]
            lo = max(bisect.bisect_right(times, min(c.start[0], first)) - 1, 0)
            hi = bisect.bisect_right(times, c.end[0])
            record = IterationRecord(
                stage=stage,
                start_s=c.start[0],
                end_s=c.end[0],
                spans=tuple((ch, mb, kind, a[0], b[0]) for ch, mb, kind, a, b in c.spans),
                clocks=clocks[lo:hi],  # the clock in force at its start, and its changes
                energy_j=float(energy[2 * k + 1] - energy[2 * k]),
            )
            out.append((c.slot, c.round, c.iteration, record))
        return tuple(out)

    def _rank0(self, payloads: list[Payload]) -> Outcome:
        windows = [p for p in payloads if isinstance(p, Windows)]
        if len(windows) != len(payloads) or self._judge is None:
            raise PlanError("rank 0 expected every rank's closed-loop windows")
        return self._judge(windows)


class MeasureOnly:
    """A disabled session's phase: the hooks run, every iteration is timed and metered.

    Args:
        sampler: Reads the device (``None``: no device could be read; only time is measured).
        clock: The session's clock.
    """

    phase = SessionPhase.DISABLED
    wants_start = False

    def __init__(self, sampler: DeviceSampler | None, clock: Callable[[], float]) -> None:
        self._sampler = sampler
        self._clock = clock
        self.position = 0
        self._start_s: float | None = None
        self.steps: list[tuple[float, float]] = []

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """Count the instruction."""
        self.position += 1

    def end(self) -> None:
        """Nothing to do."""

    def step(self) -> None:
        """Close the iteration's window."""
        now = self._clock()
        if self._start_s is not None:
            self.steps.append((self._start_s, now))
        self._start_s = now
        self.position = 0

    def start_iteration(self) -> None:
        """Open the first window."""
        if self._start_s is None:
            self._start_s = self._clock()

    def measured(self) -> MeasuredIterations:
        """Mean time and energy per iteration over the iterations so far."""
        if not self.steps:
            return MeasuredIterations(iterations=0)
        start, end = self.steps[0][0], self.steps[-1][1]
        energy_j = None
        if self._sampler is not None:
            e = self._sampler.timeline(since_s=start - 1.0).energy_at([start, end])
            energy_j = float(e[1] - e[0]) / len(self.steps)
        return MeasuredIterations(
            iterations=len(self.steps),
            time_s=(end - start) / len(self.steps),
            energy_j=energy_j,
        )
