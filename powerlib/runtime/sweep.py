"""The frequency sweep of the profile phase: which clock each iteration runs, and when to move on.

Iterations run in this order (docs/architecture.md §2 step 2, docs/perseus.md §4.5):

1. ``warmup_iterations`` at the highest candidate clock, discarded (allocator, autotuning,
   caches); the profile phase also measures the clock-change latency there.
2. A **coarse pass** over every ``coarse_stride``-th candidate from the top, then a **fill pass**
   over the candidates it skipped: clocks are not visited monotonically from high to low, so a
   slow drift (temperature) does not line up with the clock. The coarse pass stops once the
   stage's energy per iteration has risen for ``stop_after_rises`` coarse clocks in a row: below
   the voltage floor a slower clock only costs energy, and those options are dominated. The fill
   pass then visits the skipped clocks above the first of those rises.
3. Each clock is a **block** of at least ``iterations_per_freq`` measured iterations (after
   ``settle_iterations`` discarded ones), extended one iteration at a time until every profile
   row of the block resolves to ``target_error`` (the half-width of its 95 % interval, from the
   attribution's own residuals: :mod:`powerlib.measurement.attribution`), at most
   ``max_iterations_per_freq``.

The decisions to end a block, to end the coarse pass and to give up are taken by every rank
together (the session's coordinator), so every rank runs the same clock at every iteration.
:class:`SweepConfig` is the session's ``sweep`` settings
(:class:`~powerlib.runtime.session_config.SessionConfig`): each knob and its default is declared
here once.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from powerlib.errors import InvalidArgumentError
from powerlib.planning.profile_rows import ProfileRow

__all__ = ["FrequencySweep", "ProfileRecorder", "SweepConfig", "aggregate_stage_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepConfig:
    """How the session profiles: the sweep's clocks and its iterations (checked when made).

    Attributes:
        freqs_mhz: Candidate clocks (any order; duplicates dropped; kept high to low);
            ``None``: every clock the device supports (:meth:`over`).
        warmup_iterations: Discarded iterations at the highest frequency (the clock-change
            latency is measured there).
        settle_iterations: Discarded iterations after each clock change (0: the measured window
            starts when the sampler sees the new clock land).
        iterations_per_freq: Measured iterations per frequency, at least.
        max_iterations_per_freq: Measured iterations per frequency, at most; a clock's block
            ends as soon as its energy resolves to ``target_error``.
        target_error: A block ends once every row resolves to this (relative half-width of the
            95 % interval).
        target_time_error: ... and once every row's mean time is known to this relative
            standard error (from the spans' spread within iterations; an iteration's shared
            factor is divided out by the sweep's rotating reference). A plan spends slack
            down to the measured times, so their errors add along its critical path
            (docs/perseus.md §2.8).
        stop_after_rises: End the coarse pass after this many coarse clocks of rising energy;
            0 never stops early.
        coarse_stride: Every how many candidates the coarse pass visits (1: one pass).
        reference_iterations: Measured iterations of the first block, at the highest clock, at
            least: every plan's slack is measured against its times (all-max's), and the
            noise's structure is estimated from this block's iterations
            (:mod:`powerlib.runtime.noise_estimate`).
        rotating_reference: In each later block one stage, in turn, stays at the highest clock:
            a factor shared by a whole iteration (1-2 % in Megatron traces, docs/emulator.md)
            and the slow drift move every row of a block alike, and its times show them, so
            rank 0 divides them out (:class:`FrequencySweep`; docs/perseus.md §2.8).

    Raises:
        InvalidArgumentError: A clock that is not a positive number of MHz, an empty list of
            clocks, a count below its minimum, or a target outside (0, 1).
    """

    freqs_mhz: tuple[float, ...] | None = None
    warmup_iterations: int = 2
    settle_iterations: int = 0
    iterations_per_freq: int = 1
    max_iterations_per_freq: int = 4
    target_error: float = 0.02
    target_time_error: float = 0.001
    stop_after_rises: int = 2
    coarse_stride: int = 3
    reference_iterations: int = 8
    rotating_reference: bool = True

    def __post_init__(self) -> None:
        if self.freqs_mhz is not None:
            freqs = tuple(sorted({float(f) for f in self.freqs_mhz}, reverse=True))
            if not freqs or any(not math.isfinite(f) or f <= 0 for f in freqs):
                raise InvalidArgumentError(
                    "profile frequencies must be positive numbers of MHz, got "
                    f"{list(self.freqs_mhz)}"
                )
            object.__setattr__(self, "freqs_mhz", freqs)
        for name, minimum in (
            ("warmup_iterations", 0),
            ("settle_iterations", 0),
            ("iterations_per_freq", 1),
            ("max_iterations_per_freq", 1),
            ("stop_after_rises", 0),
            ("coarse_stride", 1),
            ("reference_iterations", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.max_iterations_per_freq < self.iterations_per_freq:
            object.__setattr__(self, "max_iterations_per_freq", self.iterations_per_freq)
        for name in ("target_error", "target_time_error"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise InvalidArgumentError(f"{name} must be a fraction in (0, 1), got {value!r}")

    def over(self, supported_mhz: Sequence[float]) -> SweepConfig:
        """This sweep, over ``supported_mhz`` when it names no clocks of its own."""
        if self.freqs_mhz is not None:
            return self
        return dataclasses.replace(self, freqs_mhz=tuple(supported_mhz))

    @property
    def candidates(self) -> tuple[float, ...]:
        """The clocks to sweep, high to low.

        Raises:
            InvalidArgumentError: None were named (call :meth:`over` with the device's first).
        """
        if self.freqs_mhz is None:
            raise InvalidArgumentError("the sweep has no clocks yet: use over(supported clocks)")
        return self.freqs_mhz

    @property
    def max_iterations(self) -> int:
        """Iterations of a sweep that never stops early and never resolves early."""
        per_freq = self.settle_iterations + self.max_iterations_per_freq
        reference = max(0, self.reference_iterations - self.max_iterations_per_freq)
        return self.warmup_iterations + len(self.candidates) * per_freq + reference


class FrequencySweep:
    """Which frequency each profiling iteration runs at, and whether it is measured.

    Every rank runs the same block at the same iterations. With ``num_stages`` > 1 and
    ``config.rotating_reference``, after the first block (every stage at the top clock,
    ``reference_iterations`` long) one stage per block, in turn, stays at the top clock while the
    others run the block's clock: its times show each iteration's shared factor (per iteration,
    per microbatch, and the slow drift), which rank 0 then divides out of every other stage's
    times (:func:`powerlib.runtime.noise_estimate.normalized_rows`). A stage therefore misses
    the clocks of the blocks where it is the reference (about one in ``num_stages``).

    Args:
        config: The sweep's settings.
        stage: This rank's stage.
        num_stages: Stages in the pipeline.
    """

    def __init__(self, config: SweepConfig, *, stage: int = 0, num_stages: int = 1) -> None:
        self.config = config
        self.stage = stage
        self.num_stages = num_stages
        self.block_index = -1
        """The block being run, counted from 0 across the whole sweep (the same on every rank)."""
        self.iteration = 0
        """Iterations ended so far, warm-up included (the same on every rank)."""
        freqs = config.candidates
        self._coarse = list(freqs[:: config.coarse_stride])
        if freqs[-1] not in self._coarse and config.coarse_stride > 1:
            self._coarse.append(freqs[-1])
        self._queue: list[float] = list(self._coarse)
        self.coarse = True
        """The sweep is in its coarse pass."""
        self.visited: list[float] = []
        """Clocks whose block ended, in visiting order."""
        self._freq = freqs[0]
        self._warmup_left = config.warmup_iterations
        self._done_in_block = 0
        self.finished = False
        if self._warmup_left == 0:
            self._start_block()

    @property
    def freq_mhz(self) -> float:
        """This rank's frequency in the current iteration (warm-up runs at the highest)."""
        return self.config.candidates[0] if self.is_reference else self._freq

    @property
    def block_freq_mhz(self) -> float:
        """The current block's clock (what the stages that are not the reference run)."""
        return self._freq

    def reference_of(self, block_index: int) -> int | None:
        """The stage that stays at the top clock in block ``block_index`` (``None``: none)."""
        if not self.config.rotating_reference or self.num_stages < 2 or block_index < 1:
            return None
        return (block_index - 1) % self.num_stages

    @property
    def is_reference(self) -> bool:
        """This rank stays at the top clock in the current block."""
        return not self.warming_up and self.reference_of(self.block_index) == self.stage

    @property
    def position(self) -> tuple[int, int]:
        """``(clocks begun, clocks planned so far)``; 0 during warm-up."""
        if self.warming_up:
            return 0, len(self.config.candidates)
        return len(self.visited) + 1, len(self.visited) + 1 + len(self._queue)

    @property
    def warming_up(self) -> bool:
        """Whether the current iteration is a warm-up iteration."""
        return self._warmup_left > 0

    @property
    def measuring(self) -> bool:
        """Whether the current iteration is recorded."""
        return not self.warming_up and self._done_in_block >= self.config.settle_iterations

    @property
    def measured_in_block(self) -> int:
        """Measured iterations of the current block that have ended."""
        return max(0, self._done_in_block - self.config.settle_iterations)

    def iteration_ended(self) -> bool:
        """The current iteration ended; True when the ranks must now vote on the block.

        Warm-up needs no vote (every rank counts the same iterations).
        """
        self.iteration += 1
        if self.warming_up:
            self._warmup_left -= 1
            if self._warmup_left == 0:
                self._start_block()
            return False
        self._done_in_block += 1
        least = self.config.iterations_per_freq
        if not self.visited:  # the reference block
            least = max(least, self.config.reference_iterations)
        return self.measured_in_block >= least

    def must_end_block(self) -> bool:
        """The block reached its maximum measured iterations."""
        most = self.config.max_iterations_per_freq
        if not self.visited:
            most = max(most, self.config.reference_iterations)
        return self.measured_in_block >= most

    def end_block(self, *, stop_coarse: bool = False) -> None:
        """The ranks agreed the block is done; ``stop_coarse`` ends the coarse pass here."""
        self.visited.append(self._freq)
        if self.coarse and (stop_coarse or not self._queue):
            self._begin_fill(stopped=stop_coarse)
        if not self._queue:
            self.finished = True
            return
        self._start_block()

    def _start_block(self) -> None:
        self._freq = self._queue.pop(0)
        self._done_in_block = 0
        self.block_index += 1

    def _begin_fill(self, *, stopped: bool) -> None:
        """The coarse pass is over: queue the skipped clocks above its first rise."""
        self.coarse = False
        floor = -math.inf
        rises = self.config.stop_after_rises
        if stopped and rises > 0 and len(self.visited) > rises:
            floor = self.visited[-rises]  # the first coarse clock of the rising run
        done = set(self.visited)
        self._queue = [f for f in self.config.candidates if f not in done and f > floor]


class ProfileRecorder:
    """What one rank's profile resolved: rows (with intervals) and the blocking power."""

    def __init__(self) -> None:
        self._rows: list[ProfileRow] = []
        self.row_errors: dict[tuple[str, float], float] = {}
        """Per (kind, frequency): relative half-width of the energy's 95 % interval."""
        self.p_block_w: float | None = None
        """Mean power between instructions (the attribution's rest), when resolved."""
        self.p_block_error: float | None = None

    def set(
        self,
        rows: Sequence[ProfileRow],
        errors: dict[tuple[str, float], float],
        p_block_w: float | None,
        p_block_error: float | None = None,
    ) -> None:
        """The solved profile."""
        self._rows = list(rows)
        self.row_errors = dict(errors)
        self.p_block_w = p_block_w
        self.p_block_error = p_block_error

    def rows(self, stage: int) -> list[ProfileRow]:
        """Mean time and energy per (kind, frequency)."""
        return [r if r.stage == stage else _restage(r, stage) for r in self._rows]


def _restage(row: ProfileRow, stage: int) -> ProfileRow:
    return ProfileRow(
        stage=stage,
        instruction=row.instruction,
        freq_mhz=row.freq_mhz,
        time_s=row.time_s,
        energy_j=row.energy_j,
    )


def aggregate_stage_rows(per_rank: Iterable[Sequence[ProfileRow]]) -> list[ProfileRow]:
    """Merge the rows of every rank: per (stage, kind, frequency) time = max, energy = mean.

    The ranks of one stage (tensor/context-parallel shards, data-parallel replicas) run the same
    instructions; the stage waits for its slowest rank, and energy is per GPU (docs/frameworks.md
    §3.6). A frequency that not every rank of a stage measured is dropped.
    """
    grouped: dict[tuple[int, str, float], list[ProfileRow]] = defaultdict(list)
    ranks_of_stage: dict[int, int] = defaultdict(int)
    for rows in per_rank:
        stages = {r.stage for r in rows}
        for s in stages:
            ranks_of_stage[s] += 1
        for r in rows:
            grouped[(r.stage, r.instruction, r.freq_mhz)].append(r)
    merged = []
    for (stage, kind, freq), rows in sorted(
        grouped.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])
    ):
        if len(rows) < ranks_of_stage[stage]:
            continue
        merged.append(
            ProfileRow(
                stage=stage,
                instruction=kind,
                freq_mhz=freq,
                time_s=max(r.time_s for r in rows),
                energy_j=sum(r.energy_j for r in rows) / len(rows),
            )
        )
    return merged
