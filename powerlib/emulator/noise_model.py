"""The emulated GPUs' run-to-run noise, structured as real Megatron traces show it.

Real pipeline-parallel training does not jitter each instruction independently
(docs/emulator.md, "The noise model"). ByteDance's public Megatron traces (Wu et al.,
"Understanding Stragglers in Large Model Training Using What-if Analysis", OSDI'25, arXiv
2505.05713, traces ST and AR) split a 1.6-2.7 % coefficient of variation of forward and backward
times into a job-wide factor per iteration (0.6-2.2 %), a factor per microbatch shared by every
stage (1.1-2.0 %; adjacent stages correlate +0.95/+0.97, the same slot on another replica -0.02:
it comes from the data, not the machine) and an independent part (0.34-0.94 %). A
:class:`NoiseModel` draws, per instruction execution:

- time factor = iteration factor x microbatch factor x independent factor x the GPU's persistent
  time offset x its fail-slow factor;
- energy factor = time factor x power factor, the power factor being the GPU's persistent power
  offset x ``(1 + energy_cv z)`` (the device adds its thermal drift).

The parts:

- **per iteration**: ``1 + iteration_cv z`` shared by every instruction of every stage, times a
  slow common-mode drift: three sinusoids of the iteration key (periods 500, 1800 and 6000
  iterations, phases from the seed) whose root mean square is ``drift_cv`` (Llama 3 report,
  Grattafiori et al., arXiv 2407.21783 §3.3.4: daily throughput varies 1-2 %, common-mode);
- **per microbatch**: ``1 + microbatch_cv z`` per (iteration, microbatch), shared by every stage,
  chunk and pass of that microbatch (data length drives them all); zero for fixed-length data;
- **independent** per instruction: the emulator's ``noise`` (:attr:`NvmlLikeModel.noise
  <powerlib.emulator.engine.NvmlLikeModel.noise>`), drawn from the device's own stream in
  execution order;
- **persistent per-GPU offsets**, drawn once per device from the seed. Sinha et al. ("Not all
  GPUs are created equal", SC'22) report 8 % performance variation across GPUs of one model,
  mostly under power management; at locked clocks below the power limit, *our assumption* is
  that the spread shows mostly in power: time cv 0.5 %, power cv 3 %;
- **rare fail-slows** (FALCON, Wu et al., arXiv 2410.12588: episodes last seconds to hours and
  slow a GPU 1.1-1.5x): per GPU, episodes over the iteration key from a Poisson process (0.02 per
  1000 GPU-iterations), durations log-uniform in 5-500 iterations, factor ``U(1.1, 1.5)`` on time.

Every draw is a function of ``(seed, key)`` (and the device index) alone, so a plan and all-max
run on the same key see identical factors (paired comparisons). A model without structure
(:data:`IID`: every part but the independent one zero) is the stress case of issue 32: each
instruction draws independent time and energy factors of ``noise`` and nothing else, exactly
as the emulator always did.

This module is pure: it imports only the standard library and the planner's
:class:`~powerlib.planning.perseus.noise.TimeNoise` and
:class:`~powerlib.planning.profile.Profile`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

from powerlib.planning.perseus.noise import TimeNoise
from powerlib.planning.profile import Profile

__all__ = [
    "FIXED_LENGTH",
    "IID",
    "NOISE_MODELS",
    "VARIABLE_LENGTH",
    "FailSlow",
    "NoiseDraws",
    "NoiseModel",
    "noise_preset",
    "offset_profile",
]

_FAIL_SLOW_BLOCK = 1000  # iteration keys per block of fail-slow draws


def _check(name: str, value: float, ok: bool, want: str) -> None:
    if not (ok and math.isfinite(value)):
        raise ValueError(f"{name} must be {want}, not {value}")


def _pct(x: float) -> str:
    return f"{100 * x:.2g} %"


@dataclass(frozen=True, slots=True)
class NoiseModel:
    """Where the emulated GPUs' noise is shared (relative standard deviations unless named).

    The independent part is not here: it is the device model's ``noise``
    (:class:`~powerlib.emulator.engine.NvmlLikeModel`), so that ``--noise`` keeps its meaning.

    Attributes:
        name: What :meth:`describe` calls it (``fixed-length``, ``variable-length``, ``iid``).
        iteration_cv: One factor per iteration, every instruction of every stage.
        drift_cv: Root mean square of the slow common-mode drift over iterations.
        drift_periods: The drift's sinusoids' periods, in iterations.
        microbatch_cv: One factor per (iteration, microbatch), every stage, chunk and pass.
        energy_cv: Independent power noise per instruction; ``None``: the independent time cv.
        gpu_time_cv: Spread of the GPUs' persistent time offsets.
        gpu_power_cv: Spread of the GPUs' persistent power offsets.
        fail_slow_rate: Fail-slow episodes per 1000 GPU-iterations.
        fail_slow_iterations: Bounds of an episode's log-uniform duration, in iterations.
        fail_slow_factor: Bounds of an episode's uniform time factor.
    """

    name: str = "iid"
    iteration_cv: float = 0.0
    drift_cv: float = 0.0
    drift_periods: tuple[float, ...] = (500.0, 1800.0, 6000.0)
    microbatch_cv: float = 0.0
    energy_cv: float | None = None
    gpu_time_cv: float = 0.0
    gpu_power_cv: float = 0.0
    fail_slow_rate: float = 0.0
    fail_slow_iterations: tuple[float, float] = (5.0, 500.0)
    fail_slow_factor: tuple[float, float] = (1.1, 1.5)

    def __post_init__(self) -> None:
        cvs = ("iteration_cv", "drift_cv", "microbatch_cv", "gpu_time_cv", "gpu_power_cv")
        for name in cvs:
            _check(name, getattr(self, name), 0.0 <= getattr(self, name) < 0.5, "in [0, 0.5)")
        if self.energy_cv is not None:
            _check("energy_cv", self.energy_cv, 0.0 <= self.energy_cv < 0.5, "in [0, 0.5)")
        _check("fail_slow_rate", self.fail_slow_rate, 0.0 <= self.fail_slow_rate <= 1000, ">= 0")
        lo, hi = self.fail_slow_iterations
        ok = 1.0 <= lo <= hi <= _FAIL_SLOW_BLOCK
        _check("fail_slow_iterations", lo, ok, "1 <= lo <= hi <= 1000")
        lo, hi = self.fail_slow_factor
        _check("fail_slow_factor", lo, 1.0 <= lo <= hi, "1 <= lo <= hi")
        for period in self.drift_periods:
            _check("drift_periods", period, period > 0, "> 0")

    @property
    def is_iid(self) -> bool:
        """No structure: only the independent part (the stress case, today's emulator)."""
        return not (
            self.iteration_cv or self.drift_cv or self.microbatch_cv or self.gpu_time_cv
            or self.gpu_power_cv or self.fail_slow_rate
        )  # fmt: skip

    def time_noise(self, independent_cv: float) -> TimeNoise:
        """The time structure an oracle plans for: per iteration (no drift), microbatch, own."""
        return TimeNoise(
            iteration_cv=self.iteration_cv,
            microbatch_cv=self.microbatch_cv,
            independent_cv=independent_cv,
        )

    def describe(self, independent_cv: float) -> str:
        """One phrase, e.g. ``fixed-length noise (1 % per iteration + 0.5 % drift, ...)``."""
        if self.is_iid:
            return f"{_pct(independent_cv)} i.i.d. noise" if independent_cv else "no noise"
        parts = [f"{_pct(self.iteration_cv)} per iteration + {_pct(self.drift_cv)} drift"]
        if self.microbatch_cv:
            parts.append(f"{_pct(self.microbatch_cv)} per microbatch")
        parts.append(f"{_pct(independent_cv)} independent")
        if self.gpu_time_cv or self.gpu_power_cv:
            parts.append(
                f"GPU offsets {_pct(self.gpu_time_cv)} time / {_pct(self.gpu_power_cv)} power"
            )
        if self.fail_slow_rate:
            parts.append(f"fail-slows {self.fail_slow_rate:g}/1000 GPU-iterations")
        return f"{self.name} noise ({', '.join(parts)})"

    def to_json(self) -> dict[str, object]:
        """Every field as a JSON object (tuples as lists)."""
        return {
            "name": self.name,
            "iteration_cv": self.iteration_cv,
            "drift_cv": self.drift_cv,
            "drift_periods": list(self.drift_periods),
            "microbatch_cv": self.microbatch_cv,
            "energy_cv": self.energy_cv,
            "gpu_time_cv": self.gpu_time_cv,
            "gpu_power_cv": self.gpu_power_cv,
            "fail_slow_rate": self.fail_slow_rate,
            "fail_slow_iterations": list(self.fail_slow_iterations),
            "fail_slow_factor": list(self.fail_slow_factor),
        }


FIXED_LENGTH = NoiseModel(
    name="fixed-length",
    iteration_cv=0.010,
    drift_cv=0.005,
    gpu_time_cv=0.005,
    gpu_power_cv=0.03,
    fail_slow_rate=0.02,
)
"""Fixed-length data (the default): no microbatch part; independent 0.4 % (time and power)."""

VARIABLE_LENGTH = dataclasses.replace(FIXED_LENGTH, name="variable-length", microbatch_cv=0.017)
"""Variable-length data: 1.7 % per microbatch; independent 0.35 % (time and power)."""

IID = NoiseModel(name="iid")
"""No structure: only independent time and energy factors of ``noise`` (the stress case)."""

NOISE_MODELS: dict[str, tuple[NoiseModel, float]] = {
    "fixed-length": (FIXED_LENGTH, 0.004),
    "variable-length": (VARIABLE_LENGTH, 0.0035),
    "iid": (IID, 0.02),
}
"""``--noise-model`` choices: the structure and its default independent cv (``noise``)."""


def noise_preset(name: str) -> tuple[NoiseModel, float]:
    """The preset ``name`` and its default independent cv.

    Raises:
        ValueError: No such preset (the message lists them).
    """
    try:
        return NOISE_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown noise model {name!r}; choose one of {', '.join(NOISE_MODELS)}"
        ) from None


