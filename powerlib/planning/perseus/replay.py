"""Replaying per-instruction options on the measured profile: realized time, energy, critical path.

The planner works on fitted, quantized costs; :func:`replay_options` runs a plan's options
through the instruction DAG with their *measured* times and energies (and, optionally, the
clock-change latency) to see what the plan would realize. Everything here reads a
:class:`ReplayModel`: only what a replay needs (the DAG, the options, the measured rows, τ and
``P_block``), which ``Frontier.model`` builds, so that this module and the slowdown guard
(:mod:`powerlib.planning.perseus.guard`) need nothing else of the planner. ``Frontier.realized``
and the guard are built on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from powerlib.planning.perseus.frequency_options import Option, frequency_for
from powerlib.planning.pipeline import Instruction, PipelineDAG

__all__ = [
    "IncrementalReplay",
    "Layout",
    "NoisyReplay",
    "ReplayModel",
    "Run",
    "at_freq",
    "critical_path_s",
    "layout_of",
    "replay_options",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayModel:
    """What a replay and the slowdown guard read of a planned workload.

    Attributes:
        dag: The instruction DAG.
        options: (stage, kind) -> its Pareto-optimal, quantized options
            (:func:`~powerlib.planning.perseus.frequency_options.prepare_options`), fastest first.
        measured: (stage, kind) -> frequency -> measured ``(time_s, energy_j)``, every profiled
            frequency (the fastest option where a clock has several).
        unit_time_s: The time quantum τ.
        p_block_w: Power while blocked (waiting), charged to idle time (docs/perseus.md §1.4).
    """

    dag: PipelineDAG
    options: Mapping[tuple[int, str], Sequence[Option]]
    measured: Mapping[tuple[int, str], Mapping[float, tuple[float, float]]]
    unit_time_s: float
    p_block_w: float

    def planned(self, durations: Sequence[int]) -> list[Option]:
        """Per instruction, the slowest option whose quantized time fits its planned duration.

        Args:
            durations: Planned duration of every instruction, in units of τ, in DAG node order
                (a planned point's ``durations``).
        """
        return [
            frequency_for(self.options[(ins.stage, ins.kind)], q)
            for ins, q in zip(self.dag.instructions, durations)
        ]

    def top_option(self, stage: int, kind: str) -> Option:
        """The option at the highest measured clock: all-max's.

        Also where noise in the measured times pruned it from :attr:`options` (a neighbour
        measured faster).
        """
        options = self.options[(stage, kind)]
        best = max(options, key=lambda o: o.freq_mhz)
        measured = self.measured.get((stage, kind), {})
        if measured and max(measured) > best.freq_mhz:
            freq = max(measured)
            time_s, energy_j = measured[freq]
            quant = int(time_s // self.unit_time_s)
            best = Option(
                freq_mhz=freq,
                time_s=time_s,
                energy_j=energy_j,
                quant=quant,
                eff_energy_j=energy_j - self.p_block_w * quant * self.unit_time_s,
            )
        return best


@dataclass(frozen=True, slots=True)
class Run:
    """One replayed iteration.

    Attributes:
        time_s: Iteration time.
        energy_j: Energy, blocking power included.
        path: One realized critical path, in order.
        prev: Each node's same-stage predecessor (-1 for none).
        penalized: Whether each node started at its predecessor's clock.
        busy: Each node's realized duration (its option's time, or longer or shorter where the
            old clock ran its start).
    """

    time_s: float
    energy_j: float
    path: list[int]
    prev: list[int]
    penalized: list[bool]
    busy: list[float]


@dataclass(frozen=True, slots=True)
class Layout:
    """What a replay needs to know about the DAG; it does not change between replays.

    Attributes:
        preds: All predecessors of each node.
        prev: Same-stage predecessor (-1 for none).
        last: A stage's first node -> its last node.
        topo: A topological order.
    """

    preds: list[list[int]]
    prev: list[int]
    last: dict[int, int]
    topo: list[int]


def layout_of(dag: PipelineDAG) -> Layout:
    """The predecessors, stage neighbours and a topological order of ``dag``'s nodes."""
    n = len(dag.instructions)
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, v in dag.edges:
        preds[v].append(u)
    prev = [-1] * n
    last: dict[int, int] = {}
    for s in range(dag.num_stages):
        order = dag.stage_order(s)
        for a, b in zip(order, order[1:]):
            prev[b] = a
        if order:
            last[order[0]] = order[-1]
    return Layout(preds, prev, last, dag.topological_order())


