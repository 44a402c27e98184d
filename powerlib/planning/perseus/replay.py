"""Replaying per-instruction options on the measured profile: realized time, energy, critical path.

The planner works on fitted, quantized costs; :func:`replay_options` runs a plan's options
through the instruction DAG with their *measured* times and energies (and, optionally, the
clock-change latency) to see what the plan would realize. Everything here reads a
:class:`ReplayModel`: only what a replay needs (the DAG, the options, the measured rows, τ and
``P_block``), which ``Frontier.model`` builds, so that this module and the slowdown guard
(:mod:`powerlib.planning.perseus.guard`) need nothing else of the planner. The same replay under
run-to-run noise is :class:`~powerlib.planning.perseus.noise.NoisyReplay`. ``Frontier.realized``
and the guard are built on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from powerlib.planning.perseus.frequency_options import Option, frequency_for
from powerlib.planning.pipeline import Instruction, PipelineDAG

__all__ = [
    "IncrementalReplay",
    "Layout",
    "ReplayModel",
    "Run",
    "at_freq",
    "critical_path_s",
    "head_at_old_clock",
    "layout_of",
    "next_of",
    "replay_options",
    "tail_ahead",
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
        request_ahead_s: How the runtime requests a switch to a faster clock: this long
            before the previous instruction's predicted end (its option's time), so it lands
            by the instruction's start and the previous one's tail runs at the faster clock
            (:class:`~powerlib.runtime.apply_phase.ApplyPhase`'s ``lead_s``); ``None``: when
            the previous instruction ends, like every other switch.
    """

    dag: PipelineDAG
    options: Mapping[tuple[int, str], Sequence[Option]]
    measured: Mapping[tuple[int, str], Mapping[float, tuple[float, float]]]
    unit_time_s: float
    p_block_w: float
    request_ahead_s: float | None = None

    def requested_after_s(self, u: Option, v: Option) -> float | None:
        """When the switch from ``u``'s clock to ``v``'s is requested, from ``u``'s start.

        ``None``: at ``u``'s end (no request ahead, or not a switch up).
        """
        lead = self.request_ahead_s
        if lead is None or v.freq_mhz <= u.freq_mhz:
            return None
        return max(0.0, u.time_s - lead)

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
    wrap_busy: dict[int, float] = {}  # first instruction -> its stage's last one's duration
    nxt = next_of(layout)
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
                    ahead = model.requested_after_s(chosen[u], option)
                    if ahead is not None:  # requested before u ended
                        gap += (busy[u] if prev[v] >= 0 else wrap_busy.get(v, 0.0)) - ahead
                    slow_s = switch_latency_s - gap
                    if slow_s > 0:
                        penalized[v] = True
                        # v's own work at u's clock
                        old = at_freq(model, dag.instructions[v], chosen[u].freq_mhz)
                        duration, e = head_at_old_clock(old, slow_s, option)
            if switch_latency_s > 0 and model.request_ahead_s is not None:
                w = nxt[v]
                if w >= 0:
                    duration, e = tail_ahead(model, v, chosen[v], chosen[w], duration, e,
                                             switch_latency_s)  # fmt: skip
            finish[v] = start + duration
            busy[v] = duration
            energy[v] = e
        time_s = max(finish) if n else 0.0
        if pass_no == 0:
            wrap_gap = {first: time_s - finish[lst] for first, lst in last.items()}
            wrap_busy = {first: busy[lst] for first, lst in last.items()}
    total = sum(energy) + model.p_block_w * (time_s * dag.num_stages - sum(busy))
    end = max(range(n), key=finish.__getitem__)
    path = [end]
    while via[path[-1]] >= 0:
        path.append(via[path[-1]])
    return Run(time_s, total, path[::-1], prev, penalized, busy)


def head_at_old_clock(
    old: tuple[float, float], slow_s: float, option: Option
) -> tuple[float, float]:
    """An instruction's duration and energy when its first ``slow_s`` run at the old clock.

    ``old`` is its measured ``(time_s, energy_j)`` there; the rest of its work runs at its own
    option's clock.
    """
    old_t, old_e = old
    work = slow_s / old_t
    if work >= 1.0:
        return old_t, old_e
    return slow_s + (1.0 - work) * option.time_s, work * old_e + (1.0 - work) * option.energy_j


def next_of(layout: Layout) -> list[int]:
    """Each node's same-stage successor; a stage's last node: its first (the next iteration)."""
    nxt = [-1] * len(layout.prev)
    for v, u in enumerate(layout.prev):
        if u >= 0:
            nxt[u] = v
    for first, lst in layout.last.items():
        nxt[lst] = first
    return nxt


