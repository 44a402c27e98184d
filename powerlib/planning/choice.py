"""Choosing the plan: one frontier point by policy, guarded against realized slowdown.

Every caller that turns a frontier into a plan (``powerlib plan``, ``powerlib kareus plan``,
rank 0's planning step in a session, the benchmarks) goes through :func:`choose`::

    choice = choose(frontier, Policy(name="deadline", deadline_s=3.3))
    plan = choice.plan(metadata={...})        # the FrequencyPlan a session applies

The policy step is Perseus' (SOSP'24 §4.3, docs/perseus.md §2.4): ``fastest`` takes T_min,
``deadline`` the slowest point that meets a straggler's iteration time T′ (or, with ``argmin``,
the minimum-energy point with T ≤ T′), ``min-energy`` takes T*. For ``fastest`` and ``deadline``
the chosen point is then replayed on the measured profile and sped up where it would realize
slower than allowed (:meth:`Frontier.within_slowdown
<powerlib.planning.perseus.frontier.Frontier.within_slowdown>`); finally a plan that would spend
more energy than all maximum clocks, or still run past the allowed time, gets an objection
(:attr:`Choice.objection`) that callers apply instead of the plan. Pure: nothing is read or
written here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from powerlib.errors import PlanError
from powerlib.planning.names import POLICIES, POWER_BUDGET
from powerlib.planning.perseus.noise import TimeNoise

if TYPE_CHECKING:
    from powerlib.planning.perseus.frequency_options import Option
    from powerlib.planning.perseus.frontier import Baseline, Frontier
    from powerlib.planning.perseus.points import FrontierPoint
    from powerlib.planning.plan import FrequencyPlan

__all__ = ["Choice", "Policy", "check_budget", "check_policy", "choose", "objection"]


def check_policy(
    name: str,
    *,
    max_slowdown: float,
    switch_latency_s: float,
    budget_w: float | None = None,
    budget_fraction: float | None = None,
) -> None:
    """Refuse an unknown policy name, or a slowdown guard that is negative or not finite.

    Shared by :class:`Policy` and the session's plan settings, which name the deadline their
    own way (a time, or a multiple of the all-max iteration time). ``power-budget`` needs its
    budget: ``budget_w`` (watts, the job's GPUs' limits summed) or ``budget_fraction`` (of the
    limits they have when the session starts), exactly one, positive and finite; another
    policy takes neither (docs/perseus.md §7).

    Raises:
        PlanError: One line naming the value.
    """
    if name not in POLICIES:
        raise PlanError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    check_budget(name, budget_w, budget_fraction)
    if not (math.isfinite(max_slowdown) and max_slowdown >= 0):
        raise PlanError(f"max_slowdown must be >= 0, got {max_slowdown}")
    if not (math.isfinite(switch_latency_s) and switch_latency_s >= 0):
        raise PlanError(f"switch_latency_s must be >= 0, got {switch_latency_s}")


def check_budget(name: str, budget_w: float | None, budget_fraction: float | None) -> None:
    """A power budget where ``power-budget`` needs one, and nowhere else (one line).

    Raises:
        PlanError: A missing, doubled, non-positive or non-finite budget, or a budget given
            with another policy.
    """
    pairs = (("budget_w", budget_w), ("budget_fraction", budget_fraction))
    given = {key: value for key, value in pairs if value is not None}
    if name != POWER_BUDGET:
        if given:
            raise PlanError(f"a power budget ({', '.join(given)}) needs policy 'power-budget'")
        return
    if len(given) != 1:
        raise PlanError(
            "the power-budget policy needs one budget: budget_w (watts, the GPUs' limits "
            "summed) or budget_fraction (of the limits they have at the start, e.g. 0.8)"
        )
    [(key, value)] = given.items()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanError(f"{key} must be a number, not {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise PlanError(f"{key} must be > 0, got {value}")
    if key == "budget_fraction" and value > 1:
        raise PlanError(
            f"budget_fraction must be at most 1 (a share of the GPUs' limits; powerlib never "
            f"raises a limit), got {value}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How to pick a plan from a frontier.

    Attributes:
        name: ``fastest`` (T_min), ``deadline`` (a straggler's iteration time T′) or
            ``min-energy`` (T*); not ``power-budget``, which plans power limits, not a point
            (:func:`~powerlib.planning.power_budget.plan_power_budget`).
        deadline_s: T′ for ``deadline``.
        argmin: For ``deadline``: the minimum-energy point with T ≤ T′ (the paper's emulation
            rule) instead of the slowest point with T ≤ T′.
        max_slowdown: For ``fastest`` and ``deadline``: the realized slowdown allowed over
            all-max (``fastest``) or over T′ (``deadline``), as a fraction.
        switch_latency_s: Clock-change latency the guard's replay assumes.
        time_cv: Run-to-run spread of instruction times (relative standard deviation, as
            profiled): the guard then bounds the plan's expected slowdown under that noise
            (see ``Frontier.within_slowdown``).
        time_se: Relative standard error of a profiled row's mean time (the profile's own
            error, drawn with the noise).
        time_noise: Where the noise is shared (per iteration, per microbatch, independent);
            ``None``: ``time_cv`` independent per instruction (docs/perseus.md §2.8).
        latency_samples_s: Measured clock-change latencies: the guard's noisy replay draws each
            switch's latency from them (``switch_latency_s`` stays the deterministic replay's).
        request_ahead_s: Switches to a faster clock are requested this long before the
            previous instruction's predicted end (the apply phase's ``lead_s``), so they land by
            the instruction's start; ``None``: at the previous instruction's end.
    """

    name: str = "fastest"
    deadline_s: float | None = None
    argmin: bool = False
    max_slowdown: float = 0.001
    switch_latency_s: float = 0.005
    time_cv: float = 0.0
    time_se: float = 0.0
    time_noise: TimeNoise | None = None
    latency_samples_s: tuple[float, ...] = ()
    request_ahead_s: float | None = None

    @property
    def noise(self) -> TimeNoise:
        """The noise the guard draws: :attr:`time_noise`, else ``time_cv`` independent."""
        return self.time_noise if self.time_noise is not None else TimeNoise.iid(self.time_cv)

    def __post_init__(self) -> None:
        if self.name == POWER_BUDGET:
            raise PlanError(
                "a frontier point cannot hold a power budget: the power-budget policy plans "
                "per-GPU power limits (powerlib plan --policy power-budget --budget F)"
            )
        check_policy(
            self.name, max_slowdown=self.max_slowdown, switch_latency_s=self.switch_latency_s
        )
        if self.name == "deadline" and (
            self.deadline_s is None or not math.isfinite(self.deadline_s)
        ):
            raise PlanError(
                "the deadline policy needs --deadline-s (the straggler's iteration time)"
            )

    @property
    def guarded(self) -> bool:
        """Whether the slowdown guard runs (``fastest`` and ``deadline``)."""
        return self.name in ("fastest", "deadline")


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """The outcome of :func:`choose`.

    Attributes:
        frontier: The frontier the point comes from.
        policy: The policy that chose it.
        point: The chosen frontier point.
        options: The per-instruction options to apply, in DAG node order: the guarded ones for
            ``fastest`` and ``deadline``, the point's own for ``min-energy``.
        realized: ``options`` replayed on the measured profile with the policy's switch latency.
        objection: Why the plan must not be applied (more energy than all maximum clocks at the
            same iteration time, or past the allowed slowdown), or ``None``.
    """

    frontier: Frontier
    policy: Policy
    point: FrontierPoint
    options: tuple[Option, ...]
    realized: Baseline
    objection: str | None

    @property
    def guarded(self) -> bool:
        """Whether the slowdown guard produced :attr:`options`."""
        return self.policy.guarded

    @property
    def instructions_sped_up(self) -> int:
        """Instructions the guard runs faster than the point planned them.

        The guard re-solves on real durations (:mod:`powerlib.planning.perseus.guard`), so it
        also runs some instructions slower than the quantized point; those are not counted.
        """
        planned = self.frontier.planned_options(self.point)
        return sum(1 for a, b in zip(planned, self.options) if b.time_s < a.time_s)

    def plan(self, *, metadata: Mapping[str, object] | None = None) -> FrequencyPlan:
        """The plan a session applies (schema ``powerlib.plan.v1``).

        Args:
            metadata: Extra workload fields (deadline, profile source, order source, Kareus
                study).
        """
        return self.frontier.plan(
            self.point,
            policy=self.policy.name,
            chosen=self.options,
            metadata=None if metadata is None else dict(metadata),
        )