def replay_options(
    model: ReplayModel,
    chosen: Sequence[Option],
    switch_latency_s: float,
    layout: Layout | None = None,
) -> Run:
    """One iteration of per-instruction options on the measured profile.

    Every instruction runs its option's measured time and energy; with ``switch_latency_s``, one
    whose clock differs from its stage predecessor's runs at the old clock until the change
    lands (the runtime requests an instruction's clock when its stage predecessor ends; an
    iteration's first instruction follows the previous iteration's last).

    Args:
        model: What the options belong to (DAG, measured profile, blocking power).
        chosen: One option per DAG node.
        switch_latency_s: Delay between a clock request and its effect.
        layout: :func:`layout_of` the model's DAG, when the caller replays repeatedly.
    """
    dag = model.dag
    n = len(dag.instructions)
    layout = layout or layout_of(dag)
    preds, prev, last, topo = layout.preds, layout.prev, layout.last, layout.topo
    wrap_gap: dict[int, float] = {}  # first instruction -> idle time before it (from pass 1)
    for pass_no in range(2 if switch_latency_s > 0 else 1):
        finish = [0.0] * n
        busy = [0.0] * n
        energy = [0.0] * n
        via = [-1] * n
        penalized = [False] * n
        for v in topo:
            start = 0.0
            for u in preds[v]:
                if finish[u] > start:
                    start, via[v] = finish[u], u
            option = chosen[v]
            duration, e = option.time_s, option.energy_j
            if switch_latency_s > 0:
                u = prev[v] if prev[v] >= 0 else last.get(v, -1)
                if u >= 0 and chosen[u].freq_mhz != option.freq_mhz:
                    gap = start - finish[u] if prev[v] >= 0 else wrap_gap.get(v, math.inf) + start
                    slow_s = switch_latency_s - gap
                    if slow_s > 0:
                        penalized[v] = True
                        # v's own work at u's clock
                        old_t, old_e = at_freq(model, dag.instructions[v], chosen[u].freq_mhz)
                        work = slow_s / old_t
                        if work >= 1.0:
                            duration, e = old_t, old_e
                        else:
                            duration = slow_s + (1.0 - work) * option.time_s
                            e = work * old_e + (1.0 - work) * option.energy_j
            finish[v] = start + duration
            busy[v] = duration
            energy[v] = e
        time_s = max(finish) if n else 0.0
        if pass_no == 0:
            wrap_gap = {first: time_s - finish[lst] for first, lst in last.items()}
    total = sum(energy) + model.p_block_w * (time_s * dag.num_stages - sum(busy))
    end = max(range(n), key=finish.__getitem__)
    path = [end]
    while via[path[-1]] >= 0:
        path.append(via[path[-1]])
    return Run(time_s, total, path[::-1], prev, penalized, busy)


def at_freq(model: ReplayModel, ins: Instruction, freq_mhz: float) -> tuple[float, float]:
    """Measured (time, energy) of ``ins``'s kind at ``freq_mhz``.

    Without a measurement: the slowest kept option at or above that clock (or the slowest).
    """
    key = (ins.stage, ins.kind)
    got = model.measured.get(key, {}).get(freq_mhz)
    if got is not None:
        return got
    options = model.options[key]
    above = [o for o in options if o.freq_mhz >= freq_mhz]
    o = min(above, key=lambda o: o.freq_mhz) if above else max(options, key=lambda o: o.time_s)
    return o.time_s, o.energy_j


def critical_path_s(dag: PipelineDAG, times_s: Sequence[float]) -> float:
    """Longest path through the instruction DAG with the given per-instruction times."""
    starts = dag.start_times(times_s)
    return max((start + t for start, t in zip(starts, times_s)), default=0.0)