def tail_ahead(
    model: ReplayModel,
    v: int,
    option: Option,
    following: Option,
    duration_s: float,
    energy_j: float,
    latency_s: float,
) -> tuple[float, float]:
    """Node ``v``'s duration and energy when the next clock, requested ahead, lands in its tail.

    A switch up to ``following``'s clock is requested ``request_ahead_s`` before ``v``'s
    predicted end (:meth:`ReplayModel.requested_after_s`) and lands ``latency_s`` later; the work
    ``v`` has left then runs at the faster clock (its measured time and energy there).
    """
    after = model.requested_after_s(option, following)
    if after is None:
        return duration_s, energy_j
    landing = after + latency_s
    if landing >= duration_s:
        return duration_s, energy_j
    fast_t, fast_e = at_freq(model, model.dag.instructions[v], following.freq_mhz)
    work = min(1.0, (duration_s - landing) / option.time_s)  # v's work left at the landing
    return landing + work * fast_t, energy_j + work * (fast_e - option.energy_j)


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
        self._next_wrap = next_of(layout)  # whose clock a node's tail may run at (ahead)
        self._first_of_last = {lst: first for first, lst in layout.last.items()}
        self._pos = [0] * n
        for i, v in enumerate(layout.topo):
            self._pos[v] = i
        self._passes = 2 if switch_latency_s > 0 else 1
        self._wrap: list[dict[int, float]] = [{}, {}]
        self._wrap_busy: dict[int, float] = {}
        self._finish = [[0.0] * n for _ in range(self._passes)]
        self._busy = [[0.0] * n for _ in range(self._passes)]
        self._energy = [[0.0] * n for _ in range(self._passes)]
        self._via = [[-1] * n for _ in range(self._passes)]
        self._pen = [[False] * n for _ in range(self._passes)]
        self._flag = bytearray(n)
        for p in range(self._passes):
            if p == 1:
                self._wrap[1] = self._wrap_gaps()
                self._wrap_busy = self._wrap_busies()
            self._finish[p] = [math.nan] * n  # every node "changes" on its first computation
            self._propagate(p, layout.topo, follow=False)

    def _wrap_gaps(self) -> dict[int, float]:
        finish = self._finish[0]
        time_s = max(finish) if self._n else 0.0
        return {first: time_s - finish[lst] for first, lst in self._layout.last.items()}

    def _wrap_busies(self) -> dict[int, float]:
        busy = self._busy[0]
        return {first: busy[lst] for first, lst in self._layout.last.items()}

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
        model = self._model
        ahead_on = latency > 0 and model.request_ahead_s is not None
        nxt_wrap = self._next_wrap
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
                    ahead = model.requested_after_s(chosen[u], option) if ahead_on else None
                    if ahead is not None:  # requested before u ended
                        gap += (busy_l[u] if prev >= 0 else self._wrap_busy.get(v, 0.0)) - ahead
                    slow_s = latency - gap
                    if slow_s > 0:
                        penalized = True
                        old = self._at_freq(v, chosen[u].freq_mhz)
                        duration, e = head_at_old_clock(old, slow_s, option)
            if ahead_on and nxt_wrap[v] >= 0:
                duration, e = tail_ahead(
                    model, v, option, chosen[nxt_wrap[v]], duration, e, latency
                )
            new_finish = start + duration
            w = self._next[v]  # when v's start moves, so does the switch it requests ahead
            if ahead_on and duration != busy_l[v] and follow and w >= 0 and not flag[w]:
                flag[w] = 1
                pending += 1
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
        ahead = self._model.request_ahead_s is not None
        for v, option in changes:
            self.chosen[v] = option
            dirty.append(v)
            if self._next[v] >= 0:
                dirty.append(self._next[v])
            if v in self._first_of_last:
                dirty.append(self._first_of_last[v])
            if ahead:  # the instruction before it may run its tail at its clock
                u = self._layout.prev[v]
                dirty.append(u if u >= 0 else self._layout.last.get(v, v))
        if not dirty:
            return
        self._propagate(0, dirty)
        if self._passes == 2:
            old = self._wrap[1]
            new = self._wrap_gaps()
            old_busy, self._wrap_busy = self._wrap_busy, self._wrap_busies()
            moved = [
                f
                for f, gap in new.items()
                if old.get(f) != gap or old_busy.get(f) != self._wrap_busy[f]
            ]
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
