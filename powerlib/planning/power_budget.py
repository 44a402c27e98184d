"""Per-GPU power limits inside a power budget: the fastest iteration the budget allows.

Sites that provision GPUs below their rated power cap every GPU alike (``nvidia-smi -pl``). A
pipeline's stages are not alike: a stage that waits for another (a bubble, a slower last stage,
a straggler pipeline) can give up watts without slowing the iteration, and the watts it frees
can stay with the stages on the critical path. :func:`plan_power_budget` chooses one power
limit per stage (GPU, or one group of TP/CP ranks acting as one) whose sum is at most the
budget, never above the limit an administrator or the facility set, and compares it with the
uniform cap (every GPU at ``budget / N``) and with no cap at all.

The model of a power limit (:func:`throttled_freq_mhz`, what the emulator runs too): an
instruction runs at the highest profiled clock, at or below the one it is locked at (the top
clock when unlocked), whose profiled power (``energy_j / time_s``) is within the limit; the
GPU's clocks throttle to hold the limit. No clock within it: the lowest clock. A waiting GPU
draws ``min(P_block, limit)``.

The method. A stage's *levels* are the distinct powers of its profile rows between the lowest
limit it can hold (every kind at its lowest clock) and its administrator's limit, each kept
only where the stage's clocks change (a limit between two levels runs the lower one's clocks).
Two starting points are searched, each evaluated on the instruction DAG (critical path with
the throttled durations, held to the straggler's deadline):

- water-filling by marginal cost: from the administrators' limits, while the limits sum above
  the budget, lower the stage whose next level costs the least iteration time per watt freed
  (ties: the least makespan), so a stage with slack gives up watts first;
- the uniform cap itself, so the plan is never slower than it on the profile.

Each is refined by transfers: a stage gives up one to three levels and another rises as far
as the freed watts allow, while that shortens the iteration; budget left over goes where it
shortens the iteration most; last, every stage sheds levels, one at a time, while the
iteration time holds (watts that buy no time only cost energy). Marginal cost alone stalls where a balanced pipeline needs all of
its stages lowered together (on the GPT-3 profile at 60 % of the summed limits it ended 5
points *slower* than the uniform cap), and transfers of one level where a raise needs more
watts than one level frees (at 70 %: 10.8 % slower than uncapped, against 9.0 % with up to
three). The fastest wins, then the one of least energy (with a straggler, several meet its
deadline), and the budget still left is spread as headroom below each stage's next level,
which changes no clock. Everything is evaluated on the profile as measured, not on fitted
costs.

This module is pure: it imports only the standard library and the planning layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from powerlib.errors import InvalidArgumentError
from powerlib.planning.names import POWER_BUDGET
from powerlib.planning.pipeline import PipelineDAG
from powerlib.planning.plan import FrequencyPlan, PlannedInstruction
from powerlib.planning.profile import Profile

__all__ = [
    "LimitOutcome",
    "PowerBudgetPlan",
    "PowerLimitModel",
    "plan_power_budget",
    "limits_plan",
    "throttled_freq_mhz",
    "uniform_limits_w",
    "unthrottled_limit_w",
]

MAX_TRANSFER_ROUNDS = 200  # pairwise-transfer passes; each must shorten the iteration
HEADROOM_SHARE = 0.99  # of the gap to the next level: headroom never changes a planned clock
TRANSFER_LEVELS = 3  # a transfer lowers its donor by up to this many levels


def throttled_freq_mhz(
    by_freq: Mapping[float, tuple[float, float]], freq_mhz: float, limit_w: float | None
) -> float:
    """The clock an instruction runs at under a power limit.

    The highest profiled clock at or below ``freq_mhz`` whose power (``energy_j / time_s``) is
    within ``limit_w``; none: the lowest profiled clock (the GPU cannot go lower in this model).

    Args:
        by_freq: The instruction's profile: ``{freq_mhz: (time_s, energy_j)}``, times > 0.
        freq_mhz: The clock it is locked at (the top clock when unlocked).
        limit_w: The power limit; ``None``: no limit (``freq_mhz`` itself).
    """
    if limit_w is None:
        return freq_mhz
    best: float | None = None
    for f, (time_s, energy_j) in by_freq.items():
        if f <= freq_mhz and energy_j <= limit_w * time_s and (best is None or f > best):
            best = f
    return min(by_freq) if best is None else best


@dataclass(frozen=True, slots=True)
class LimitOutcome:
    """What one set of per-stage power limits gives, on the profile.

    Attributes:
        limits_w: Per stage, its power limit.
        time_s: Iteration time: the makespan, or the straggler's deadline if later.
        makespan_s: When the pipeline's last instruction ends.
        energy_j: Every GPU's energy over the iteration: instructions at their throttled
            clocks, and ``min(P_block, limit)`` while waiting, up to ``time_s``.
        clocks_mhz: Per stage, the clock each kind runs at under its limit.
    """

    limits_w: tuple[float, ...]
    time_s: float
    makespan_s: float
    energy_j: float
    clocks_mhz: tuple[dict[str, float], ...]

    @property
    def sum_w(self) -> float:
        """The limits' sum."""
        return sum(self.limits_w)

    def to_json(self) -> dict[str, object]:
        """The outcome as a JSON object."""
        return {
            "limits_w": list(self.limits_w),
            "sum_w": self.sum_w,
            "time_s": self.time_s,
            "makespan_s": self.makespan_s,
            "energy_j": self.energy_j,
            "clocks_mhz": [dict(c) for c in self.clocks_mhz],
        }


