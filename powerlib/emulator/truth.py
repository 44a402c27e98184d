"""A plan's truth on the emulator: applied by the session's own apply phase, paired with all-max.

:func:`run_plan` runs a plan through :class:`~powerlib.runtime.apply_phase.ApplyPhase` on the
emulated GPUs (what a session applies once its check is over); :func:`paired_truth` compares it
with all-max on the same noise draws, interleaved so the GPUs' drift weighs on both alike, with
standard errors: the demo's truth and every oracle (issue 45: honest oracles).
:func:`simulate_plan` (``powerlib simulate``) does the same for a saved plan, after a warm-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from importlib import resources
from typing import Any, Literal, cast

from powerlib.control import ControlSession
from powerlib.emulator.demo_result import DemoTruth, SimulateResult
from powerlib.emulator.engine import NVML_LIKE_MODEL, Emulator, IterationResult, NvmlLikeModel
from powerlib.errors import InvalidArgumentError, PlanError
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.runtime.apply_phase import ApplyPhase, plan_lead_s
from powerlib.runtime.controller import FrequencyController

__all__ = [
    "DEFAULT_P_BLOCK_W",
    "default_profile",
    "paired_truth",
    "run_plan",
    "simulate_plan",
]

DEFAULT_P_BLOCK_W = 83.64  # A100 blocking power of the Perseus artifact (docs/perseus.md §1.4)
WARM_UP_TIME_CONSTANTS = 5.0  # simulate_plan's warm-up: drift time constants (exp(-5) < 1 %)
LeadS = float | Sequence[float | None] | None  # run_plan's lead: every stage's, per stage, none


def default_profile() -> Profile:
    """The shipped GPT-3 175B A100-SXM stage profile (8 stages, 38 clocks)."""
    ref = resources.files("powerlib.emulator").joinpath("data/gpt3-175b_a100_sxm.csv")
    return Profile.from_csv_text(ref.read_text(encoding="utf-8"), source="gpt3-175b_a100_sxm.csv")


def paired_truth(
    emulator: Emulator,
    plan: FrequencyPlan,
    iterations: int,
    *,
    block: int = 25,
    lead_s: LeadS | Literal["plan"] = "plan",
) -> DemoTruth:
    """``plan`` against all-max on ``emulator``, paired over noise draws ``1..iterations``.

    The plan runs through the session's own apply phase (:func:`run_plan`: what a session
    applies once its check is over), all-max unlocked, each draw once each. The draws run in
    blocks of ``block`` whose order follows the Thue-Morse sequence (AB BA BA AB BA AB AB BA),
    so that the GPUs' thermal drift weighs on both alike: alternation cancels a linear drift,
    Thue-Morse over ``2**k`` blocks any polynomial of degree ``k - 1`` (Allouche & Shallit,
    "The ubiquitous Prouhet-Thue-Morse sequence", 1999). Each plan block starts with one
    unmeasured iteration that lands its first clocks, each all-max block with the longest clock
    latency of idle time, for the unlock to land; ``lead_s`` is :func:`run_plan`'s.
    """
    base: list[IterationResult] = []
    runs: list[IterationResult] = []
    for j, first in enumerate(range(1, iterations + 1, block)):
        count = min(block, iterations + 1 - first)
        plan_first = bin(j).count("1") % 2 == 1
        if plan_first:
            runs += run_plan(emulator, plan, count, first_key=first, lead_s=lead_s)
        # the unlock lands a clock latency after it is asked: all-max starts once it has
        settle_s = max(d.switch_latency_s * (1.0 + d.latency_spread) for d in emulator.devices)
        emulator.clock.advance_to(emulator.clock.now_s + settle_s)
        base += [emulator.run_iteration(noise_key=k) for k in range(first, first + count)]
        if not plan_first:
            runs += run_plan(emulator, plan, count, first_key=first, lead_s=lead_s)
    return DemoTruth.paired(base, runs)


def simulate_plan(
    plan: str | FrequencyPlan,
    *,
    profile_path: str | None = None,
    p_block_w: float = DEFAULT_P_BLOCK_W,
    model: NvmlLikeModel = NVML_LIKE_MODEL,
    switch_latency_s: float | None = None,
    straggler_time_s: float | None = None,
    iterations: int = 200,
    seed: int = 0,
    lead_s: float | None | Literal["plan"] = "plan",
) -> dict[str, Any]:
    """Replay a saved plan on the emulator and compare it with all maximum clocks, paired.

    The plan is applied by the session's own apply phase
    (:class:`~powerlib.runtime.apply_phase.ApplyPhase`, one per stage, over inline frequency
    controllers on the emulated GPUs): each clock is requested when the previous instruction
    ends and lands after the switch latency. The emulator runs the plan's own order, so the
    first iteration's order check is skipped (it could not fail) and prefetching starts at once.
    The GPUs first warm up at all-max, unmeasured, for :data:`WARM_UP_TIME_CONSTANTS` drift
    time constants (a job's plan runs warm, after profiling); then :func:`paired_truth`, the
    demo's truth, compares the plan with all-max on the same noise draws, interleaved, with
    standard errors. (v2 ran all-max cold, then the plan: the warming read as its cost.)

    Args:
        plan: The plan file, or a plan already read (its ``source`` names it in the result).
        profile_path: Ground-truth profile of the emulated GPUs; ``None``: the shipped one.
        p_block_w: Power of a waiting emulated GPU.
        model: What the emulated GPUs do (default NVML-like; :data:`IDEAL_MODEL` to check a
            plan against the planner's own replay).
        switch_latency_s: Overrides the model's mean clock-change latency.
        straggler_time_s: A straggler holds every iteration to this time.
        iterations: Pairs: noise draws replayed by the plan and by all-max (at least 2).
        seed: Noise seed.
        lead_s: Request a switch to a faster clock this much ahead, as a session does
            (:func:`run_plan`); default: the lead the plan was made for; ``None``: at the
            previous instruction's end.

    Returns:
        The ``powerlib.simulate.v3`` record (:class:`~powerlib.emulator.demo_result.SimulateResult`).

    Raises:
        InvalidArgumentError: Fewer than 2 iterations (a standard error needs two pairs).
        PlanError: A malformed plan, or one that does not fit the profile: another number of
            stages (the message names both), a workload its own instructions contradict, kinds
            or clocks the profile lacks. Nothing is run then.
    """
    if iterations < 2:
        raise InvalidArgumentError("iterations must be >= 2 (a standard error needs two pairs)")
    if not isinstance(plan, FrequencyPlan):
        plan = FrequencyPlan.read(plan)
    profile = default_profile() if profile_path is None else Profile.read(profile_path)
    if switch_latency_s is not None:
        model = dataclasses.replace(model, switch_latency_s=switch_latency_s)
    emulator = _replay_emulator(plan, profile, model, p_block_w, straggler_time_s, seed)
    if lead_s == "plan":
        lead_s = plan_lead_s(plan)
    warm_up_iterations = 0  # all-max, unmeasured, until the drift settles (at most 2 x pairs)
    while model.drift > 0.0 and warm_up_iterations < 2 * iterations:
        if emulator.clock.now_s >= WARM_UP_TIME_CONSTANTS * model.drift_tau_s:
            break
        emulator.run_iteration()
        warm_up_iterations += 1
    return SimulateResult(
        plan=plan.source,
        profile=profile.source,
        model=model,
        warm_up_iterations=warm_up_iterations,
        request_ahead_s=lead_s,
        truth=paired_truth(emulator, plan, iterations, lead_s=lead_s),
        planned={k: plan.summary.get(k) for k in ("policy", "time_s", "energy_j", "saving")},
    ).to_json()


def _replay_emulator(
    plan: FrequencyPlan,
    profile: Profile,
    model: NvmlLikeModel,
    p_block_w: float,
    straggler_time_s: float | None,
    seed: int,
) -> Emulator:
    """The emulated pipeline that runs ``plan``'s own order; refuses a plan that does not fit."""
    plan_path = plan.source
    plan.check_workload(num_stages=profile.num_stages, against=f"the profile {profile.source}")
    # The plan lists every stage's instructions in execution order: that is the schedule.
    schedule = [[p.instruction for p in plan.stage(s)] for s in range(plan.num_stages)]
    try:
        emulator = Emulator(
            profile,
            schedule,
            placement=str(plan.workload.get("placement", "looped")),
            p_block_w=p_block_w,
            model=model,
            straggler_time_s=straggler_time_s,
            seed=seed,
        )
    except PlanError as err:  # the plan's order is no pipeline, or it needs what the profile lacks
        if str(err).startswith((f"{profile.source}:", f"{plan_path}:")):
            raise
        raise PlanError(f"{plan_path}: {err}") from err
    for s in range(plan.num_stages):
        plan.check_frequencies(emulator.devices[s].info.supported_sm_freqs_mhz, s)
    return emulator


def run_plan(
    emulator: Emulator,
    plan: FrequencyPlan,
    iterations: int,
    *,
    first_key: int = 1,
    lead_s: LeadS | Literal["plan"] = "plan",
) -> list[IterationResult]:
    """Run ``plan`` on ``emulator`` for ``iterations`` noise draws from ``first_key`` on.

    The session's own apply phase, one per stage, over inline frequency controllers on the
    emulated GPUs. The emulator runs the plan's own order, so there is no order to check: every
    clock is prefetched from the first instruction on; with ``lead_s`` (one for every stage, or
    one per stage; default: the lead the plan was made for, ``plan_lead_s``) a switch to a
    faster clock is requested that much ahead, as a session does (``ApplyPhase(lead_s=...)``).
    One unmeasured iteration first lets the first clocks land; a request still delayed at the
    end is dropped and the GPUs are unlocked.
    """
    leads: list[float | None]
    if isinstance(lead_s, str):  # "plan"
        leads = [plan_lead_s(plan)] * emulator.num_stages
    elif isinstance(lead_s, Sequence):
        leads = list(cast(Sequence[float | None], lead_s))
    else:
        leads = [lead_s] * emulator.num_stages
    with ControlSession(emulator.backend) as control:
        phases = [
            ApplyPhase(
                plan,
                s,
                FrequencyController(control, device, threaded=False, clock=emulator.clock),
                check_order=False,
                lead_s=leads[s],
            )
            for s, device in enumerate(emulator.devices)
        ]
        emulator.run_iteration(phases)  # the first clocks land
        keys = range(first_key, first_key + iterations)
        runs = [emulator.run_iteration(phases, noise_key=k) for k in keys]
        for phase in phases:  # a wrap-around request must not land in the next all-max block
            phase.controller.close()
    emulator.unlock_all()
    return runs
