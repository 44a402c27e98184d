"""The slowdown guard: a plan's per-instruction options that realize within the allowed slowdown.

A planned point is solved on floor-quantized durations: each instruction may really run up to
one τ longer than planned, and a clock change that lands late runs the start of an instruction
at its predecessor's clock. So a ``fastest`` point can realize slower than all-max (+0.35 % on
the reference's synthetic case). The guard (issue 34, docs/perseus.md §2.7) turns a point into
options that realize within ``max_slowdown``, replayed on the *measured* profile
(:mod:`powerlib.planning.perseus.replay`; everything here reads its
:class:`~powerlib.planning.perseus.replay.ReplayModel`, which ``Frontier.model`` builds):

1. **One exact-time solve.** The plan's linear program again, but on real durations: per
   instruction, the lower convex hull of its options' ``(time, energy - P_block · time)``, with
   every breakpoint's time rounded *up* to a unit of ``τ / 1000`` and the makespan bound rounded
   *down*. It is the min-cost circulation of :class:`~powerlib.planning.perseus.flow.
   ActivityNetwork` with one crash arc per hull breakpoint (a handful per instruction, not one
   per quantum), certified like every flow solve. Each instruction then takes the slowest
   option whose rounded-up time fits its solved duration, and is lengthened into whatever real
   slack is left while its energy falls. The rounding makes the plan's realized time without
   latency at most the bound, by construction.
2. **The switch latency.** Replayed with the latency, a plan too slow is solved once more with
   each instruction's penalty in that replay added to its times (signed: a start at a faster
   old clock gains time). Then, while the iteration is still too slow, the instructions on the realized critical path (and the predecessors whose late clock
   change slowed it) are sped up one option each, cheapest joules per second first, as many per
   replay as cover the excess (one replay per round, not per instruction). All-max always
   qualifies (no clock ever changes), so this ends.
3. **The noise stage** (issue 32), as before: the expected time under the profiled run-to-run
   noise against all-max's on the same draws.

On DAGs of up to :data:`BOTH_STARTS_MAX_NODES` instructions, where it costs a fraction of a
second, the greedy of the previous guard (from the quantized point, one speed-up per replay)
also runs, and the guard keeps whichever realizes the lower energy: the exact start wins on
almost every case measured (up to 2.9 % less energy), but its speed-ups for latency and noise
can cost a few 1e-4 more on some small cases, and the guard promises never to be worse than the
greedy there (``benchmarks/planner_scale.py`` and tests/planning/perseus/test_guard.py compare
them). Without the compiled flow solver only the greedy runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from powerlib.planning.perseus import mincost
from powerlib.planning.perseus.direct import into_slack
from powerlib.planning.perseus.flow import (
    ActivityNetwork,
    capacity_scale,
    crash_capacities,
    crash_slopes,
)
from powerlib.planning.perseus.noise import NoisyReplay, TimeNoise
from powerlib.planning.perseus.replay import (
    IncrementalReplay,
    ReplayModel,
    Run,
    layout_of,
    replay_options,
)

if TYPE_CHECKING:
    from powerlib.planning.perseus.frequency_options import Option

__all__ = [
    "BOTH_STARTS_MAX_NODES",
    "available",
    "exact_start",
    "guard_limit",
    "held_energy_j",
    "within_slowdown",
]

#: Up to this many instructions the greedy from the quantized point also runs (module docstring).
BOTH_STARTS_MAX_NODES = 2048

#: The noise stage's draws, and in how many groups the profile's own error is drawn (each group
#: one possible truth of the profile; :class:`~powerlib.planning.perseus.noise.NoisyReplay`).
_SAMPLES, _ROW_GROUPS = 192, 24

#: The noise stage's speed-ups tried again without, at most.
_GIVE_BACK_MOST = 96

#: The plan must fit this quantile of the profile's possible truths (z of 90 %: at 80 % one of
#: GPT-3's five seeds realized +0.108 %, docs/perseus.md §2.8).
_ROW_QUANTILE_Z = 1.28

#: The exact-time solve's time unit, as a fraction of τ.
_UNIT_PER_TAU = 1e-3

_Step = tuple["Option", float] | None


def within_slowdown(
    model: ReplayModel,
    durations: Sequence[int],
    max_slowdown: float,
    *,
    reference_s: float,
    held: bool = False,
    switch_latency_s: float = 0.0,
    time_cv: float = 0.0,
    time_se: float = 0.0,
    started: Mapping[tuple[float, bool], Any] | None = None,
    noise: TimeNoise | None = None,
    latency_samples_s: Sequence[float] = (),
) -> list[Option]:
    """Per-instruction options for a point, realized within ``max_slowdown`` (module docstring).

    ``Frontier.within_slowdown`` documents the arguments it passes on.

    Args:
        model: The DAG, options and measured profile the point was planned on.
        durations: The point's planned durations, in units of τ (the greedy's start).
        max_slowdown: Allowed realized slowdown over ``reference_s``, as a fraction.
        reference_s: The time not to exceed (before ``max_slowdown``): all-max's iteration
            time, or a straggler's with ``held``.
        held: A straggler holds the iteration at ``reference_s`` (the ``deadline`` policy):
            energy is counted until then, and the noise stage compares against it.
        switch_latency_s: Delay between a clock request and its effect.
        time_cv: Run-to-run spread of instruction times, for the noise stage (independent
            per instruction, when ``noise`` is not given).
        time_se: Relative standard error of a profiled row's mean time, for the noise stage.
        started: Exact-time starts already solving in the background, by ``(limit_s, held)``;
            each has ``result()`` (the direct solve starts them beside its points).
        noise: The noise's structure, for the noise stage (overrides ``time_cv``).
        latency_samples_s: Measured clock-change latencies: the noise stage draws each
            switch's from them (steps 1-2 use ``switch_latency_s``, their typical value).
    """
    limit = guard_limit(reference_s, max_slowdown)
    limit_s = reference_s if held else None
    noise = noise if noise is not None else TimeNoise.iid(time_cv)
    spread = len(set(latency_samples_s)) > 1
    noisy = (
        _NoiseCheck(model, noise, time_se, limit_s, max_slowdown, latency_samples_s)
        if not noise.is_zero or time_se > 0 or spread
        else None
    )
    starts: list[tuple[list[Option], bool]] = []
    if available():
        pending = (started or {}).get((limit, held))
        start = exact_start(model, limit, held=held) if pending is None else pending.result()
        if switch_latency_s > 0:
            # Once more with each instruction's latency penalty in this plan (signed: a start
            # at a faster old clock gains time): the flow then covers every path at once, which
            # the speed-ups do one critical path per replay (32 x 512: 11 s of speed-ups became
            # one 4 s solve and 2 s of speed-ups, at 0.02 % less energy).
            run = replay_options(model, start, switch_latency_s)
            if run.time_s > limit:
                penalty = [b - o.time_s for b, o in zip(run.busy, start)]
                start = exact_start(model, limit, penalty, held=held)
        starts.append((list(start), True))
    if not starts or len(model.dag.instructions) <= BOTH_STARTS_MAX_NODES:
        starts.append((model.planned(durations), False))
    best: list[Option] | None = None
    best_energy = math.inf
    for chosen, batch in starts:
        got = _speed_up(model, chosen, limit, switch_latency_s, noisy, batch=batch)
        energy = held_energy_j(model, got, switch_latency_s, limit_s)
        if best is None or energy < best_energy:
            best, best_energy = got, energy
    assert best is not None
    return best


def available() -> bool:
    """Whether the exact-time start can run here (the compiled min-cost flow loads)."""
    return mincost.available()


def guard_limit(reference_s: float, max_slowdown: float) -> float:
    """The iteration time a guarded plan must realize within: ``reference_s`` + the slack.

    ``reference_s``: all-max's iteration time (``Frontier.baseline_time_s``), or a straggler's
    deadline.
    """
    return reference_s * (1.0 + max_slowdown)


def held_energy_j(
    model: ReplayModel, chosen: Sequence[Option], switch_latency_s: float, hold_s: float | None
) -> float:
    """Energy of an iteration of ``chosen``, replayed; held until ``hold_s`` when given.

    Under a straggler (the ``deadline`` policy) the iteration lasts the straggler's time
    whatever the plan: a plan that ends earlier only waits longer at ``P_block``. Without
    ``hold_s``: the replay's energy (:func:`~powerlib.planning.perseus.replay.replay_options`).
    """
    run = replay_options(model, chosen, switch_latency_s)
    if hold_s is None or run.time_s >= hold_s:
        return run.energy_j
    return run.energy_j + model.dag.num_stages * model.p_block_w * (hold_s - run.time_s)


def exact_start(
    model: ReplayModel,
    limit_s: float,
    penalty_s: Sequence[float] | None = None,
    held: bool = False,
) -> list[Option]:
    """The cheapest options whose real durations fit ``limit_s`` (step 1 of the module docstring).

    Args:
        model: The DAG, options, measured profile and blocking power.
        limit_s: The iteration time not to exceed.
        penalty_s: Per instruction, time its start loses (or gains) to a late clock change (a
            replay's realized minus planned duration), added to each of its options' times.
        held: A straggler holds the iteration at ``limit_s`` (``deadline``): the makespan costs
            nothing below it. Otherwise it costs ``N · P_block`` per second (the realized
            energy), so the plan may end earlier where that is cheaper.

    Raises:
        PlanError: The solver refused the instance or its certificate failed.
    """
    dag = model.dag
    n = len(dag.instructions)
    unit_s = model.unit_time_s * _UNIT_PER_TAU
    p_block = model.p_block_w
    keys = [(ins.stage, ins.kind) for ins in dag.instructions]
    per_key: dict[tuple[int, str], _Activity] = {}
    for key in dict.fromkeys(keys):
        options = list(model.options[key])
        top = model.top_option(*key)  # all-max's option, pruned or not
        if all(o.freq_mhz != top.freq_mhz for o in options):
            options.append(top)
        per_key[key] = _Activity(options, unit_s, p_block)
    layout = layout_of(dag)
    preds, order = layout.preds, layout.topo
    succs: list[list[int]] = [[] for _ in range(n)]
    for v, before in enumerate(preds):
        for u in before:
            succs[u].append(v)
    acts = [per_key[k] for k in keys]
    # Realized energy is Σ (e_v - P_block t_v) + N P_block T: T costs w per unit below the bound
    # (nothing when a straggler holds the iteration there)
    w_j = 0.0 if held else dag.num_stages * p_block * unit_s
    finite_j = sum(a.max_slope for a in acts) + w_j
    scale = capacity_scale(finite_j, 3 * n + len(dag.edges), "the guard's energy slopes")
    arcs: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {
        k: (crash_capacities(a.cumulative, scale), a.arc_cost) for k, a in per_key.items()
    }
    crash = [arcs[k] for k in keys]
    extra = np.zeros(n, dtype=np.int64)
    if penalty_s is not None:
        extra = np.fromiter((math.ceil(p / unit_s) for p in penalty_s), dtype=np.int64, count=n)
        crash = [(cap, cost - d) if d else (cap, cost) for (cap, cost), d in zip(crash, extra)]
    floor = np.fromiter((a.floor for a in acts), dtype=np.int64, count=n) + extra
    net = ActivityNetwork.build(preds, succs, crash, floor, int(np.rint(w_j * scale)))
    # The rounded-up fastest durations may not fit a bound of max_slowdown = 0: then the
    # fastest plan's (the speed-ups and the replay decide the rest).
    fastest = _longest_path(order, preds, floor.tolist())
    bound = max(math.floor(limit_s / unit_s), fastest)
    start, finish, _ = net.events(bound if held else fastest, bound)  # T free below: w per unit
    chosen = [a.fitting(int(d)) for a, d in zip(acts, finish - start - extra)]
    pad = (extra * unit_s).tolist()
    # Unheld, lengthen within the rounded plan's own makespan: a later end costs N P_block per s.
    durations = [o.time_s + p for o, p in zip(chosen, pad)]
    end_s = limit_s if held else min(limit_s, _longest_path(order, preds, durations))
    return _lengthen(order, preds, succs, acts, chosen, pad, end_s, p_block)


class _Activity:
    """One (stage, kind)'s options on the exact-time network."""

    def __init__(self, options: list[Option], unit_s: float, p_block_w: float) -> None:
        self.options = options
        # Rounded up, so a plan's real durations never exceed the solved ones.
        self.units = [math.ceil(o.time_s / unit_s) for o in options]
        self.eff = [o.energy_j - p_block_w * o.time_s for o in options]
        hull = _lower_hull(list(zip(self.units, self.eff)))
        times = [b for b, _ in hull]
        self.floor = times[0]
        if len(hull) > 1:
            self.cumulative, self.arc_cost = crash_slopes(times, [e for _, e in hull])
            self.max_slope = float(self.cumulative.max())
        else:
            self.cumulative = np.zeros(0)
            self.arc_cost = np.zeros(0, dtype=np.int64)
            self.max_slope = 0.0

    def fitting(self, duration: int) -> Option:
        """The cheapest option whose rounded-up time fits ``duration`` units (the slowest of equals).

        Below the fastest option's time (only where the bound itself is, ``max_slowdown = 0``):
        the fastest option.
        """
        fits = [i for i, b in enumerate(self.units) if b <= duration]
        if not fits:
            fits = [min(range(len(self.units)), key=self.units.__getitem__)]
        return self.options[min(fits, key=lambda i: (self.eff[i], -self.units[i]))]


def _lower_hull(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The lower convex hull of ``(time, cost)`` points, fastest first, up to the cheapest."""
    pts: list[tuple[int, float]] = []
    for b, e in sorted(points):
        if pts and pts[-1][0] == b:
            continue  # sorted: the first of equal times is the cheapest
        pts.append((b, e))
    hull: list[tuple[int, float]] = []
    for b, e in pts:
        while len(hull) >= 2:
            (b1, e1), (b2, e2) = hull[-2], hull[-1]
            if (e2 - e1) * (b - b1) >= (e - e1) * (b2 - b1):  # hull[-1] not below the chord
                hull.pop()
            else:
                break
        hull.append((b, e))
    cheapest = min(range(len(hull)), key=lambda i: (hull[i][1], hull[i][0]))
    return hull[: cheapest + 1]


def _longest_path(order: Sequence[int], preds: Sequence[Sequence[int]], dur: Sequence[Any]) -> Any:
    finish: list[Any] = [0] * len(dur)
    for v in order:
        finish[v] = max((finish[u] for u in preds[v]), default=0) + dur[v]
    return max(finish, default=0)


def _lengthen(
    order: Sequence[int],
    preds: Sequence[Sequence[int]],
    succs: Sequence[Sequence[int]],
    acts: Sequence[_Activity],
    chosen: list[Option],
    pad_s: Sequence[float],
    limit_s: float,
    p_block_w: float,
) -> list[Option]:
    """Latest-first, each instruction takes the cheapest option its real slack fits.

    ``pad_s``: per instruction, time to count on top of its option's (the latency penalty).
    """

    def take(v: int, room: float) -> float:
        best = chosen[v]
        best_eff = best.energy_j - p_block_w * best.time_s
        room -= pad_s[v]
        for o, eff in zip(acts[v].options, acts[v].eff):
            if o.time_s <= room and eff < best_eff:
                best, best_eff = o, eff
        chosen[v] = best
        return best.time_s + pad_s[v]

    durations = [o.time_s + pad for o, pad in zip(chosen, pad_s)]
    into_slack(order, preds, succs, durations, limit_s, take, latest=True)
    return chosen


class _Ladder:
    """Per instruction, its next faster option and that speed-up's price (J per second bought).

    Instructions pinned at their top clock (:meth:`pin_top`) are never moved again.
    """

    def __init__(self, model: ReplayModel, replay: IncrementalReplay) -> None:
        self._model = model
        self._replay = replay
        self._steps: dict[tuple[tuple[int, str], Option], _Step] = {}
        self._pinned: set[int] = set()

    def next_faster(self, v: int) -> _Step:
        """The next faster option of node v and its price; ``None``: none, or pinned."""
        if v in self._pinned:
            return None
        ins = self._model.dag.instructions[v]
        key = (ins.stage, ins.kind)
        current = self._replay.chosen[v]
        if (key, current) not in self._steps:
            faster = [o for o in self._model.options[key] if o.time_s < current.time_s]
            if not faster:
                self._steps[(key, current)] = None
            else:
                step = max(faster, key=lambda o: o.time_s)
                price = (step.energy_j - current.energy_j) / (current.time_s - step.time_s)
                self._steps[(key, current)] = (step, price)
        return self._steps[(key, current)]

    def priced(self, nodes: Sequence[int]) -> list[tuple[float, int, Option]]:
        """``(price, node, faster option)`` of each of ``nodes`` that has one."""
        out = []
        for v in nodes:
            got = self.next_faster(v)
            if got is not None:
                out.append((got[1], v, got[0]))
        return out

    def pin_top(self, nodes: set[int]) -> list[tuple[int, Option]]:
        """Pin the unpinned of ``nodes`` at their top clock; the moves that takes."""
        moves = []
        for v in sorted(nodes - self._pinned):
            ins = self._model.dag.instructions[v]
            top = self._model.top_option(ins.stage, ins.kind)
            self._pinned.add(v)
            if self._replay.chosen[v] != top:
                moves.append((v, top))
        return moves


def _slowing(run: Run, wrap: Mapping[int, int]) -> set[int]:
    """The realized critical path, and the predecessors whose late clock change slowed it.

    The predecessor is on the stage, or for a stage's first instruction its last (across
    iterations: ``wrap``).
    """
    return set(run.path) | {
        run.prev[v] if run.prev[v] >= 0 else wrap.get(v, v) for v in run.path if run.penalized[v]
    }


def _covering(
    priced: list[tuple[float, int, Option]], excess_s: float, chosen: Sequence[Option]
) -> list[tuple[int, Option]]:
    """The cheapest speed-ups (ties: lower node first) that together cover ``excess_s``."""
    priced.sort(key=lambda item: (item[0], item[1]))
    moves = []
    for _, v, option in priced:
        moves.append((v, option))
        excess_s -= chosen[v].time_s - option.time_s
        if excess_s <= 0:
            break
    return moves


def _speed_up(
    model: ReplayModel,
    chosen: Sequence[Option],
    limit: float,
    switch_latency_s: float,
    noisy: _NoiseCheck | None,
    *,
    batch: bool,
) -> list[Option]:
    """Steps 2 and 3 of the module docstring from ``chosen``.

    With ``batch``, each replay takes as many of the cheapest speed-ups as cover the excess;
    without, one (the previous guard, step for step).
    """
    replay = IncrementalReplay(model, chosen, switch_latency_s)
    ladder = _Ladder(model, replay)
    before_noise: dict[int, Option] = {}  # what the noise stage sped up, and from what
    while True:
        run = replay.run(energy=False)
        if run.time_s <= limit:  # nominally in bounds: the noise stage, if any
            if noisy is None:
                return replay.chosen
            ranked = noisy.too_slow(replay.chosen, switch_latency_s, ladder.next_faster)
            if not ranked:
                _give_back(replay, before_noise, limit, switch_latency_s, noisy)
                return replay.chosen
            for _, v, _ in ranked:
                before_noise.setdefault(v, replay.chosen[v])
            replay.set_many([(v, option) for _, v, option in ranked])
            continue
        # nominally too slow: the cheapest speed-ups on the path
        candidates = _slowing(run, replay.layout.last)
        priced = ladder.priced(sorted(candidates))
        if not priced:
            # No option is measurably faster (noisy times of near-equal clocks), yet late
            # clock changes still slow the path: pin those at their top clock, which changes
            # no clock between them (pinned: never moved again, so this ends).
            late = any(run.penalized[v] for v in run.path)
            moves = ladder.pin_top(candidates) if late else []
            if not moves:
                return replay.chosen  # everything that matters already runs at maximum
            replay.set_many(moves)
        elif not batch:
            best = min(priced, key=lambda item: item[0])  # the first of equal prices
            replay.set(best[1], best[2])
        else:
            replay.set_many(_covering(priced, run.time_s - limit, replay.chosen))


def _give_back(
    replay: IncrementalReplay,
    before: Mapping[int, Option],
    limit: float,
    switch_latency_s: float,
    noisy: _NoiseCheck,
) -> None:
    """Undo the noise stage's speed-ups that turn out not to be needed, dearest first.

    The noise stage adds speed-ups one batch at a time, each chosen for the paths critical
    then; once the plan fits, some earlier ones no longer matter. Each is undone if the plan
    still fits without it (one noisy replay each; at most :data:`_GIVE_BACK_MOST`, on DAGs of
    up to :data:`BOTH_STARTS_MAX_NODES` instructions).
    """
    if len(replay.chosen) > BOTH_STARTS_MAX_NODES:
        return
    dearest = sorted(before, key=lambda v: before[v].energy_j - replay.chosen[v].energy_j)[
        :_GIVE_BACK_MOST
    ]
    for v in dearest:
        faster, slower = replay.chosen[v], before[v]
        replay.set(v, slower)
        if replay.run(energy=False).time_s > limit or not noisy.fits(
            replay.chosen, switch_latency_s
        ):
            replay.set(v, faster)


class _NoiseCheck:
    """The noise stage (step 3): the plan's expected time under noise against all-max's.

    Replayed over the same draws (:class:`~powerlib.planning.perseus.noise.NoisyReplay`), it
    must be within the allowed slowdown with one standard error to spare (the draws are a
    sample).
    """

    def __init__(
        self,
        model: ReplayModel,
        noise: TimeNoise,
        time_se: float,
        limit_s: float | None,
        max_slowdown: float,
        latency_samples_s: Sequence[float] = (),
    ) -> None:
        self._noisy = NoisyReplay(
            model,
            noise=noise,
            row_se=time_se,
            latency_samples_s=latency_samples_s,
            samples=_SAMPLES,
            row_groups=_ROW_GROUPS if time_se > 0 else None,
        )
        top = [
            max(model.options[(i.stage, i.kind)], key=lambda o: o.freq_mhz)
            for i in model.dag.instructions
        ]
        base, _ = self._noisy.run(top, 0.0)
        self._base = base if limit_s is None else np.full_like(base, limit_s)
        self._limit_s = limit_s
        self._allowed = max_slowdown
        # a batch of speed-ups per replay keeps large DAGs to a few dozen replays
        self._batch = max(1, len(model.dag.instructions) // 200)

    def fits(self, chosen: Sequence[Option], switch_latency_s: float) -> bool:
        """Whether ``chosen`` is within the allowed slowdown under the noise."""
        times, _ = self._noisy.run(chosen, switch_latency_s)
        return self._fits(times)

    def _fits(self, times: np.ndarray) -> bool:
        if self._limit_s is not None:
            times = np.maximum(times, self._limit_s)  # the straggler holds the iteration
        excess = times / self._base - 1.0 - self._allowed
        margin = float(excess.std(ddof=1)) / math.sqrt(excess.size) if excess.size > 1 else 0.0
        if self._noisy.row_groups < self._noisy.samples:
            # the profile's error is one fixed unknown: the plan must fit most of its truths,
            # not their average (the iteration then waits for the one path measured shortest)
            groups = self._noisy.group_means(excess)
            margin = max(margin, _ROW_QUANTILE_Z * float(groups.std(ddof=1)))
        return float(excess.mean()) + margin <= 0.0

    def too_slow(
        self,
        chosen: Sequence[Option],
        switch_latency_s: float,
        next_faster: Callable[[int], Any],
    ) -> list[tuple[float, int, Option]]:
        """The next speed-ups (cheapest per draw in which the node is critical); none: in bounds."""
        times, critical = self._noisy.run(chosen, switch_latency_s)
        if self._fits(times):
            return []
        ranked = []
        for v, count in enumerate(critical):
            if count:
                got = next_faster(v)
                if got is not None:
                    ranked.append((got[1] / count, v, got[0]))
        ranked.sort(key=lambda item: item[0])
        return ranked[: self._batch]