@dataclass(frozen=True, slots=True)
class PowerBudgetPlan:
    """The plan for one budget, beside the uniform cap and no cap (all predicted on the profile).

    Attributes:
        budget_w: The budget the limits sum to at most.
        admin_limits_w: Per stage, the limit nothing raises.
        plan: The planned limits.
        uniform: Every GPU at ``budget / N`` (or its administrator's limit, if lower).
        uncapped: Every GPU at its administrator's limit.
        deadline_s: The straggler's iteration time, or ``None``.
    """

    budget_w: float
    admin_limits_w: tuple[float, ...]
    plan: LimitOutcome
    uniform: LimitOutcome
    uncapped: LimitOutcome
    deadline_s: float | None

    def to_json(self) -> dict[str, object]:
        """The plan as a JSON object."""
        return {
            "budget_w": self.budget_w,
            "admin_limits_w": list(self.admin_limits_w),
            "deadline_s": self.deadline_s,
            "powerlib": self.plan.to_json(),
            "uniform_cap": self.uniform.to_json(),
            "uncapped": self.uncapped.to_json(),
        }


def unthrottled_limit_w(profile: Profile) -> float:
    """A limit no row of ``profile`` throttles at: its highest power, up to a whole watt."""
    return float(math.ceil(max(r.energy_j / r.time_s for r in profile.rows)))


def uniform_limits_w(budget_w: float, admin_limits_w: Sequence[float]) -> tuple[float, ...]:
    """Every GPU at ``budget_w / N``, never above its administrator's limit."""
    share = budget_w / len(admin_limits_w)
    return tuple(min(share, admin) for admin in admin_limits_w)


