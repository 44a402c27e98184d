"""Frontier points: the Phillips-Dessouky walk's, or only those wanted, solved directly.

:func:`walk_points` takes every point of the walk, one time quantum at a time, slowest first
(docs/perseus.md §2.3); :func:`direct_points` solves only the points a plan needs
(:class:`Wanted`: ``T_min``, ``T*``, a deadline's, an evenly spaced sweep), one linear program
or min-cost flow each (docs/perseus.md §2.6), and keeps its model in a :class:`DirectPoints`
so that more can be added later (``Frontier.extend``). Beside the points it starts the slowdown
guard's exact-time solves (:func:`powerlib.planning.perseus.guard.exact_start`) on the
:class:`~powerlib.planning.perseus.replay.ReplayModel` the plan is replayed on.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypedDict

from powerlib.planning.perseus import guard
from powerlib.planning.perseus.direct import DirectSolver
from powerlib.planning.perseus.flow import FlowSolver, point_solver
from powerlib.planning.perseus.replay import ReplayModel
from powerlib.planning.perseus.solver import PhillipsDessouky
from powerlib.planning.perseus.work import (
    DEFAULT_MAX_WORK,
    WORK_HINT,
    WorkEstimate,
    direct_kind,
)

__all__ = [
    "DirectPoints",
    "FrontierPoint",
    "Wanted",
    "deadline_quant",
    "direct_points",
    "sweep_quants",
    "walk_points",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Wanted:
    """Which frontier points a direct solve computes (``T_min`` always).

    Attributes:
        t_star: ``T*``, the minimum-energy point.
        deadlines_s: Per deadline, the slowest point at or below it (the ``deadline`` policy).
        argmin_deadlines_s: Per deadline, the minimum-energy point at or below it (``deadline``
            with ``argmin``).
        sweep: Evenly spaced points from the slowest to ``T_min`` for frontier outputs (CSV,
            plot); 0: none.
        guards: ``(deadline_s or None, max_slowdown)`` of slowdown guards to come: their
            exact-time solves (:func:`powerlib.planning.perseus.guard.exact_start`) run beside
            the points' (the compiled flow releases the GIL) and wait for the guard.
    """

    t_star: bool = True
    deadlines_s: tuple[float, ...] = ()
    argmin_deadlines_s: tuple[float, ...] = ()
    sweep: int = 0
    guards: tuple[tuple[float | None, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontierPoint:
    """One point of the frontier (one solver step).

    Attributes:
        iteration: 1-based solver step.
        quant_time: Iteration time in units of τ.
        time_s: Iteration time.
        effective_energy_j: Σ effective energy of the instructions (the modelled, fitted value).
        energy_j: ``effective_energy_j + N · P_block · time_s``.
        cost_change_j: Effective-energy increase over the previous point (J per τ).
        durations: Planned duration of every instruction, in units of τ, in DAG node order.
    """

    iteration: int
    quant_time: int
    time_s: float
    effective_energy_j: float
    energy_j: float
    cost_change_j: float
    durations: tuple[int, ...]


def _point(
    quant: int,
    cost: float,
    change: float,
    durations: tuple[int, ...],
    *,
    t_max: int,
    n_block: float,
    unit_time_s: float,
) -> FrontierPoint:
    time_s = quant * unit_time_s
    return FrontierPoint(
        iteration=t_max - quant,
        quant_time=quant,
        time_s=time_s,
        effective_energy_j=cost,
        energy_j=cost + n_block * time_s,
        cost_change_j=change,
        durations=durations,
    )


def walk_points(
    solver: PhillipsDessouky,
    max_work: int | None,
    n_block: float,
    unit_time_s: float,
    progress: Callable[[int, int], None] | None,
) -> list[FrontierPoint]:
    """Every point, slowest first: the Phillips-Dessouky walk."""
    WorkEstimate(
        num_instructions=solver.num_nodes,
        time_steps=solver.makespan() - solver.fastest_makespan(),
    ).check(max_work, hint=WORK_HINT)
    t_max = solver.makespan()
    points = [
        _point(
            step.quant_time,
            step.cost,
            step.cost_change,
            step.durations,
            t_max=t_max,
            n_block=n_block,
            unit_time_s=unit_time_s,
        )
        for step in solver.run(progress)
    ]
    if not points:
        # Nothing can be sped up or slowed down: the frontier is the single starting point.
        points.append(
            _point(
                t_max,
                solver.total_cost(),
                0.0,
                tuple(solver.durations),
                t_max=t_max,
                n_block=n_block,
                unit_time_s=unit_time_s,
            )
        )
    return points


class DirectFields(TypedDict, total=False):
    """The frontier's fields a direct solve fills in beside its points (none: the defaults)."""

    complete: bool
    t_star_quant: int | None
    argmin_quant: dict[int, int]
    direct: DirectPoints


