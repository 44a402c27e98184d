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

When hooks are given (one :class:`IterationHooks` per stage: a session, or the session's
:class:`~powerlib.runtime.apply_phase.ApplyPhase` alone, as ``powerlib simulate`` gives), every
instruction is bracketed by ``begin``/``end`` at its virtual start and end time, and ``step``
runs at the iteration end, exactly as a training loop would call them; before an iteration the
emulator calls ``start_iteration`` on every stage (twice, so that what the ranks agreed resolves
for all).

With no switch latency, no noise and an exact counter, a frequency plan realizes exactly the
time and energy that :meth:`Frontier.realized <powerlib.planning.perseus.frontier.Frontier.realized>`
computes from the profile (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from powerlib.emulator.device import EmulatedBackend, EmulatedDevice, VirtualTime
from powerlib.planning.pipeline import Instruction, Schedule, build_dag
from powerlib.planning.profile import Profile

__all__ = [
    "Emulator",
    "ExecutedInstruction",
    "IterationHooks",
    "IterationResult",
    "tables_from_profile",
]


class IterationHooks(Protocol):
    """What the emulator calls for one stage, as a training loop calls a session."""

    @property
    def phase(self) -> str:
        """What the stage is doing (recorded in :attr:`IterationResult.phases`)."""
        ...

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """An instruction starts."""
        ...

    def end(self) -> None:
        """The instruction begun last ends."""
        ...

    def step(self) -> None:
        """The iteration ended."""
        ...

    def start_iteration(self) -> None:
        """The next iteration is about to start."""
        ...


@dataclass(frozen=True, slots=True)
class ExecutedInstruction:
    """One instruction as it ran: virtual start/end and the clocks it ran at."""

    instruction: Instruction
    start_s: float
    end_s: float
    energy_j: float
    segments: tuple[tuple[float, float, float], ...]  # (start_s, end_s, freq_mhz)


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
    """

    index: int
    start_s: float
    time_s: float
    makespan_s: float
    energy_j: float
    executed: tuple[ExecutedInstruction, ...]
    phases: tuple[str, ...] = field(default=())


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


class Emulator:
    """A pipeline of emulated GPUs running a schedule in virtual time.

    Args:
        profile: Per (stage, kind, frequency) time and energy: the devices' ground truth.
        schedule: The instructions of each stage, in execution order.
        placement: ``looped`` or ``v`` (which model pieces a stage's chunks hold).
        p_block_w: Power of a waiting GPU.
        switch_latency_s: Clock-change latency.
        counter_period_s: Energy-counter update period.
        noise: Multiplicative noise (standard deviation) on every execution.
        straggler_time_s: The iteration cannot end before this (a straggler pipeline).
        seed: Noise seed (device ``i`` uses ``seed + i``).
        device_name: Name of the emulated GPUs.
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
    ) -> None:
        self.dag = build_dag(schedule, placement)
        num_stages = self.dag.num_stages
        profile.validate_for(num_stages, ())
        for ins in self.dag.instructions:
            profile.options(ins.stage, ins.kind)  # PlanError when the profile lacks the kind
        self.clock = VirtualTime()
        self.devices = [
            EmulatedDevice(
                index=s,
                table=table,
                clock=self.clock,
                p_block_w=p_block_w,
                switch_latency_s=switch_latency_s,
                counter_period_s=counter_period_s,
                noise=noise,
                seed=seed + s,
                name=device_name,
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

    def run_iteration(self, sessions: Sequence[IterationHooks] | None = None) -> IterationResult:
        """Run one iteration (through ``sessions``' hooks when given)."""
        start = self.clock.now_s
        n = len(self.dag.instructions)
        finish = [0.0] * n
        done = [False] * n
        nxt = [0] * self.num_stages
        free = [start] * self.num_stages
        executed: list[ExecutedInstruction] = []
        if sessions:  # what the ranks agreed at the last step takes effect now
            for _ in range(2):
                for session in sessions:
                    session.start_iteration()
        phases = tuple(s.phase for s in sessions) if sessions else ()
        remaining = n
        while remaining:
            best: tuple[float, int] | None = None
            for s in range(self.num_stages):
                if nxt[s] >= len(self._order[s]):
                    continue
                v = self._order[s][nxt[s]]
                if not all(done[u] for u in self._preds[v]):
                    continue
                t0 = max([free[s], *(finish[u] for u in self._preds[v])])
                if best is None or t0 < best[0]:
                    best = (t0, s)
            if best is None:  # pragma: no cover - build_dag rejects deadlocking schedules
                raise RuntimeError("the schedule deadlocks")
            t0, s = best
            v = self._order[s][nxt[s]]
            ins = self.dag.instructions[v]
            self.clock.now_s = t0
            if sessions:
                sessions[s].begin(ins.kind, ins.microbatch, ins.chunk)
            t1, energy, segments = self.devices[s].execute(ins.kind, t0)
            self.clock.now_s = t1
            if sessions:
                sessions[s].end()
            finish[v], done[v], free[s] = t1, True, t1
            nxt[s] += 1
            remaining -= 1
            executed.append(ExecutedInstruction(ins, t0, t1, energy, tuple(segments)))
        makespan_end = max(free)
        end = makespan_end
        if self.straggler_time_s is not None:
            end = max(end, start + self.straggler_time_s)
        energy = sum(d.energy_at(end) - d.energy_at(start) for d in self.devices)
        self.clock.now_s = end
        if sessions:
            for session in sessions:
                session.step()
        result = IterationResult(
            index=len(self.iterations),
            start_s=start,
            time_s=end - start,
            makespan_s=makespan_end - start,
            energy_j=energy,
            executed=tuple(executed),
            phases=phases,
        )
        self.iterations.append(result)
        return result

    def run_frequencies(self, freqs_mhz: Sequence[float]) -> IterationResult:
        """Run one iteration with each instruction (DAG node order) at ``freqs_mhz``.

        Each clock is applied exactly at its instruction's start (no session, no controller).
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
        return self.run_iteration([_FixedClocks(dev, p) for dev, p in zip(self.devices, plan)])

    def unlock_all(self) -> None:
        """Release every clock lock (back to the highest clock)."""
        for dev in self.devices:
            dev.reset_sm_clocks()


class _FixedClocks:
    """A minimal hook target: lock each instruction's clock at its begin."""

    phase = "fixed"

    def __init__(self, device: EmulatedDevice, plan: dict[tuple[str, int, int], float]) -> None:
        self._device = device
        self._plan = plan

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        freq = self._plan[(kind, microbatch, chunk)]
        latency = self._device.switch_latency_s
        self._device.switch_latency_s = 0.0
        self._device.lock_sm_clocks(freq)
        self._device.switch_latency_s = latency

    def end(self) -> None:
        return None

    def step(self) -> None:
        return None

    def start_iteration(self) -> None:
        return None