class PowerLimitModel:
    """A pipeline under per-stage power limits, evaluated on its profile and DAG.

    Args:
        profile: Per (stage, kind, clock) time and energy.
        dag: The iteration's instruction DAG (:func:`~powerlib.planning.pipeline.build_dag`).
        p_block_w: Power while waiting (capped by the limit).
        deadline_s: The iteration cannot end before this (a straggler pipeline); ``None``: none.

    Raises:
        PlanError: The profile lacks a stage or kind the DAG runs.
    """

    def __init__(
        self,
        profile: Profile,
        dag: PipelineDAG,
        *,
        p_block_w: float = 0.0,
        deadline_s: float | None = None,
    ) -> None:
        self.dag = dag
        self.num_stages = dag.num_stages
        self.p_block_w = p_block_w
        self.deadline_s = deadline_s
        self._order = dag.topological_order()
        self._preds: list[list[int]] = [[] for _ in dag.instructions]
        for u, v in dag.edges:
            self._preds[v].append(u)
        kinds = [
            sorted({i.kind for i in dag.instructions if i.stage == s})
            for s in range(dag.num_stages)
        ]
        self.tables: list[dict[str, dict[float, tuple[float, float]]]] = [
            {k: {f: (t, e) for f, t, e in profile.options(s, k)} for k in kinds[s]}
            for s in range(self.num_stages)
        ]
        self._cache: dict[tuple[int, float], dict[str, tuple[float, float, float]]] = {}

    def floor_w(self, stage: int) -> float:
        """The lowest limit the stage can hold: every kind's lowest power, the largest of them."""
        return max(
            min(e / t for t, e in by_freq.values()) for by_freq in self.tables[stage].values()
        )

    def levels_w(self, stage: int, admin_w: float) -> list[float]:
        """The stage's limits worth trying, highest first.

        The distinct profile powers from ``admin_w`` down to :meth:`floor_w` (the limits at
        which a clock changes), each the lowest limit that runs its clocks: a limit between two
        levels runs the lower one's clocks.
        """
        floor = self.floor_w(stage)
        powers = {e / t for by_freq in self.tables[stage].values() for t, e in by_freq.values()}
        candidates = [admin_w, *sorted((p for p in powers if floor <= p < admin_w), reverse=True)]
        out: list[float] = []
        for limit in candidates:  # a level as fast as the next lower one only costs watts
            if out and self._durations(stage, out[-1]) == self._durations(stage, limit):
                out[-1] = limit
            else:
                out.append(limit)
        return out

    def _durations(self, stage: int, limit_w: float) -> list[float]:
        return [t for _, t, _ in self.stage_at(stage, limit_w).values()]

    def stage_at(self, stage: int, limit_w: float) -> dict[str, tuple[float, float, float]]:
        """Per kind, ``(freq_mhz, time_s, energy_j)`` it runs at, unlocked, under ``limit_w``."""
        key = (stage, limit_w)
        got = self._cache.get(key)
        if got is None:
            got = {}
            for kind, by_freq in self.tables[stage].items():
                f = throttled_freq_mhz(by_freq, max(by_freq), limit_w)
                got[kind] = (f, *by_freq[f])
            self._cache[key] = got
        return got

    def makespan_s(self, limits_w: Sequence[float]) -> float:
        """When the last instruction ends under ``limits_w``."""
        at = [self.stage_at(s, lim) for s, lim in enumerate(limits_w)]
        ins = self.dag.instructions
        end = [0.0] * len(ins)
        for v in self._order:
            start = max((end[u] for u in self._preds[v]), default=0.0)
            end[v] = start + at[ins[v].stage][ins[v].kind][1]
        return max(end, default=0.0)

    def time_s(self, limits_w: Sequence[float]) -> tuple[float, float]:
        """``(iteration time, makespan)`` under ``limits_w``."""
        makespan = self.makespan_s(limits_w)
        deadline = self.deadline_s
        return (makespan if deadline is None else max(makespan, deadline)), makespan

    def outcome(self, limits_w: Sequence[float]) -> LimitOutcome:
        """Time, energy and clocks under ``limits_w``."""
        time_s, makespan = self.time_s(limits_w)
        energy = 0.0
        for s, lim in enumerate(limits_w):
            at = self.stage_at(s, lim)
            busy_s = 0.0
            for node in self.dag.instructions:
                if node.stage == s:
                    _, t, e = at[node.kind]
                    busy_s += t
                    energy += e
            energy += min(self.p_block_w, lim) * max(time_s - busy_s, 0.0)
        return LimitOutcome(
            limits_w=tuple(limits_w),
            time_s=time_s,
            makespan_s=makespan,
            energy_j=energy,
            clocks_mhz=tuple(
                {k: f for k, (f, _, _) in self.stage_at(s, lim).items()}
                for s, lim in enumerate(limits_w)
            ),
        )