def choose(frontier: Frontier, policy: Policy) -> Choice:
    """Pick ``policy``'s point of ``frontier``, guard it, and judge whether it pays.

    Raises:
        PlanError: A deadline below T_min.
    """
    point = frontier.select(policy.name, policy.deadline_s, argmin=policy.argmin)
    if policy.guarded:
        options = frontier.within_slowdown(
            point,
            policy.max_slowdown,
            switch_latency_s=policy.switch_latency_s,
            limit_s=policy.deadline_s if policy.name == "deadline" else None,
            time_cv=policy.time_cv,
            time_se=policy.time_se,
            noise=policy.noise,
            latency_samples_s=policy.latency_samples_s,
            request_ahead_s=policy.request_ahead_s,
        )
    else:
        options = frontier.planned_options(point)
    realized = frontier.realized(
        options, policy.switch_latency_s, request_ahead_s=policy.request_ahead_s
    )
    return Choice(
        frontier=frontier,
        policy=policy,
        point=point,
        options=tuple(options),
        realized=realized,
        objection=_judge(frontier, policy, realized),
    )


def objection(frontier: Frontier, policy: Policy, options: Sequence[Option]) -> str | None:
    """Why per-instruction ``options`` must not be applied under ``policy``, or ``None``.

    They are replayed on the measured profile with the policy's switch latency
    (:meth:`Frontier.realized <powerlib.planning.perseus.frontier.Frontier.realized>`) and
    refused when they would spend more energy per iteration than all maximum clocks, iterations
    compared as the job runs them (an all-max iteration lasts T_min, both held to a
    ``deadline``'s T′), or, for ``fastest`` and ``deadline``, take longer than the allowed slowdown
    over all-max (``fastest``) or the deadline (``deadline``).

    Returns:
        One line with the predicted and the allowed figures, or ``None``.
    """
    return _judge(frontier, policy, frontier.realized(options, policy.switch_latency_s))