class IncrementalReplay:
    """:func:`replay_options`, kept up to date while options change one instruction at a time.

    The slowdown guard (:func:`powerlib.planning.perseus.guard.within_slowdown`) speeds up one
    instruction per step and replays after each; a full replay per step made it quadratic
    (3,159 steps of 8,192 instructions at 16 stages x 256 microbatches: 62 s). Here a change
    recomputes only the instructions whose inputs changed — the changed one, its stage
    successor (whose clock switch it decides), the first instruction of its stage when it is
    the last (the switch across iterations), and then every instruction a changed finish time
    reaches, in topological order — with the same arithmetic as the full replay, so every
    figure is the one :func:`replay_options` would return (bit for bit; tested against it).

    Both passes of a replay with a switch latency are kept: the second depends on the first
    only through each stage's idle time before its first instruction, which is refreshed after
    every change.
    """

    def __init__(
        self,
        model: ReplayModel,
        chosen: Sequence[Option],
        switch_latency_s: float,
        layout: Layout | None = None,
    ) -> None:
        dag = model.dag
        self._model = model
        self._n = n = len(dag.instructions)
        self._layout = layout = layout or layout_of(dag)
        self._latency = switch_latency_s
        self.chosen = list(chosen)
        self._keys = [(ins.stage, ins.kind) for ins in dag.instructions]
        self._at: dict[tuple[tuple[int, str], float], tuple[float, float]] = {}
        succs: list[list[int]] = [[] for _ in range(n)]
        for v in range(n):
            for u in layout.preds[v]:
                succs[u].append(v)
        nxt = [-1] * n
        for v, u in enumerate(layout.prev):
            if u >= 0:
                nxt[u] = v
        # Who reads a node's finish time: its successors and its stage successor (the gap).
        self._readers = [
            sorted(set(succs[v]) | ({nxt[v]} if nxt[v] >= 0 else set())) for v in range(n)
        ]
        self._next = nxt
        self._first_of_last = {lst: first for first, lst in layout.last.items()}
        self._pos = [0] * n
        for i, v in enumerate(layout.topo):
            self._pos[v] = i
        self._passes = 2 if switch_latency_s > 0 else 1
        self._wrap: list[dict[int, float]] = [{}, {}]
        self._finish = [[0.0] * n for _ in range(self._passes)]
        self._busy = [[0.0] * n for _ in range(self._passes)]
        self._energy = [[0.0] * n for _ in range(self._passes)]
        self._via = [[-1] * n for _ in range(self._passes)]
        self._pen = [[False] * n for _ in range(self._passes)]
        self._flag = bytearray(n)
        for p in range(self._passes):
            if p == 1:
                self._wrap[1] = self._wrap_gaps()
            self._finish[p] = [math.nan] * n  # every node "changes" on its first computation
            self._propagate(p, layout.topo, follow=False)

    def _wrap_gaps(self) -> dict[int, float]:
        finish = self._finish[0]
        time_s = max(finish) if self._n else 0.0
        return {first: time_s - finish[lst] for first, lst in self._layout.last.items()}

    def _at_freq(self, v: int, freq_mhz: float) -> tuple[float, float]:
        key = (self._keys[v], freq_mhz)
        got = self._at.get(key)
        if got is None:
            got = self._at[key] = at_freq(self._model, self._model.dag.instructions[v], freq_mhz)
        return got

    def _propagate(self, p: int, dirty: Sequence[int], *, follow: bool = True) -> bool:
        """Recompute ``dirty`` and, with ``follow``, every node a changed finish time reaches.

        Nodes are visited in topological order (a flag per node, scanned from the first dirty
        one), with the arithmetic of :func:`replay_options`, statement for statement. Returns
        whether any finish time changed.
        """
        layout = self._layout
        preds, prev_of, last_of, topo = layout.preds, layout.prev, layout.last, layout.topo
        finish, busy_l, energy_l = self._finish[p], self._busy[p], self._energy[p]
        via_l, pen_l = self._via[p], self._pen[p]
        chosen, readers, pos = self.chosen, self._readers, self._pos
        wrap = self._wrap[p]
        latency = self._latency
        flag = self._flag
        first = len(topo)
        for v in dirty:
            flag[v] = 1
            if pos[v] < first:
                first = pos[v]
        pending = len(set(dirty))
        any_changed = False
        i = first
        while pending:
            v = topo[i]
            i += 1
            if not flag[v]:
                continue
            flag[v] = 0
            pending -= 1
            start = 0.0
            via = -1
            for u in preds[v]:
                if finish[u] > start:
                    start, via = finish[u], u
            option = chosen[v]
            duration, e = option.time_s, option.energy_j
            penalized = False
            if latency > 0:
                prev = prev_of[v]
                u = prev if prev >= 0 else last_of.get(v, -1)
                if u >= 0 and chosen[u].freq_mhz != option.freq_mhz:
                    gap = start - finish[u] if prev >= 0 else wrap.get(v, math.inf) + start
                    slow_s = latency - gap
                    if slow_s > 0:
                        penalized = True
                        old_t, old_e = self._at_freq(v, chosen[u].freq_mhz)
                        work = slow_s / old_t
                        if work >= 1.0:
                            duration, e = old_t, old_e
                        else:
                            duration = slow_s + (1.0 - work) * option.time_s
                            e = work * old_e + (1.0 - work) * option.energy_j
            new_finish = start + duration
            busy_l[v] = duration
            energy_l[v] = e
            via_l[v] = via
            pen_l[v] = penalized
            if new_finish != finish[v]:
                finish[v] = new_finish
                any_changed = True
                if follow:
                    for w in readers[v]:
                        if not flag[w]:
                            flag[w] = 1
                            pending += 1
        return any_changed

    def set(self, v: int, option: Option) -> None:
        """Give node ``v`` another option and bring both passes up to date."""
        self.set_many([(v, option)])

    def set_many(self, changes: Sequence[tuple[int, Option]]) -> None:
        """Give each ``(node, option)`` its option, then bring both passes up to date once."""
        dirty = []
        for v, option in changes:
            self.chosen[v] = option
            dirty.append(v)
            if self._next[v] >= 0:
                dirty.append(self._next[v])
            if v in self._first_of_last:
                dirty.append(self._first_of_last[v])
        if not dirty:
            return
        self._propagate(0, dirty)
        if self._passes == 2:
            old = self._wrap[1]
            new = self._wrap_gaps()
            moved = [f for f, gap in new.items() if old.get(f) != gap]
            self._wrap[1] = new
            self._propagate(1, dirty + moved)

    @property
    def layout(self) -> Layout:
        """The DAG's predecessors, stage neighbours and order."""
        return self._layout

    def run(self, *, energy: bool = True) -> Run:
        """The replay of the current options (what :func:`replay_options` returns)."""
        p = self._passes - 1
        finish = self._finish[p]
        n = self._n
        time_s = max(finish) if n else 0.0
        total = math.nan
        if energy:
            busy = self._busy[p]
            total = sum(self._energy[p]) + self._model.p_block_w * (
                time_s * self._model.dag.num_stages - sum(busy)
            )
        via = self._via[p]
        path = [finish.index(time_s)] if n else []
        while path and via[path[-1]] >= 0:
            path.append(via[path[-1]])
        return Run(
            time_s, total, path[::-1], self._layout.prev, list(self._pen[p]), list(self._busy[p])
        )