class DirectPoints:
    """The points of a direct solve, kept with their model so that more can be added.

    Always ``T_min`` and the walk's first point ``T_max - 1`` (one max-flow step: it gives the
    slowest time the frontier reaches and the start's cost); ``T*`` if asked; each deadline's
    point (the slowest at or below it) and, for ``argmin``, its minimum-energy point; and
    ``wanted.sweep`` evenly spaced points for outputs. ``cost_change_j`` of a point is the
    average per τ since the next slower point listed. Later solves (``Frontier.extend``, a
    session's re-plan) start from the last basis; a lock keeps one solve at a time.

    Args:
        solver: The walk's solver (DAG and cost tables); its start is the all-slowest plan.
        n_block: ``N · P_block``, the power every stage draws while the iteration lasts.
        unit_time_s: The time quantum τ.
        model: What the slowdown guards of :attr:`Wanted.guards` replay on.
        baseline_time_s: All-max's iteration time, asked for only by a guard without a
            deadline (its limit's reference).
        direct_solver: ``auto`` or ``highs`` (:func:`~powerlib.planning.perseus.work.direct_kind`).
    """

    def __init__(
        self,
        solver: PhillipsDessouky,
        n_block: float,
        unit_time_s: float,
        model: ReplayModel,
        baseline_time_s: Callable[[], float],
        direct_solver: str = "auto",
    ) -> None:
        self.n_block, self.unit_time_s = n_block, unit_time_s
        self.model, self.baseline_time_s = model, baseline_time_s
        self.t_max = solver.makespan()
        self.t_min = solver.fastest_makespan()
        self.start_cost = solver.total_cost()
        self.direct: FlowSolver | DirectSolver = point_solver(
            solver, time_cost_per_quantum=n_block * unit_time_s, direct_solver=direct_solver
        )
        # The compiled flow solves concurrently (it releases the GIL and keeps no state
        # between solves); HiGHS keeps one model.
        self.concurrent = isinstance(self.direct, FlowSolver)
        self.found: dict[int, tuple[float, tuple[int, ...]]] = {}
        if self.concurrent:
            self.t_first = self.t_max - 1  # solved with T_min in solve(): no scipy import
        else:
            first = next(solver.run())  # T_max - 1, from the all-slowest start
            self.t_first = first.quant_time
            self.found[self.t_first] = (first.cost, first.durations)
        self.t_star: int | None = None
        self.argmin: dict[int, int] = {}
        self.lock = threading.Lock()
        #: (limit_s, held) -> the guard's exact-time start, solving in the background
        self.guard_starts: dict[tuple[float, bool], _Background] = {}

    def at(self, quant: int) -> None:
        """Solve the point at ``quant`` (kept in :attr:`found`) unless it is known."""
        if quant not in self.found:
            got = self.direct.at(quant)
            self.found[quant] = (got.cost, got.durations)

    def cheapest(self, lo: int, hi: int) -> int:
        """The quant time of the cheapest point in ``[lo, hi]``, solved and kept."""
        got = self.direct.cheapest(lo, hi)
        self.found.setdefault(got.quant_time, (got.cost, got.durations))
        return got.quant_time

    def solve(
        self,
        wanted: Wanted,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[list[FrontierPoint], DirectFields]:
        """Solve what ``wanted`` adds; ``progress(done, expected)`` after each point.

        Returns:
            Every point solved so far, slowest first, and the frontier fields that go with
            them (``complete``, ``t_star_quant``, ``argmin_quant``, ``direct``: this).
        """
        with self.lock:
            if self.concurrent and guard.available():
                for deadline_s, max_slowdown in wanted.guards:
                    reference_s = self.baseline_time_s() if deadline_s is None else deadline_s
                    limit = guard.guard_limit(reference_s, max_slowdown)
                    key = (limit, deadline_s is not None)
                    if key not in self.guard_starts:
                        self.guard_starts[key] = _Background(
                            guard.exact_start, self.model, limit, None, key[1]
                        )
            t_min, t_first, tau = self.t_min, self.t_first, self.unit_time_s
            star = wanted.t_star and self.t_star is None
            if self.concurrent and t_min not in self.found:
                # T_min beside T_max - 1 and T*: solves of one to two seconds each at 16 x 256
                with ThreadPoolExecutor(max_workers=1) as pool:
                    fastest = pool.submit(self.at, t_min)
                    self.at(t_first)
                    if star:
                        self.t_star = self.cheapest(t_min, t_first)
                    fastest.result()
            self.at(t_first)
            self.at(t_min)
            if star and self.t_star is None:
                self.t_star = self.cheapest(t_min, t_first)
            for deadline_s in wanted.argmin_deadlines_s:
                quant = deadline_quant(deadline_s, tau, t_min, t_first)
                if quant is not None and quant not in self.argmin:
                    self.argmin[quant] = self.cheapest(t_min, quant)
            quants = [deadline_quant(d, tau, t_min, t_first) for d in wanted.deadlines_s]
            if wanted.sweep > 0:
                quants += sweep_quants(t_min, t_first, wanted.sweep)
            todo = sorted({q for q in quants if q is not None} - set(self.found))
            for done, quant in enumerate(todo, 1):
                self.at(quant)
                if progress is not None:
                    progress(done, len(todo))
            points = []
            prev_quant, prev_cost = self.t_max, self.start_cost
            for quant in sorted(self.found, reverse=True):
                cost, durations = self.found[quant]
                change = (cost - prev_cost) / (prev_quant - quant)
                points.append(
                    _point(
                        quant,
                        cost,
                        change,
                        durations,
                        t_max=self.t_max,
                        n_block=self.n_block,
                        unit_time_s=tau,
                    )
                )
                prev_quant, prev_cost = quant, cost
            extra: DirectFields = {
                "complete": False,
                "t_star_quant": self.t_star,
                "argmin_quant": dict(self.argmin),
                "direct": self,
            }
            return points, extra


def direct_points(
    solver: PhillipsDessouky,
    wanted: Wanted,
    n_block: float,
    unit_time_s: float,
    model: ReplayModel,
    baseline_time_s: Callable[[], float],
    max_work: int | None = DEFAULT_MAX_WORK,
    progress: Callable[[int, int], None] | None = None,
    direct_solver: str = "auto",
) -> tuple[list[FrontierPoint], DirectFields]:
    """The points ``wanted`` asks for, each by one linear program (docs/perseus.md §2.6).

    Arguments as :class:`DirectPoints`'s, and ``max_work``: refuse a program estimated past
    this many instruction-steps before it is built.
    """
    if solver.makespan() == solver.fastest_makespan():
        return walk_points(solver, None, n_block, unit_time_s, None), {}
    WorkEstimate(  # the exact program size, before it is built
        num_instructions=solver.num_nodes,
        time_steps=solver.makespan() - solver.fastest_makespan(),
        unit_segments=sum(t.q_max - t.q_min for t in solver.tables),
        solver=direct_kind(direct_solver),
    ).check(max_work, hint=WORK_HINT)
    return DirectPoints(
        solver, n_block, unit_time_s, model, baseline_time_s, direct_solver=direct_solver
    ).solve(wanted, progress)


class _Background:
    """``fn(*args)`` on a daemon thread; :meth:`result` waits and returns or re-raises.

    Not a ``ThreadPoolExecutor`` future: its threads are joined at interpreter exit, so a plan
    refused before its guard ran would still wait for the abandoned solve (seconds at scale).
    """

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._box: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._box.append((True, fn(*args)))
        except BaseException as err:  # noqa: BLE001 - handed to the caller of result()
            self._box.append((False, err))

    def result(self) -> Any:
        """The value, or the exception raised, of ``fn(*args)``."""
        self._thread.join()
        ok, value = self._box[0]
        if not ok:
            raise value
        return value


def sweep_quants(t_min: int, t_first: int, count: int) -> list[int]:
    """``count`` quant times evenly spaced from ``t_first`` down to ``t_min``, both included.

    The spacing is ``ceil((t_first - t_min) / (count - 1))`` quanta (every quantum when the
    span is shorter).
    """
    if count <= 1 or t_first <= t_min:
        return [t_min]
    step = max(1, math.ceil((t_first - t_min) / (count - 1)))
    return sorted({*range(t_first, t_min, -step), t_min})


def deadline_quant(deadline_s: float, unit_time_s: float, t_min: int, t_first: int) -> int | None:
    """The slowest frontier quant time with ``quant · τ <= deadline_s`` (the walk's rule).

    ``None`` when the deadline is below ``T_min``.
    """
    if not math.isfinite(deadline_s):
        return None
    quant = min(t_first, max(t_min - 1, math.floor(deadline_s / unit_time_s) + 1))
    while quant >= t_min and quant * unit_time_s > deadline_s + 1e-12:
        quant -= 1
    return quant if quant >= t_min else None
