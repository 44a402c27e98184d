"""The frequency sweep of the profile phase and what it records.

Iterations run in this order (docs/architecture.md §2 step 2, docs/perseus.md §4.5):

1. ``warmup_iterations`` at the highest candidate frequency, discarded (allocator, autotuning,
   caches);
2. for each candidate frequency from high to low: ``settle_iterations`` discarded (the clock
   change lands asynchronously on real drivers), then ``iterations_per_freq`` measured;
3. the sweep stops early once a stage's energy per iteration has risen for ``stop_after_rises``
   frequencies in a row: below the voltage floor a slower clock only costs energy, and those
   options would be dominated anyway.

The stop decision is taken by every rank together (the session asks its coordinator), so every
rank leaves the sweep at the same iteration.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from powerlib.errors import InvalidArgumentError
from powerlib.planning.profile import ProfileRow

__all__ = ["FrequencySweep", "ProfileRecorder", "SweepConfig", "aggregate_stage_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepConfig:
    """How to sweep.

    Attributes:
        freqs_mhz: Candidate frequencies (any order; swept from high to low; duplicates dropped).
        warmup_iterations: Discarded iterations at the highest frequency.
        settle_iterations: Discarded iterations after each clock change.
        iterations_per_freq: Measured iterations per frequency.
        stop_after_rises: Stop after this many consecutive frequencies whose energy per
            iteration rose; 0 never stops early.
    """

    freqs_mhz: tuple[float, ...]
    warmup_iterations: int = 2
    settle_iterations: int = 1
    iterations_per_freq: int = 2
    stop_after_rises: int = 3

    def __post_init__(self) -> None:
        freqs = tuple(sorted({float(f) for f in self.freqs_mhz}, reverse=True))
        if not freqs or any(not math.isfinite(f) or f <= 0 for f in freqs):
            raise InvalidArgumentError(
                f"profile frequencies must be positive numbers of MHz, got {list(self.freqs_mhz)}"
            )
        object.__setattr__(self, "freqs_mhz", freqs)
        for name, minimum in (
            ("warmup_iterations", 0),
            ("settle_iterations", 0),
            ("iterations_per_freq", 1),
            ("stop_after_rises", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")

    @property
    def max_iterations(self) -> int:
        """Iterations of a sweep that never stops early."""
        per_freq = self.settle_iterations + self.iterations_per_freq
        return self.warmup_iterations + len(self.freqs_mhz) * per_freq


class FrequencySweep:
    """Which frequency each profiling iteration runs at, and whether it is measured."""

    def __init__(self, config: SweepConfig) -> None:
        self.config = config
        self._index = -1 if config.warmup_iterations else 0  # -1: warm-up
        self._done_in_block = 0
        self.finished = False

    @property
    def freq_mhz(self) -> float:
        """The frequency of the current iteration (warm-up runs at the highest)."""
        return self.config.freqs_mhz[max(self._index, 0)]

    @property
    def position(self) -> tuple[int, int]:
        """``(1-based frequency number, number of candidates)``; 0 during warm-up."""
        return self._index + 1, len(self.config.freqs_mhz)

    @property
    def measuring(self) -> bool:
        """Whether the current iteration is recorded."""
        return self._index >= 0 and self._done_in_block >= self.config.settle_iterations

    @property
    def warming_up(self) -> bool:
        """Whether the current iteration is a warm-up iteration."""
        return self._index < 0

    def block_complete_after_this(self) -> bool:
        """True if the current iteration is the last of its frequency block (or of warm-up)."""
        if self._index < 0:
            return self._done_in_block + 1 >= self.config.warmup_iterations
        per_freq = self.config.settle_iterations + self.config.iterations_per_freq
        return self._done_in_block + 1 >= per_freq

    def advance(self, stop: bool = False) -> None:
        """The current iteration ended; ``stop`` ends the sweep after a completed block."""
        complete = self.block_complete_after_this()
        self._done_in_block += 1
        if not complete:
            return
        self._done_in_block = 0
        if stop or self._index + 1 >= len(self.config.freqs_mhz):
            self.finished = True
            return
        self._index += 1


class ProfileRecorder:
    """Samples of one rank: per (kind, frequency) instruction times and energies, and gaps."""

    MIN_GAP_S = 0.01

    def __init__(self) -> None:
        self._samples: dict[tuple[str, float], list[tuple[float, float]]] = defaultdict(list)
        self._iteration_energy: dict[float, list[float]] = defaultdict(list)
        self.gap_time_s = 0.0
        self.gap_energy_j = 0.0
        self.max_clock_iteration_s: list[float] = []

    def add(self, kind: str, freq_mhz: float, time_s: float, energy_j: float) -> None:
        """One measured instruction."""
        self._samples[(kind, freq_mhz)].append((time_s, energy_j))

    def add_gap(self, time_s: float, energy_j: float) -> None:
        """Time between two instructions of one iteration (waiting: bubbles, p2p receives).

        Only gaps of at least :attr:`MIN_GAP_S` count: an energy counter that moves every few
        milliseconds smears part of the neighbouring instructions into a short gap.
        """
        if time_s >= self.MIN_GAP_S:
            self.gap_time_s += time_s
            self.gap_energy_j += energy_j

    def add_iteration(self, freq_mhz: float, energy_j: float) -> None:
        """Instruction energy of one measured iteration, for the early-stop rule."""
        self._iteration_energy[freq_mhz].append(energy_j)

    def iteration_energy_j(self, freq_mhz: float) -> float | None:
        """Mean instruction energy per measured iteration at ``freq_mhz``."""
        values = self._iteration_energy.get(freq_mhz)
        return sum(values) / len(values) if values else None

    def energy_rose(self, freqs_desc: Sequence[float], last: float) -> int:
        """How many frequencies in a row, ending at ``last``, raised the energy per iteration.

        A frequency counts when it used more energy than the best one before it: a
        noise-tolerant "energy keeps rising".
        """
        done = [f for f in freqs_desc if f >= last and f in self._iteration_energy]
        energies = [self.iteration_energy_j(f) or 0.0 for f in done]
        rises = 0
        for i in range(len(energies) - 1, 0, -1):
            if energies[i] > min(energies[:i]):
                rises += 1
            else:
                break
        return rises

    @property
    def p_block_w(self) -> float | None:
        """Mean power between instructions, or ``None`` when no gap was long enough."""
        if self.gap_time_s <= 0:
            return None
        return self.gap_energy_j / self.gap_time_s

    def rows(self, stage: int) -> list[ProfileRow]:
        """Mean time and energy per (kind, frequency)."""
        out = []
        for (kind, freq), samples in sorted(
            self._samples.items(), key=lambda kv: (kv[0][0], -kv[0][1])
        ):
            n = len(samples)
            out.append(
                ProfileRow(
                    stage=stage,
                    instruction=kind,
                    freq_mhz=freq,
                    time_s=sum(t for t, _ in samples) / n,
                    energy_j=sum(e for _, e in samples) / n,
                )
            )
        return out


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