def offset_profile(profile: Profile, offsets: list[tuple[float, float]]) -> Profile:
    """``profile`` as GPUs with persistent ``(time, power)`` offsets (one per stage) run it.

    Times scale by the time offset, energies by both; stages past ``offsets`` are dropped.
    """
    rows = [
        dataclasses.replace(row, time_s=row.time_s * t, energy_j=row.energy_j * t * p)
        for row in profile.rows
        if row.stage < len(offsets)
        for t, p in (offsets[row.stage],)
    ]
    return Profile(
        rows,
        source=f"{profile.source} (emulated GPUs' truth)",
        p_block_w=profile.p_block_w,
        unit_time_s=profile.unit_time_s,
    )


@dataclass(frozen=True, slots=True)
class FailSlow:
    """One fail-slow episode of one GPU: iteration keys ``start <= key < end`` run ``factor`` x slower."""

    start: int
    end: int
    factor: float


@dataclass(slots=True)
class NoiseDraws:
    """The shared draws of one emulated pipeline: a function of ``(seed, key)`` alone.

    One object serves every device of an emulator (the iteration and microbatch factors are
    the same for all); the per-device draws take the device index.

    Args:
        model: The structure.
        seed: The emulator's seed.
    """

    model: NoiseModel
    seed: int
    _key: int | None = field(default=None, init=False)
    _iteration: float = field(default=1.0, init=False)
    _microbatch: list[float] = field(default_factory=list, init=False)
    _mb_rng: random.Random = field(default_factory=random.Random, init=False)
    _episodes: dict[tuple[int, int], list[FailSlow]] = field(default_factory=dict, init=False)

    def _at(self, key: int) -> None:
        """Draw iteration ``key``'s shared factors (once per key in a row)."""
        if self._key == key:
            return
        m = self.model
        rng = random.Random(f"{self.seed}:iteration:{key}")
        self._iteration = max(0.5, 1.0 + m.iteration_cv * rng.gauss(0.0, 1.0)) * self.drift(key)
        self._microbatch = []
        self._mb_rng = rng  # the microbatch factors follow, in microbatch order
        self._key = key

    def drift(self, key: int) -> float:
        """The slow common-mode drift's factor at iteration ``key`` (smooth in ``key``)."""
        m = self.model
        if not m.drift_cv or not m.drift_periods:
            return 1.0
        phases = random.Random(f"{self.seed}:drift")
        amplitude = m.drift_cv * math.sqrt(2.0 / len(m.drift_periods))  # RMS = drift_cv
        total = 0.0
        for period in m.drift_periods:
            phase = 2.0 * math.pi * phases.random()
            total += math.sin(2.0 * math.pi * (key % (period * 1000)) / period + phase)
        return max(0.5, 1.0 + amplitude * total)

    def iteration_factor(self, key: int) -> float:
        """The factor every instruction of iteration ``key`` shares (drift included)."""
        self._at(key)
        return self._iteration

    def microbatch_factor(self, key: int, microbatch: int) -> float:
        """The factor every stage and pass of ``microbatch`` in iteration ``key`` shares."""
        if not self.model.microbatch_cv:
            return 1.0
        self._at(key)
        cv = self.model.microbatch_cv
        while len(self._microbatch) <= microbatch:
            self._microbatch.append(max(0.5, 1.0 + cv * self._mb_rng.gauss(0.0, 1.0)))
        return self._microbatch[microbatch]

    def gpu_offsets(self, device: int) -> tuple[float, float]:
        """Device ``device``'s persistent ``(time, power)`` factors."""
        rng = random.Random(f"{self.seed}:gpu:{device}")
        time_z, power_z = rng.gauss(0.0, 1.0), rng.gauss(0.0, 1.0)
        m = self.model
        return max(0.5, 1.0 + m.gpu_time_cv * time_z), max(0.5, 1.0 + m.gpu_power_cv * power_z)

    def fail_slow_factor(self, device: int, key: int) -> float:
        """Device ``device``'s fail-slow time factor at iteration ``key`` (1 outside episodes)."""
        if not self.model.fail_slow_rate:
            return 1.0
        block = key // _FAIL_SLOW_BLOCK
        factor = 1.0
        for b in (block - 1, block):  # an episode lasts at most one block
            for ep in self._block_episodes(device, b):
                if ep.start <= key < ep.end:
                    factor = max(factor, ep.factor)
        return factor

    def fail_slow_episodes(self, device: int, first_key: int, last_key: int) -> list[FailSlow]:
        """Device ``device``'s episodes that touch keys ``first_key..last_key``."""
        out = []
        for b in range(first_key // _FAIL_SLOW_BLOCK - 1, last_key // _FAIL_SLOW_BLOCK + 1):
            out += [
                ep
                for ep in self._block_episodes(device, b)
                if ep.start <= last_key and ep.end > first_key
            ]
        return out

    def _block_episodes(self, device: int, block: int) -> list[FailSlow]:
        """The episodes starting in ``block`` (Poisson count, uniform start), drawn once."""
        cached = self._episodes.get((device, block))
        if cached is not None:
            return cached
        m = self.model
        rng = random.Random(f"{self.seed}:fail-slow:{device}:{block}")
        mean = m.fail_slow_rate * _FAIL_SLOW_BLOCK / 1000.0
        count, p, threshold = 0, rng.random(), math.exp(-mean)  # Poisson by inversion
        cumulative = term = threshold
        while p > cumulative:
            count += 1
            term *= mean / count
            cumulative += term
        lo, hi = m.fail_slow_iterations
        f_lo, f_hi = m.fail_slow_factor
        episodes = []
        for _ in range(count):
            start = block * _FAIL_SLOW_BLOCK + rng.randrange(_FAIL_SLOW_BLOCK)
            duration = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            episodes.append(FailSlow(start, start + max(duration, 1), rng.uniform(f_lo, f_hi)))
        self._episodes[device, block] = episodes
        return episodes