def plan_power_budget(
    profile: Profile,
    dag: PipelineDAG,
    budget_w: float,
    *,
    admin_limits_w: float | Sequence[float] | None = None,
    p_block_w: float | None = None,
    deadline_s: float | None = None,
) -> PowerBudgetPlan:
    """Per-stage power limits summing to at most ``budget_w`` that minimize the iteration time.

    Args:
        profile: Per (stage, kind, clock) time and energy (the GPUs' unlocked runs throttle
            within it).
        dag: The iteration's instruction DAG.
        budget_w: What the stages' limits may sum to.
        admin_limits_w: The limit an administrator or the facility set: one for every stage,
            or one per stage; nothing is raised above it. ``None``: each stage's highest
            profiled power (it never throttles).
        p_block_w: Power while waiting; ``None``: the profile's, else 0.
        deadline_s: A straggler pipeline holds every iteration to this time.

    Raises:
        InvalidArgumentError: A budget or limit that is not a positive number, a limit per
            stage of the wrong count, an administrator's limit below the lowest power its
            stage can hold, or a budget below the sum of those lowest powers (one line each).
    """
    _check_positive("budget_w", budget_w)
    if p_block_w is None:
        p_block_w = profile.p_block_w or 0.0
    model = PowerLimitModel(profile, dag, p_block_w=p_block_w, deadline_s=deadline_s)
    admin = _admin_limits(model, admin_limits_w)
    floors = [model.floor_w(s) for s in range(model.num_stages)]
    if budget_w < sum(floors) * (1 - 1e-12):
        raise InvalidArgumentError(
            f"a power budget of {budget_w:.0f} W is below the {sum(floors):.0f} W the "
            f"{model.num_stages} GPUs draw at their lowest profiled clocks "
            f"({', '.join(f'{f:.0f}' for f in floors)} W): raise the budget"
        )
    limits = _water_fill(model, admin, budget_w)
    return PowerBudgetPlan(
        budget_w=budget_w,
        admin_limits_w=tuple(admin),
        plan=model.outcome(limits),
        uniform=model.outcome(uniform_limits_w(budget_w, admin)),
        uncapped=model.outcome(admin),
        deadline_s=deadline_s,
    )


def limits_plan(
    model: PowerLimitModel, budget: PowerBudgetPlan, workload: Mapping[str, object]
) -> FrequencyPlan:
    """The plan a session applies: each stage's limit, its instructions at their clocks.

    Every instruction is locked at the clock its kind runs at under its stage's limit (so a
    GPU runs the plan's clocks whatever its power does), and records its profiled time and
    energy there; ``summary`` carries the budget and the uniform cap beside the plan.
    """
    limits = budget.plan.limits_w
    stages = tuple(
        tuple(
            PlannedInstruction(
                model.dag.instructions[i],
                f,
                predicted_time_s=t,
                predicted_energy_j=e,
            )
            for i in model.dag.stage_order(s)
            for f, t, e in [model.stage_at(s, limits[s])[model.dag.instructions[i].kind]]
        )
        for s in range(model.num_stages)
    )
    plan = budget.plan
    return FrequencyPlan(
        stages=stages,
        workload={"num_stages": model.num_stages, **workload, "p_block_w": model.p_block_w},
        summary={
            "policy": POWER_BUDGET,
            "time_s": plan.time_s,
            "energy_j": plan.energy_j,
            "budget_w": budget.budget_w,
            "admin_limits_w": list(budget.admin_limits_w),
            "uniform_cap": {k: budget.uniform.to_json()[k] for k in ("time_s", "energy_j")},
        },
        power_limits_w=dict(enumerate(limits)),
    )


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, int | float) and math.isfinite(value)):
        raise InvalidArgumentError(f"{name} must be a number of watts, not {value!r}")
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be > 0 W, not {value}")


