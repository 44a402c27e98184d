"""Replaying per-instruction options on the measured profile: realized time, energy, critical path.

The frontier plans on fitted, quantized costs; :func:`replay_options` runs a plan's options through the
instruction DAG with their *measured* times and energies (and, optionally, the clock-change
latency) to see what the plan would realize. :meth:`Frontier.realized
<powerlib.planning.perseus.frontier.Frontier.realized>` and the slowdown guard
(:meth:`Frontier.within_slowdown <powerlib.planning.perseus.frontier.Frontier.within_slowdown>`)
are built on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from powerlib.planning.pipeline import Instruction, PipelineDAG

if TYPE_CHECKING:
    from powerlib.planning.perseus.frontier import Frontier
    from powerlib.planning.perseus.options import Option

__all__ = ["Layout", "Run", "at_freq", "critical_path_s", "layout_of", "replay_options"]


@dataclass(frozen=True, slots=True)
class Run:
    """One replayed iteration.

    Attributes:
        time_s: Iteration time.
        energy_j: Energy, blocking power included.
        path: One realized critical path, in order.
        prev: Each node's same-stage predecessor (-1 for none).
        penalized: Whether each node started at its predecessor's clock.
    """

    time_s: float
    energy_j: float
    path: list[int]
    prev: list[int]
    penalized: list[bool]


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
    frontier: Frontier,
    chosen: Sequence[Option],
    switch_latency_s: float,
    layout: Layout | None = None,
) -> Run:
    """One iteration of per-instruction options on the measured profile.

    Every instruction runs its option's measured time and energy; with ``switch_latency_s``, one
    whose clock differs from its stage predecessor's runs at the old clock until the change
    lands (see :meth:`Frontier.realized <powerlib.planning.perseus.frontier.Frontier.realized>`).

    Args:
        frontier: What the options belong to (DAG, measured profile, blocking power).
        chosen: One option per DAG node.
        switch_latency_s: Delay between a clock request and its effect.
        layout: :func:`layout_of` the frontier's DAG, when the caller replays repeatedly.
    """
    dag = frontier.dag
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
                        old_t, old_e = at_freq(frontier, dag.instructions[v], chosen[u].freq_mhz)
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
    total = sum(energy) + frontier.p_block_w * (time_s * dag.num_stages - sum(busy))
    end = max(range(n), key=finish.__getitem__)
    path = [end]
    while via[path[-1]] >= 0:
        path.append(via[path[-1]])
    return Run(time_s, total, path[::-1], prev, penalized)


def at_freq(frontier: Frontier, ins: Instruction, freq_mhz: float) -> tuple[float, float]:
    """Measured (time, energy) of ``ins``'s kind at ``freq_mhz``.

    Without a measurement: the slowest kept option at or above that clock (or the slowest).
    """
    key = (ins.stage, ins.kind)
    got = frontier.measured.get(key, {}).get(freq_mhz)
    if got is not None:
        return got
    options = frontier.options[key]
    above = [o for o in options if o.freq_mhz >= freq_mhz]
    o = min(above, key=lambda o: o.freq_mhz) if above else max(options, key=lambda o: o.time_s)
    return o.time_s, o.energy_j


def critical_path_s(dag: PipelineDAG, times_s: Sequence[float]) -> float:
    """Longest path through the instruction DAG with the given per-instruction times."""
    starts = dag.start_times(times_s)
    return max((start + t for start, t in zip(starts, times_s)), default=0.0)
