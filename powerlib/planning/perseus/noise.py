"""Where run-to-run noise in instruction times is shared: the structure the slowdown guard plans for.

Real pipeline-parallel training does not jitter each instruction independently. ByteDance's
public Megatron traces (Wu et al., "Understanding Stragglers in Large Model Training Using What-if
Analysis", OSDI'25, arXiv 2505.05713) split a 1.6-2.7 % coefficient of variation of forward and
backward times into three parts (docs/emulator.md, "The noise model"):

- a factor per **iteration**, shared by every instruction of every stage (0.6-2.2 %): it
  stretches all-max and a plan alike, so it costs a plan almost nothing;
- a factor per **microbatch**, shared by every stage and both passes of that microbatch
  (1.1-2.0 % with variable-length data; zero with fixed-length data): it adds up along a
  microbatch's chain through the pipeline;
- an **independent** part per instruction (0.34-0.94 %): it is what makes many near-critical
  paths cost time (the iteration waits for the slowest of them).

Independent 2 % per instruction (:meth:`TimeNoise.iid`) is the stress case the guard was first
built for (issue 32). The profile sweep estimates the three parts from its spans
(:func:`powerlib.runtime.noise_estimate.estimate_time_noise`); the guard's noisy replay
(:class:`NoisyReplay`) draws them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from powerlib.planning.perseus.frequency_options import Option
from powerlib.planning.perseus.replay import ReplayModel, at_freq, layout_of

__all__ = ["LOWERED_ROW_SE", "NoisyReplay", "TimeNoise"]

LOWERED_ROW_SE = 1.0
"""How many standard errors long the noisy replay reads a row below the top clock: the planner
lowers the clocks whose times measured short (the winner's curse), so their errors are not
centred on zero."""


@dataclass(frozen=True, slots=True)
class TimeNoise:
    """Run-to-run spread of instruction times by what shares it (relative standard deviations).

    Attributes:
        iteration_cv: One factor per iteration, every instruction of every stage.
        microbatch_cv: One factor per (iteration, microbatch), every stage and pass.
        independent_cv: Each instruction's own.
    """

    iteration_cv: float = 0.0
    microbatch_cv: float = 0.0
    independent_cv: float = 0.0

    def __post_init__(self) -> None:
        for name in ("iteration_cv", "microbatch_cv", "independent_cv"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value < 1.0):
                raise ValueError(f"{name} must be in [0, 1), not {value}")

    @classmethod
    def iid(cls, cv: float) -> TimeNoise:
        """Independent noise only: every instruction its own ``cv`` (the stress case)."""
        return cls(independent_cv=cv)

    @property
    def total_cv(self) -> float:
        """The spread of one instruction's time, all parts together."""
        return math.sqrt(self.iteration_cv**2 + self.microbatch_cv**2 + self.independent_cv**2)

    @property
    def is_zero(self) -> bool:
        """No noise at all."""
        return self.total_cv == 0.0

    def to_json(self) -> dict[str, float]:
        """The three parts as a JSON object."""
        return {
            "iteration_cv": self.iteration_cv,
            "microbatch_cv": self.microbatch_cv,
            "independent_cv": self.independent_cv,
        }

    def describe(self) -> str:
        """One line, e.g. ``1 % per iteration, 0 % per microbatch, 0.4 % independent``."""
        return (
            f"{100 * self.iteration_cv:.2g} % per iteration, "
            f"{100 * self.microbatch_cv:.2g} % per microbatch, "
            f"{100 * self.independent_cv:.2g} % independent"
        )


class NoisyReplay:
    """The iteration time of per-instruction options under run-to-run noise, over fixed draws.

    Every instruction's time is multiplied by its noise factor, drawn once per (sample,
    instruction) and reused for every plan replayed, so two plans (and all-max) are compared on
    the same noise. The factor has the structure of :class:`~powerlib.planning.perseus.noise.
    TimeNoise`: one part per sample (the iteration), one per (sample, microbatch) shared by every
    stage and pass of that microbatch, one per (sample, instruction). With ``latency_samples_s``
    each clock switch of each sample lands after a latency drawn from them (the measured
    distribution, not one quantile of it). Replays all samples at once (numpy, one vector op per
    instruction), with the clock-change latency of :func:`replay_options` (one pass: the
    wrap-around gap of an iteration's first instruction is taken as ample).

    The point (issue 32): a plan that spends the slack of many paths makes them all just
    critical; under noise the iteration waits for the slowest of them, so its *expected* time
    exceeds all-max's although its nominal time does not. How much depends on what the noise
    shares (issue 45): a factor shared by a whole iteration moves every path together and costs
    nothing; a microbatch's factor adds up along its chain; only the independent part makes the
    slowest of many paths slower. The slowdown guard
    (:func:`powerlib.planning.perseus.guard.within_slowdown`) checks the expectation.

    Args:
        model: The DAG and the measured profile.
        cv: Relative standard deviation of an instruction's time, independent per instruction
            (when ``noise`` is not given).
        noise: The noise's structure (overrides ``cv``).
        row_se: Relative standard error of a profiled row's mean time: each draw also scales
            every (stage, kind, clock) by one factor, for the error of the profile itself (a
            plan that spends all slack on measured times realizes slower when they are low).
        latency_samples_s: Measured clock-change latencies to draw each switch's from; empty:
            the latency :meth:`run` is given.
        samples: Noise draws.
        seed: Seed of the draws.
        row_groups: The profile's own error is drawn once per group of ``samples //
            row_groups`` consecutive samples (default: once per sample): each group is one
            possible truth of the profile, its samples the run-to-run noise around it
            (:meth:`group_means`).
    """

    def __init__(
        self,
        model: ReplayModel,
        cv: float = 0.0,
        *,
        noise: TimeNoise | None = None,
        row_se: float = 0.0,
        latency_samples_s: Sequence[float] = (),
        samples: int = 128,
        seed: int = 0,
        row_groups: int | None = None,
    ) -> None:
        self._model = model
        row_groups = samples if row_groups is None else row_groups
        dag = model.dag
        self._layout = layout_of(dag)
        self._next = [-1] * len(dag.instructions)  # each node's same-stage successor
        for node, before in enumerate(self._layout.prev):
            if before >= 0:
                self._next[before] = node
        rng = np.random.default_rng(seed)
        n = len(dag.instructions)
        noise = noise if noise is not None else TimeNoise.iid(cv)
        self.noise = noise
        factors = 1.0 + noise.independent_cv * rng.standard_normal((n, samples))
        if noise.microbatch_cv > 0:
            mbs = np.array([ins.microbatch for ins in dag.instructions], dtype=np.int64)
            per_mb = 1.0 + noise.microbatch_cv * rng.standard_normal((int(mbs.max()) + 1, samples))
            factors = factors * per_mb[mbs]
        if noise.iteration_cv > 0:
            factors = factors * (1.0 + noise.iteration_cv * rng.standard_normal(samples))
        self.factors = np.clip(factors, 0.5, None)
        self.latency_s: np.ndarray | None = None
        if len(latency_samples_s):
            pool = np.asarray(latency_samples_s, dtype=float)
            self.latency_s = pool[rng.integers(0, pool.size, size=(n, samples))]
        self.samples = samples
        if row_groups < 1 or samples % row_groups:
            raise ValueError(f"row_groups must divide samples ({samples}), not {row_groups}")
        self.row_groups = row_groups
        self._row_se = row_se
        self._rng = rng
        self._rows: dict[tuple[int, str, float], np.ndarray] = {}
        self._top = {k: max(o.freq_mhz for o in opts) for k, opts in model.options.items()}

    def _row(self, stage: int, kind: str, freq_mhz: float) -> np.ndarray | float:
        """The draws' factor for a profiled row (the same wherever the row is used)."""
        if self._row_se <= 0:
            return 1.0
        key = (stage, kind, freq_mhz)
        got = self._rows.get(key)
        if got is None:
            # A row below the top clock is read one standard error long: the planner lowers
            # the clocks whose measured times came out short (the winner's curse), so their
            # errors are not centred on zero.
            lowered = freq_mhz < self._top.get((stage, kind), freq_mhz)
            mean = 1.0 + (LOWERED_ROW_SE * self._row_se if lowered else 0.0)
            # one error per group of samples: a group is one possible truth of the profile
            per_group = self._rng.standard_normal(self.row_groups)
            got = self._rows[key] = np.clip(
                mean + self._row_se * np.repeat(per_group, self.samples // self.row_groups),
                0.5,
                None,
            )
        return got

    def group_means(self, values: np.ndarray) -> np.ndarray:
        """The mean of ``values`` (one per sample) over each group's samples."""
        means: np.ndarray = values.reshape(self.row_groups, -1).mean(axis=1)
        return means

    def run(
        self, chosen: Sequence[Option], switch_latency_s: float
    ) -> tuple[np.ndarray, list[int]]:
        """``(makespan per sample, how many samples each node was critical in)``."""
        layout = self._layout
        preds, prev, topo = layout.preds, layout.prev, layout.topo
        n = len(chosen)
        k = self.samples
        finish = np.zeros((n, k))
        busy = np.zeros((n, k))
        via = np.full((n, k), -1, dtype=np.int64)
        model = self._model
        dag = model.dag
        nxt = self._next
        for v in topo:
            start = np.zeros(k)
            src = np.full(k, -1, dtype=np.int64)
            for u in preds[v]:
                later = finish[u] > start
                start = np.where(later, finish[u], start)
                src = np.where(later, u, src)
            option = chosen[v]
            ins = dag.instructions[v]
            duration = (
                option.time_s * self.factors[v] * self._row(ins.stage, ins.kind, option.freq_mhz)
            )
            u = prev[v]
            latency: np.ndarray | float = (
                switch_latency_s if self.latency_s is None else self.latency_s[v]
            )
            switched = u >= 0 and chosen[u].freq_mhz != option.freq_mhz
            if switched and (self.latency_s is not None or switch_latency_s > 0):
                gap = start - finish[u]
                ahead = model.requested_after_s(chosen[u], option)
                if ahead is not None:  # requested before u ended
                    gap = gap + busy[u] - ahead
                slow = latency - gap
                old_t, _ = at_freq(model, ins, chosen[u].freq_mhz)
                old_t *= self.factors[v] * self._row(ins.stage, ins.kind, chosen[u].freq_mhz)
                work = np.clip(slow / old_t, 0.0, 1.0)
                penalized = slow > 0
                duration = np.where(
                    penalized,
                    np.where(work >= 1.0, old_t, slow + (1.0 - work) * duration),
                    duration,
                )
            w = nxt[v]
            if w >= 0 and model.request_ahead_s is not None:
                after = model.requested_after_s(option, chosen[w])
                if after is not None:  # the next clock lands in v's tail
                    landing = after + (
                        switch_latency_s if self.latency_s is None else self.latency_s[w]
                    )
                    fast_t, _ = at_freq(model, ins, chosen[w].freq_mhz)
                    scale = fast_t / option.time_s
                    duration = np.where(
                        landing < duration, landing + (duration - landing) * scale, duration
                    )
            busy[v] = duration
            finish[v] = start + duration
            via[v] = src
        makespan = finish.max(axis=0)
        ends = finish.argmax(axis=0)
        critical = [0] * n
        for s in range(k):
            v = int(ends[s])
            while v >= 0:
                critical[v] += 1
                v = int(via[v, s])
        return makespan, critical