def _judge(frontier: Frontier, policy: Policy, realized: Baseline) -> str | None:
    name = policy.name
    # per iteration as the job runs them (the plan's one predicted figure, docs/measurement.md
    # §9): an all-max iteration lasts T_min; under ``deadline`` a straggler holds both to T'
    hold_s = policy.deadline_s if name == "deadline" and policy.deadline_s is not None else 0.0
    base = frontier.baseline(max(frontier.baseline_time_s, hold_s))
    time_s = max(realized.time_s, hold_s)
    blocking_w = frontier.settings.p_block_w * frontier.dag.num_stages
    energy_j = realized.energy_j + blocking_w * (time_s - realized.time_s)
    if energy_j > base.energy_j * (1.0 + 1e-9):
        return (
            f"the {name} plan would spend {energy_j:.6g} J per iteration, "
            f"{100.0 * (energy_j / base.energy_j - 1.0):.2f} % more than all maximum "
            f"clocks ({base.energy_j:.6g} J per iteration as the job runs them; replayed on the "
            "profile)"
        )
    if policy.guarded:
        reference_s = frontier.baseline_time_s if name == "fastest" else policy.deadline_s
        assert reference_s is not None
        allowed_s = reference_s * (1.0 + policy.max_slowdown)
        if realized.time_s > allowed_s * (1.0 + 1e-12):
            what = "all maximum clocks" if name == "fastest" else "the deadline"
            return (
                f"the {name} plan would take {realized.time_s:.6g} s per iteration, past the "
                f"allowed {allowed_s:.6g} s ({what}, {reference_s:.6g} s, + max_slowdown "
                f"{100.0 * policy.max_slowdown:g} %; replayed on the profile)"
            )
    return None