class NoisyReplay:
    """The iteration time of per-instruction options under run-to-run noise, over fixed draws.

    Every instruction's time is multiplied by ``1 + cv * z`` with ``z`` standard normal, drawn
    once per (sample, instruction) and reused for every plan replayed, so two plans (and
    all-max) are compared on the same noise. Replays all samples at once (numpy, one vector op
    per instruction), with the clock-change latency of :func:`replay_options` (one pass: the
    wrap-around gap of an iteration's first instruction is taken as ample).

    The point (issue 32): a plan that spends the slack of many paths makes them all just
    critical; under noise the iteration waits for the slowest of them, so its *expected* time
    exceeds all-max's although its nominal time does not. The slowdown guard
    (:func:`powerlib.planning.perseus.guard.within_slowdown`) checks the expectation.

    Args:
        model: The DAG and the measured profile.
        cv: Relative standard deviation of an instruction's time.
        row_se: Relative standard error of a profiled row's mean time: each draw also scales
            every (stage, kind, clock) by one factor, for the error of the profile itself (a
            plan that spends all slack on measured times realizes slower when they are low).
        samples: Noise draws.
        seed: Seed of the draws.
    """

    def __init__(
        self,
        model: ReplayModel,
        cv: float,
        *,
        row_se: float = 0.0,
        samples: int = 128,
        seed: int = 0,
    ) -> None:
        self._model = model
        dag = model.dag
        self._layout = layout_of(dag)
        rng = np.random.default_rng(seed)
        n = len(dag.instructions)
        self.factors = np.clip(1.0 + cv * rng.standard_normal((n, samples)), 0.5, None)
        self.samples = samples
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
            mean = 1.0 + (self._row_se if lowered else 0.0)
            got = self._rows[key] = np.clip(
                mean + self._row_se * self._rng.standard_normal(self.samples), 0.5, None
            )
        return got

    def run(
        self, chosen: Sequence[Option], switch_latency_s: float
    ) -> tuple[np.ndarray, list[int]]:
        """``(makespan per sample, how many samples each node was critical in)``."""
        layout = self._layout
        preds, prev, topo = layout.preds, layout.prev, layout.topo
        n = len(chosen)
        k = self.samples
        finish = np.zeros((n, k))
        via = np.full((n, k), -1, dtype=np.int64)
        dag = self._model.dag
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
            if switch_latency_s > 0 and u >= 0 and chosen[u].freq_mhz != option.freq_mhz:
                slow = switch_latency_s - (start - finish[u])
                old_t, _ = at_freq(self._model, ins, chosen[u].freq_mhz)
                old_t *= self.factors[v] * self._row(ins.stage, ins.kind, chosen[u].freq_mhz)
                work = np.clip(slow / old_t, 0.0, 1.0)
                penalized = slow > 0
                duration = np.where(
                    penalized,
                    np.where(work >= 1.0, old_t, slow + (1.0 - work) * duration),
                    duration,
                )
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
