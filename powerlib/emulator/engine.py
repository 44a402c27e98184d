"""Virtual-time pipeline execution: the ground truth for the demo, benchmarks and tests.

:class:`Emulator` runs a pipeline schedule iteration by iteration on one
:class:`~powerlib.emulator.device.EmulatedDevice` per stage:

- each stage runs its instructions in schedule order; a forward waits for the previous stage's
  forward of the same microbatch (and chunk), a backward for the next stage's backward: the
  edges of :func:`~powerlib.planning.pipeline.build_dag`;
- an instruction's duration and energy come from the device's table at the clock in force,
  including a clock change that lands part-way through;
- a stage draws ``p_block_w`` while it waits, until the iteration ends; the iteration ends when
  the last instruction finishes, or at ``straggler_time_s`` if a slower data-parallel pipeline
  holds the gradient synchronisation until then (docs/perseus.md §1.5: extrinsic bloat).

It is a discrete-event simulation (docs/perseus.md §5.5): instruction begins and ends are
processed from a priority queue in time order (ties: ends first, then stage order), and virtual
time only moves forward, through :meth:`VirtualTime.advance_to
<powerlib.emulator.device.VirtualTime.advance_to>`, which runs the clock's timers (a sampler
"thread") on the way. When hooks are given (one :class:`IterationHooks` per stage: a session, or
the session's :class:`~powerlib.runtime.apply_phase.ApplyPhase` alone, as ``powerlib simulate``
gives), every instruction is bracketed by ``begin``/``end`` at its virtual start and end time, and
``step`` runs at the iteration end, exactly as a training loop would call them; before an
iteration the emulator calls ``start_iteration`` on every stage (twice, so that what the ranks
agreed resolves for all). Driver reads a ``begin`` or ``end`` hook makes cost its stage
``read_cost_s`` each (docs/measurement.md §1): the instruction starts that much later, or the
stage is free that much later; reads from timers cost the training thread nothing.

:class:`NvmlLikeModel` bundles the device knobs: :data:`NVML_LIKE_MODEL` (what a GPU does,
docs/peers.md §4.2-4.3) and :data:`IDEAL_MODEL` (only to validate the planner).

With no switch latency, no noise and an exact counter, a frequency plan realizes exactly the
time and energy that :meth:`Frontier.realized <powerlib.planning.perseus.frontier.Frontier.realized>`
computes from the profile (tested).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from powerlib.emulator.device import EmulatedBackend, EmulatedDevice, VirtualTime, _check_knobs
from powerlib.emulator.event_loop import (
    ExecutedInstruction,
    IterationHooks,
    _FixedClocks,
    _IterationRun,
)
from powerlib.emulator.noise_model import (
    FIXED_LENGTH,
    IID,
    NoiseDraws,
    NoiseModel,
    noise_preset,
    offset_profile,
)
from powerlib.planning.perseus.noise import TimeNoise
from powerlib.planning.pipeline import Schedule, build_dag
from powerlib.planning.profile import Profile

__all__ = [
    "IDEAL_MODEL",
    "LIVE_NOISE_KEYS",
    "NVML_LIKE_MODEL",
    "Emulator",
    "ExecutedInstruction",
    "IterationHooks",
    "IterationResult",
    "NvmlLikeModel",
    "tables_from_profile",
]


@dataclass(frozen=True, slots=True)
class IterationResult:
    """One emulated iteration.

    Attributes:
        index: Iteration number, from 0.
        start_s: Virtual start.
        time_s: Iteration time (to the gradient synchronisation).
        makespan_s: When the pipeline's last instruction finished, from the start.
        energy_j: Energy of every device over the iteration, blocking included (exact).
        executed: Every instruction as it ran.
        phases: Each session's phase during the iteration (empty without sessions).
        stall_s: Time the stages' hooks spent in driver reads, summed over stages.
    """

    index: int
    start_s: float
    time_s: float
    makespan_s: float
    energy_j: float
    executed: tuple[ExecutedInstruction, ...]
    phases: tuple[str, ...] = field(default=())
    stall_s: float = 0.0


@dataclass(frozen=True, slots=True)
class NvmlLikeModel:
    """What an emulated GPU does besides its profile table (docs/peers.md §4.2-4.3).

    Attributes:
        counter_period_s: Energy-counter publication period (NVML: about 100 ms, measured
            0.0998 s on an H200).
        duty: Share of each counter period, at its end, in which power is sampled (A100/H100:
            0.25, Yang et al., arXiv 2312.02741).
        read_cost_s: Cost of one driver read to the thread that makes it (H200: 2.6-3.1 ms).
        switch_latency_s: Mean clock-change landing latency.
        latency_spread: Each change lands after ``switch_latency_s * U(1 - spread, 1 + spread)``.
        noise: Run-to-run multiplicative noise (standard deviation) of every execution's own:
            the independent part of :attr:`noise_model` (the only part when it has no
            structure).
        drift: Thermal drift: powers rise by up to this share, with time constant ``drift_tau_s``.
        drift_tau_s: Time constant of the drift.
        counter_phase: Counter publication phase: seconds (every device), or ``"random"``:
            each device draws one uniformly in ``[0, counter_period_s)`` from the seed.
        name: What :meth:`describe` calls it.
        noise_model: Where the rest of the noise is shared (per iteration and drift, per
            microbatch, per-GPU offsets, fail-slows; :mod:`powerlib.emulator.noise_model`).
            Default: fixed-length data, the structure of real Megatron traces.
    """

    counter_period_s: float = 0.1
    duty: float = 1.0
    read_cost_s: float = 0.003
    switch_latency_s: float = 0.02
    latency_spread: float = 0.5
    noise: float = 0.004
    drift: float = 0.02
    drift_tau_s: float = 60.0
    counter_phase: float | Literal["random"] = "random"
    name: str = "NVML-like"
    noise_model: NoiseModel = FIXED_LENGTH

    def __post_init__(self) -> None:
        if self.counter_phase != "random" and isinstance(self.counter_phase, str):
            raise ValueError(
                f"counter_phase must be seconds or 'random', not {self.counter_phase!r}"
            )
        _check_knobs(
            counter_period_s=self.counter_period_s,
            counter_phase_s=0.0 if self.counter_phase == "random" else self.counter_phase,
            duty=self.duty,
            read_cost_s=self.read_cost_s,
            switch_latency_s=self.switch_latency_s,
            latency_spread=self.latency_spread,
            noise=self.noise,
            drift=self.drift,
            drift_tau_s=self.drift_tau_s,
        )

    def to_json(self) -> dict[str, object]:
        """The model as a JSON object (every field; ``noise_model`` as its own object)."""
        out = dataclasses.asdict(self)
        out["noise_model"] = self.noise_model.to_json()
        return out

    def time_noise(self) -> TimeNoise:
        """Per iteration (no drift), per microbatch, independent (:attr:`noise`): for oracles."""
        return self.noise_model.time_noise(self.noise)

    def with_noise_model(
        self, noise_model: str | NoiseModel, noise: float | None = None
    ) -> NvmlLikeModel:
        """This model with a noise structure or preset (``noise=None``: the preset's own).

        Raises:
            ValueError: An unknown preset name.
        """
        structure, default = (
            noise_preset(noise_model) if isinstance(noise_model, str) else (noise_model, self.noise)
        )
        noise = default if noise is None else noise
        return dataclasses.replace(self, noise_model=structure, noise=noise)

    def describe(self) -> str:
        """One line, e.g. ``NVML-like: 100 ms counter, 3 ms reads, 20 ms ± 50 % clock latency, ...``."""

        def ms(x: float) -> str:
            return f"{x * 1e3:g} ms"

        def pct(x: float) -> str:
            return f"{x * 1e2:g} %"

        parts = [
            f"{ms(self.counter_period_s)} counter" if self.counter_period_s else "exact counter"
        ]
        if self.duty < 1:
            parts.append(f"{pct(self.duty)} power sampling")
        parts.append(f"{ms(self.read_cost_s)} reads" if self.read_cost_s else "free reads")
        spread = f" ± {pct(self.latency_spread)}" if self.latency_spread else ""
        parts.append(f"{ms(self.switch_latency_s)}{spread} clock latency")
        parts.append(self.noise_model.describe(self.noise))
        parts.append(f"{pct(self.drift)} thermal drift" if self.drift else "no thermal drift")
        return f"{self.name}: " + ", ".join(parts)


NVML_LIKE_MODEL = NvmlLikeModel()
"""What a GPU does: the default of issue 32's demo and simulate."""

IDEAL_MODEL = NvmlLikeModel(
    counter_period_s=0.001,
    duty=1.0,
    read_cost_s=0.0,
    switch_latency_s=0.005,
    latency_spread=0.0,
    noise=0.0,
    drift=0.0,
    counter_phase=0.0,
    name="ideal",
    noise_model=IID,
)
"""The idealized device: only to validate the planner (docs/perseus.md §5.5)."""

_DEFAULT_KNOBS = NvmlLikeModel(
    counter_period_s=0.0,
    duty=1.0,
    read_cost_s=0.0,
    switch_latency_s=0.0,
    latency_spread=0.0,
    noise=0.0,
    drift=0.0,
    drift_tau_s=60.0,
    counter_phase=0.0,
    name="custom",
    noise_model=IID,
)  # the Emulator's keyword defaults: the ideal device with an exact counter


def tables_from_profile(
    profile: Profile, num_stages: int
) -> list[dict[str, dict[float, tuple[float, float]]]]:
    """Per stage: ``{kind: {freq_mhz: (time_s, energy_j)}}`` from a profile."""
    tables: list[dict[str, dict[float, tuple[float, float]]]] = [dict() for _ in range(num_stages)]
    for row in profile.rows:
        if row.stage < num_stages:
            tables[row.stage].setdefault(row.instruction, {})[row.freq_mhz] = (
                row.time_s,
                row.energy_j,
            )
    return tables


LIVE_NOISE_KEYS = 10**9
"""Unkeyed iterations draw structured noise from key ``LIVE_NOISE_KEYS + iteration index``."""


def _counter_phases(model: NvmlLikeModel, seed: int, num_stages: int) -> list[float]:
    """Each device's counter phase: the model's, or drawn from ``seed`` when ``random``."""
    period = model.counter_period_s
    if model.counter_phase != "random":
        return [float(model.counter_phase)] * num_stages
    draw = random.Random(f"{seed}:counter-phase")
    return [min(period * draw.random(), period * (1 - 1e-12)) for _ in range(num_stages)]


class Emulator:
    """A pipeline of emulated GPUs running a schedule in virtual time.

    The device knobs come either from ``model`` (an :class:`NvmlLikeModel`, e.g.
    :data:`NVML_LIKE_MODEL`) or from the individual keyword arguments, whose defaults are the
    ideal device (exact counter, free reads, no latency, noise or drift); giving ``model`` and a
    knob away from its default is refused. :attr:`model` holds what the devices run either way.

    Args:
        profile: Per (stage, kind, frequency) time and energy: the devices' ground truth.
        schedule: The instructions of each stage, in execution order.
        placement: ``looped`` or ``v`` (which model pieces a stage's chunks hold).
        p_block_w: Power of a waiting GPU.
        switch_latency_s: Mean clock-change latency.
        counter_period_s: Energy-counter publication period.
        noise: Multiplicative noise (standard deviation) of every execution's own.
        straggler_time_s: The iteration cannot end before this (a straggler pipeline), times
            the iteration's job-wide noise factor (per iteration and drift: the straggler is a
            pipeline of the same job).
        seed: Noise seed (device ``i`` uses ``seed + i``); also seeds the latency draws and a
            random counter phase, each from a stream of its own.
        device_name: Name of the emulated GPUs.
        read_cost_s: Cost of one driver read made in a ``begin``/``end`` hook.
        duty: Share of each counter period in which power is sampled.
        latency_spread: Relative half-width of the uniform clock-latency draw.
        drift: Thermal drift of every power (share reached after a few ``drift_tau_s``).
        drift_tau_s: Time constant of the drift.
        counter_phase: Counter publication phase in seconds, or ``"random"``: each device draws
            one uniformly in ``[0, counter_period_s)`` from ``seed``.
        noise_model: Where the rest of the noise is shared (default: nowhere, only ``noise``).
        model: All of the knobs above at once.

    Attributes:
        noise_draws: The structured noise's shared draws, a function of ``(seed, key)``.
    """

    def __init__(
        self,
        profile: Profile,
        schedule: Schedule,
        *,
        placement: str = "looped",
        p_block_w: float,
        switch_latency_s: float = 0.0,
        counter_period_s: float = 0.0,
        noise: float = 0.0,
        straggler_time_s: float | None = None,
        seed: int = 0,
        device_name: str = "Emulated GPU",
        read_cost_s: float = 0.0,
        duty: float = 1.0,
        latency_spread: float = 0.0,
        drift: float = 0.0,
        drift_tau_s: float = 60.0,
        counter_phase: float | Literal["random"] = 0.0,
        noise_model: NoiseModel = IID,
        model: NvmlLikeModel | None = None,
    ) -> None:
        knobs = NvmlLikeModel(
            counter_period_s=counter_period_s,
            duty=duty,
            read_cost_s=read_cost_s,
            switch_latency_s=switch_latency_s,
            latency_spread=latency_spread,
            noise=noise,
            drift=drift,
            drift_tau_s=drift_tau_s,
            counter_phase=counter_phase,
            name="custom",
            noise_model=noise_model,
        )
        if model is not None and knobs != _DEFAULT_KNOBS:
            raise ValueError("give the emulator either model= or individual device knobs, not both")
        self.model = model = model or knobs
        self.profile = profile
        self.noise_draws = NoiseDraws(model.noise_model, seed)
        self.dag = build_dag(schedule, placement)
        num_stages = self.dag.num_stages
        profile.validate_for(num_stages, ())
        for ins in self.dag.instructions:
            profile.options(ins.stage, ins.kind)  # PlanError when the profile lacks the kind
        self.clock = VirtualTime()
        phases = _counter_phases(model, seed, num_stages)
        self.devices = [
            EmulatedDevice(
                index=s,
                table=table,
                clock=self.clock,
                p_block_w=p_block_w,
                switch_latency_s=model.switch_latency_s,
                counter_period_s=model.counter_period_s,
                noise=model.noise,
                seed=seed + s,
                name=device_name,
                read_cost_s=model.read_cost_s,
                counter_phase_s=phases[s],
                duty=model.duty,
                latency_spread=model.latency_spread,
                drift=model.drift,
                drift_tau_s=model.drift_tau_s,
                noise_draws=self.noise_draws,
            )
            for s, table in enumerate(tables_from_profile(profile, num_stages))
        ]
        self.backend = EmulatedBackend(self.devices)
        self.p_block_w = p_block_w
        self.straggler_time_s = straggler_time_s
        self._order = [self.dag.stage_order(s) for s in range(num_stages)]
        self._preds: list[list[int]] = [[] for _ in self.dag.instructions]
        stage_of = [ins.stage for ins in self.dag.instructions]
        for u, v in self.dag.edges:
            if stage_of[u] != stage_of[v]:
                self._preds[v].append(u)
        self.iterations: list[IterationResult] = []

    @property
    def num_stages(self) -> int:
        """Pipeline stages (= devices)."""
        return self.dag.num_stages

    def run_iteration(
        self, sessions: Sequence[IterationHooks] | None = None, *, noise_key: int | None = None
    ) -> IterationResult:
        """Run one iteration (through ``sessions``' hooks when given).

        Args:
            sessions: One hook target per stage.
            noise_key: When given, every device draws this iteration's noise from
                ``(seed, device, noise_key)``: two iterations with the same key see the same noise
                instruction by instruction (paired comparisons); different keys, different noise.
                Without it, structured noise is keyed by ``LIVE_NOISE_KEYS + index`` (a key space
                of its own); noise without structure runs on from the devices' streams.
        """
        clock = self.clock
        start = clock.now_s
        if noise_key is None and not self.model.noise_model.is_iid:
            noise_key = LIVE_NOISE_KEYS + len(self.iterations)
        if noise_key is not None:
            for dev in self.devices:
                dev.reseed_noise(noise_key)
        if sessions:  # what the ranks agreed at the last step takes effect now
            for _ in range(2):
                for session in sessions:
                    session.start_iteration()
        phases = tuple(s.phase for s in sessions) if sessions else ()
        run = _IterationRun(self, sessions, start)
        run.run()
        makespan_end = max(run.free)
        end = makespan_end
        if self.straggler_time_s is not None:
            common = 1.0 if noise_key is None else self.noise_draws.iteration_factor(noise_key)
            end = max(end, start + self.straggler_time_s * common)
        clock.advance_to(end)
        energy = sum(d.energy_at(end) - d.energy_at(start) for d in self.devices)
        if sessions:
            for session in sessions:
                session.step()
        result = IterationResult(
            index=len(self.iterations),
            start_s=start,
            time_s=end - start,
            makespan_s=makespan_end - start,
            energy_j=energy,
            executed=tuple(run.executed),
            phases=phases,
            stall_s=sum(run.stall),
        )
        self.iterations.append(result)
        return result

    def run_frequencies(
        self, freqs_mhz: Sequence[float], *, noise_key: int | None = None
    ) -> IterationResult:
        """Run one iteration with each instruction (DAG node order) at ``freqs_mhz``.

        Each clock is applied exactly at its instruction's start (no session, no controller);
        ``noise_key`` as for :meth:`run_iteration`.
        """
        by_node = dict(zip(range(len(self.dag.instructions)), freqs_mhz))
        node_of = {ins: i for i, ins in enumerate(self.dag.instructions)}
        plan = [
            {
                (ins.kind, ins.microbatch, ins.chunk): by_node[node_of[ins]]
                for ins in (self.dag.instructions[i] for i in order)
            }
            for order in self._order
        ]
        hooks = [_FixedClocks(dev, p) for dev, p in zip(self.devices, plan)]
        return self.run_iteration(hooks, noise_key=noise_key)

    def truth_profile(self) -> Profile:
        """The profile the GPUs really run: each stage's persistent offsets applied (no drift)."""
        offsets = [(d.gpu_time_factor, d.gpu_power_factor) for d in self.devices]
        return offset_profile(self.profile, offsets)

    def unlock_all(self) -> None:
        """Release every clock lock (back to the highest clock)."""
        for dev in self.devices:
            dev.reset_sm_clocks()

    def set_power_limits(self, limits_w: Sequence[float | None] | None) -> None:
        """Hold each device to a power limit (``None``: no limit), from its next instruction on.

        Each device's clocks throttle to hold its limit, and it waits at ``min(p_block_w,
        limit)`` (:attr:`EmulatedDevice.power_limit_w
        <powerlib.emulator.device.EmulatedDevice.power_limit_w>`; docs/perseus.md "Power
        budgets"). Set them between iterations.

        Raises:
            ValueError: Not one limit per device, or a limit that is not a positive number.
        """
        limits = [None] * self.num_stages if limits_w is None else list(limits_w)
        if len(limits) != self.num_stages:
            raise ValueError(f"{len(limits)} power limits for {self.num_stages} devices")
        for dev, limit in zip(self.devices, limits):
            if limit is not None and not (math.isfinite(limit) and limit > 0):
                raise ValueError(f"a power limit must be a positive number of watts, not {limit}")
            dev.power_limit_w = None if limit is None else float(limit)