def _admin_limits(model: PowerLimitModel, given: float | Sequence[float] | None) -> list[float]:
    """Each stage's administrator limit, checked against what the stage can hold."""
    n = model.num_stages
    if given is None:
        tops = [
            max(e / t for by_freq in model.tables[s].values() for t, e in by_freq.values())
            for s in range(n)
        ]
        return tops
    admin = [float(given)] * n if isinstance(given, int | float) else [float(x) for x in given]
    if len(admin) != n:
        raise InvalidArgumentError(
            f"admin_limits_w has {len(admin)} limits for {n} stages: give one, or one per stage"
        )
    for s, limit in enumerate(admin):
        _check_positive(f"admin_limits_w[{s}]", limit)
        if limit < model.floor_w(s) * (1 - 1e-12):
            raise InvalidArgumentError(
                f"GPU {s}'s power limit {limit:.0f} W is below the {model.floor_w(s):.0f} W its "
                "profile draws at the lowest clocks: no plan can hold it"
            )
    return admin


def _water_fill(model: PowerLimitModel, admin: list[float], budget_w: float) -> list[float]:
    """The fastest limits within the budget: the better of two starts, each refined.

    The starts: lowering by marginal cost (:func:`_marginal`) and the uniform cap itself, so
    the plan is never slower than the uniform cap on the model. Each is refined (:func:`_refill`,
    :func:`_transfer`) and sheds the watts that buy no time (:func:`_shed`); the fastest wins
    (then the one of less energy, then the fewer watts), and the budget left over is spread
    upward as headroom (:func:`_headroom`).
    """
    levels = [model.levels_w(s, admin[s]) for s in range(model.num_stages)]
    starts = [_marginal(model, levels, budget_w)]
    uniform = _snapped(levels, uniform_limits_w(budget_w, admin))
    if _sum(levels, uniform) <= budget_w:
        starts.append(uniform)
    best: tuple[float, float, float, list[int]] | None = None
    for idx in starts:
        if idx is None:
            continue
        _refill(model, levels, idx, budget_w)
        _transfer(model, levels, idx, budget_w)
        _shed(model, levels, idx)
        limits = _limits(levels, idx)
        outcome = model.outcome(limits)
        key = (outcome.time_s, outcome.energy_j, outcome.sum_w, idx)
        if best is None or key[:3] < best[:3]:
            best = key
    if best is None:  # pragma: no cover - the budget was checked against the floors
        raise InvalidArgumentError(f"no limits fit a budget of {budget_w:.0f} W")
    return _headroom(levels, best[3], admin, budget_w)


def _limits(levels: list[list[float]], idx: list[int]) -> list[float]:
    return [lv[i] for lv, i in zip(levels, idx)]


def _sum(levels: list[list[float]], idx: list[int]) -> float:
    return sum(_limits(levels, idx))


def _snapped(levels: list[list[float]], limits: Sequence[float]) -> list[int]:
    """Each limit as the highest level at or below it (the lowest level when none is)."""
    out = []
    for lv, limit in zip(levels, limits):
        below = [i for i, level in enumerate(lv) if level <= limit]
        out.append(below[0] if below else len(lv) - 1)
    return out


def _lowered(levels: list[list[float]], idx: list[int], s: int) -> list[int] | None:
    """``idx`` with stage ``s`` one level lower, or ``None`` at its lowest."""
    if idx[s] + 1 >= len(levels[s]):
        return None
    out = [*idx]
    out[s] += 1
    return out


def _marginal(
    model: PowerLimitModel, levels: list[list[float]], budget_w: float
) -> list[int] | None:
    """Lower the stage whose next level costs the least time per watt freed, until it fits."""
    idx = [0] * model.num_stages
    current = model.time_s(_limits(levels, idx))
    while _sum(levels, idx) > budget_w:
        best: tuple[float, float, int] | None = None
        for s in range(model.num_stages):
            trial = _lowered(levels, idx, s)
            if trial is None:
                continue
            freed = levels[s][idx[s]] - levels[s][trial[s]]
            time_s, makespan = model.time_s(_limits(levels, trial))
            key = ((time_s - current[0]) / freed, (makespan - current[1]) / freed, s)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        idx[best[2]] += 1
        current = model.time_s(_limits(levels, idx))
    return idx


