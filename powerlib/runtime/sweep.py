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
        stop_after_rises: End the coarse pass after this many coarse clocks of rising energy;
            0 never stops early.
        coarse_stride: Every how many candidates the coarse pass visits (1: one pass).

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
    stop_after_rises: int = 2
    coarse_stride: int = 3

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
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.max_iterations_per_freq < self.iterations_per_freq:
            object.__setattr__(self, "max_iterations_per_freq", self.iterations_per_freq)
        if not (isinstance(self.target_error, (int, float)) and 0 < self.target_error < 1):
            raise InvalidArgumentError(
                f"target_error must be a fraction in (0, 1), got {self.target_error!r}"
            )

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
        return self.warmup_iterations + len(self.candidates) * per_freq


class FrequencySweep:
    """Which frequency each profiling iteration runs at, and whether it is measured."""

    def __init__(self, config: SweepConfig) -> None:
        self.config = config
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
        """The frequency of the current iteration (warm-up runs at the highest)."""
        return self._freq

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
        if self.warming_up:
            self._warmup_left -= 1
            if self._warmup_left == 0:
                self._start_block()
            return False
        self._done_in_block += 1
        return self.measured_in_block >= self.config.iterations_per_freq

    def must_end_block(self) -> bool:
        """The block reached its maximum measured iterations."""
        return self.measured_in_block >= self.config.max_iterations_per_freq

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
