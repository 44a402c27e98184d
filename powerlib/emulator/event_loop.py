"""The emulator's event loop: one iteration in virtual time, instruction by instruction.

:class:`~powerlib.emulator.engine.Emulator` runs each iteration through :class:`_IterationRun`
(docs/perseus.md §5.5: a discrete-event simulation). Begins and ends are processed from a
priority queue in time order (ties: ends first, then stage order); the virtual clock's timers
run before any event at or after their time, so a clock change a timer requests (a sampler's
read costs nothing; the frequency controller's delayed request, docs/runtime.md "Requesting
clocks ahead") reaches the instruction running when it lands: the device re-times it
(:meth:`EmulatedDevice.execute <powerlib.emulator.device.EmulatedDevice.execute>`), and the
loop moves its end, dropping the end it had before.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from powerlib.emulator.device import EmulatedDevice, VirtualTime
from powerlib.planning.pipeline import Instruction, PipelineDAG

__all__ = ["ExecutedInstruction", "IterationHooks"]

_END, _BEGIN = 0, 1  # event kinds, in the order ties are processed


class IterationHooks(Protocol):
    """What the emulator calls for one stage, as a training loop calls a session."""

    @property
    def phase(self) -> str:
        """What the stage is doing (recorded in :attr:`~powerlib.emulator.engine.IterationResult.phases`)."""
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


class _Pipeline(Protocol):
    """What an iteration needs of its :class:`~powerlib.emulator.engine.Emulator`."""

    dag: PipelineDAG
    devices: list[EmulatedDevice]
    clock: VirtualTime
    _order: list[list[int]]  # per stage, its node indices in execution order
    _preds: list[list[int]]  # per node, the nodes of other stages it waits for

    @property
    def num_stages(self) -> int:
        """Pipeline stages (= devices)."""
        ...


@dataclass(frozen=True, slots=True)
class ExecutedInstruction:
    """One instruction as it ran: virtual start/end and the clocks it ran at."""

    instruction: Instruction
    start_s: float
    end_s: float
    energy_j: float
    segments: tuple[tuple[float, float, float], ...]  # (start_s, end_s, freq_mhz)


class _IterationRun:
    """One iteration in virtual time, event by event (``Emulator.run_iteration`` runs it).

    A stage's next instruction begins once the stage is free and the instructions it depends
    on have ended; ends are processed before begins at the same instant. The hooks run on the
    stage's thread: the driver reads they make delay the stage (:attr:`stall`). The clock's
    timers run before any event at or after their time: a clock change one requests (the
    controller's request ahead) re-times the instruction it lands in, whose end moves.

    Attributes:
        free: Per stage, when it is free again (after its last instruction and end hook).
        stall: Per stage, the time its hooks' driver reads cost it.
        executed: The instructions run, in the order they began.
    """

    def __init__(
        self, emulator: _Pipeline, sessions: Sequence[IterationHooks] | None, start: float
    ) -> None:
        self._emu = emulator
        self._sessions = sessions
        n = len(emulator.dag.instructions)
        num_stages = emulator.num_stages
        self._finish = [0.0] * n
        self._done = [False] * n
        self._next = [0] * num_stages
        self._queued = [False] * num_stages  # the stage's next instruction is in flight
        self._events: list[tuple[float, int, int, int]] = []  # (time, _END/_BEGIN, stage, node)
        self._flight: list[tuple[int, float, int] | None] = [None] * num_stages  # (v, end, k)
        self.free = [start] * num_stages
        self.stall = [0.0] * num_stages
        self.executed: list[ExecutedInstruction] = []

    def run(self) -> None:
        """Run every instruction of the schedule."""
        emu, sessions = self._emu, self._sessions
        for s in range(emu.num_stages):
            self._release(s)
        clock = emu.clock
        while self._events:
            t, event, s, v = self._events[0]
            if event == _END and (self._flight[s] or (-1,))[:2] != (v, t):
                heapq.heappop(self._events)  # the end it had before a clock change re-timed it
                continue
            due = clock.next_due_s()
            if due is not None and due <= t:  # a timer first: it may re-time a running one
                clock.advance_to(max(due, clock.now_s))
                self._retimed()
                continue
            heapq.heappop(self._events)
            clock.advance_to(t)
            ins = emu.dag.instructions[v]
            if event == _BEGIN:
                t0 = t
                if sessions:
                    t0 += self._charged(s, sessions[s].begin, ins.kind, ins.microbatch, ins.chunk)
                t1, energy, segments = emu.devices[s].execute(
                    ins.kind, t0, microbatch=ins.microbatch
                )
                self._flight[s] = (v, t1, len(self.executed))
                self.executed.append(ExecutedInstruction(ins, t0, t1, energy, tuple(segments)))
                heapq.heappush(self._events, (t1, _END, s, v))
                continue
            self._flight[s] = None
            self._finish[v], self._done[v] = t, True
            self.free[s] = t + (self._charged(s, sessions[s].end) if sessions else 0.0)
            self._queued[s] = False
            self._next[s] += 1
            for stage in range(emu.num_stages):
                self._release(stage)
        if len(self.executed) < len(emu.dag.instructions):  # pragma: no cover - build_dag
            raise RuntimeError("the schedule deadlocks")  # rejects deadlocking schedules

    def _retimed(self) -> None:
        """Re-push the end of each running instruction that a clock change re-timed."""
        for s, flight in enumerate(self._flight):
            execution = self._emu.devices[s].execution
            if flight is None or execution is None or execution[0] == flight[1]:
                continue
            v, _, k = flight
            end_s, energy_j, segments = execution
            self.executed[k] = dataclasses.replace(
                self.executed[k], end_s=end_s, energy_j=energy_j, segments=segments
            )
            self._flight[s] = (v, end_s, k)
            heapq.heappush(self._events, (end_s, _END, s, v))

    def _release(self, s: int) -> None:
        """Queue stage ``s``'s next instruction's begin once the stage and its inputs are done."""
        order = self._emu._order[s]
        if self._queued[s] or self._next[s] >= len(order):
            return
        v = order[self._next[s]]
        preds = self._emu._preds[v]
        if all(self._done[u] for u in preds):
            self._queued[s] = True
            t0 = max([self.free[s], *(self._finish[u] for u in preds)])
            heapq.heappush(self._events, (t0, _BEGIN, s, v))

    def _charged(self, s: int, hook: Callable[..., None], *args: object) -> float:
        """Run ``hook(*args)`` on stage ``s``'s thread; returns what its driver reads cost it."""
        dev = self._emu.devices[s]
        before = dev.reads
        hook(*args)
        cost = (dev.reads - before) * dev.read_cost_s
        dev.stall_s += cost
        self.stall[s] += cost
        return cost


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