def _best_raise(
    model: PowerLimitModel,
    levels: list[list[float]],
    idx: list[int],
    spare_w: float,
    skip: int = -1,
) -> tuple[float, int, int] | None:
    """The raise (within ``spare_w``) that shortens the iteration most: ``(time, stage, level)``."""
    best: tuple[float, int, int] | None = None
    for s, lv in enumerate(levels):
        if s == skip:
            continue
        for j in range(idx[s]):  # higher levels come first in the list
            if lv[j] - lv[idx[s]] > spare_w:
                continue
            trial = [*idx]
            trial[s] = j
            time_s = model.time_s(_limits(levels, trial))[0]
            if best is None or time_s < best[0]:
                best = (time_s, s, j)
            break  # the highest level that fits is the best this stage can do
    return best


def _refill(
    model: PowerLimitModel, levels: list[list[float]], idx: list[int], budget_w: float
) -> None:
    """Give the budget left over to the stage it speeds up most, while it speeds one up."""
    while True:
        now = model.time_s(_limits(levels, idx))[0]
        best = _best_raise(model, levels, idx, budget_w - _sum(levels, idx))
        if best is None or best[0] >= now:
            return
        idx[best[1]] = best[2]


def _transfer(
    model: PowerLimitModel, levels: list[list[float]], idx: list[int], budget_w: float
) -> None:
    """Move watts between stages while it shortens the iteration.

    Each round takes the best of: one stage down by 1 to :data:`TRANSFER_LEVELS` levels, and
    another up to the highest level the freed watts (and any spare) allow; then any spare goes
    where it shortens the iteration most (:func:`_refill`). One level at a time stalls where a
    raise needs more watts than one level frees.
    """
    for _ in range(MAX_TRANSFER_ROUNDS):
        now = model.time_s(_limits(levels, idx))[0]
        found: tuple[float, int, int, int, int] | None = None
        for i in range(model.num_stages):
            lowered: list[int] | None = idx
            for k in range(1, TRANSFER_LEVELS + 1):
                lowered = _lowered(levels, lowered, i) if lowered is not None else None
                if lowered is None:
                    break
                spare = budget_w - _sum(levels, lowered)
                best = _best_raise(model, levels, lowered, spare, skip=i)
                if best is not None and best[0] < now * (1 - 1e-9):
                    if found is None or best[0] < found[0]:
                        found = (best[0], i, k, best[1], best[2])
        if found is None:
            return
        _, i, k, s, j = found
        idx[i] += k
        idx[s] = j
        _refill(model, levels, idx, budget_w)


def _shed(model: PowerLimitModel, levels: list[list[float]], idx: list[int]) -> None:
    """Lower every stage, one level at a time, highest limit first, while the time holds.

    Watts that buy no time (a stage that waits, every stage under a straggler's deadline)
    only cost energy: the plan spends the budget where it shortens the iteration.
    """
    target = model.time_s(_limits(levels, idx))[0]
    changed = True
    while changed:
        changed = False
        for s in sorted(range(model.num_stages), key=lambda s: -levels[s][idx[s]]):
            trial = _lowered(levels, idx, s)
            if trial is not None and model.time_s(_limits(levels, trial))[0] <= target:
                idx[s], changed = trial[s], True


def _headroom(
    levels: list[list[float]], idx: list[int], admin: list[float], budget_w: float
) -> list[float]:
    """The limits of ``idx``, with the budget left over spread evenly upward as headroom.

    A stage rises at most to its administrator's limit at its top level, else to just below
    its next higher level: its clocks stay as planned on the profile, and a real GPU, whose
    power varies around the profiled mean, gets room before it throttles.
    """
    out = _limits(levels, idx)
    ceiling = [
        admin[s] if idx[s] == 0 else out[s] + HEADROOM_SHARE * (levels[s][idx[s] - 1] - out[s])
        for s in range(len(out))
    ]
    while True:
        open_ = [s for s in range(len(out)) if out[s] < ceiling[s]]
        spare = budget_w - sum(out)
        if not open_ or spare <= 1e-9 * budget_w:
            return out
        share = spare / len(open_)
        for s in open_:
            out[s] = min(ceiling[s], out[s] + share)
