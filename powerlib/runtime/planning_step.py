"""What rank 0 does between the gather and the broadcast: profiles in, plan JSON out.

Pure apart from writing the output files: merges the ranks' profiles (time = max, energy = mean
per stage), picks P_block, computes the Perseus frontier, selects the plan by policy (with the
zero-slowdown guard for ``fastest``), and writes ``profile.csv``, ``frontier.csv``, ``plan.json``
and ``summary.json`` to the output directory.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.errors import BackendUnavailableError, PlanError
from powerlib.planning.perseus.frontier import POLICIES, compute_frontier
from powerlib.planning.perseus.report import plot_frontier, summary, write_frontier_csv
from powerlib.planning.pipeline import (
    PLACEMENTS,
    Instruction,
    Schedule,
    build_dag,
    build_schedule,
)
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile, ProfileRow
from powerlib.profiling.sweep import aggregate_stage_rows

__all__ = [
    "PlanSpec",
    "auto_unit_time_s",
    "make_plan",
    "merge_profiles",
    "rows_from_payload",
    "rows_to_payload",
    "write_profile",
]

logger = logging.getLogger(__name__)

RECORDED = "recorded"
"""The schedule name that means: plan on the order the hooks recorded, there is no other."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSpec:
    """The workload and the planning choices (the same on every rank).

    Attributes:
        num_stages: Pipeline stages.
        num_microbatches: Microbatches per iteration.
        schedule: ``1f1b``, ``gpipe`` or ``interleaved``; or ``recorded``: no built-in order,
            only the one the hooks recorded while profiling (zero-bubble and V schedules).
        num_chunks: Model chunks per stage (interleaved, V schedules).
        placement: ``looped`` (chunk ``c`` of stage ``s`` is model piece ``c*N + s``) or ``v``
            (two chunks: pieces ``s`` and ``2N-1-s``).
        policy: ``fastest``, ``deadline`` or ``min-energy``.
        deadline_s: T′ for ``deadline``.
        deadline_ratio: T′ as a multiple of the all-max iteration time (a straggler factor), for
            ``deadline`` when ``deadline_s`` is not given.
        argmin: The paper's emulation rule for ``deadline`` (see ``Frontier.select``).
        max_slowdown: Realized-slowdown guard for ``fastest`` (against all-max) and
            ``deadline`` (against T′), as a fraction.
        switch_latency_s: Clock-change latency the guard assumes (Kareus: "several ms").
        p_block_w: Blocking power; ``None`` uses the power measured between instructions.
        unit_time_s: Planner time unit τ; ``None`` picks one from the profile.
        out_dir: Where rank 0 writes its files; ``None`` writes nothing.
        progress: Print progress to stderr.
        plot: Also draw ``frontier.png`` in ``out_dir`` (needs the ``plot`` extra).
    """

    num_stages: int
    num_microbatches: int
    schedule: str = "1f1b"
    num_chunks: int = 1
    placement: str = "looped"
    policy: str = "fastest"
    deadline_s: float | None = None
    deadline_ratio: float | None = None
    argmin: bool = False
    max_slowdown: float = 0.001
    switch_latency_s: float = 0.005
    p_block_w: float | None = None
    unit_time_s: float | None = None
    out_dir: Path | None = None
    progress: bool = True
    plot: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise PlanError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.policy == "deadline" and self.deadline_s is None and self.deadline_ratio is None:
            raise PlanError("the deadline policy needs deadline_s or deadline_ratio")
        if self.deadline_ratio is not None and not (
            math.isfinite(self.deadline_ratio) and self.deadline_ratio >= 1.0
        ):
            raise PlanError(f"deadline_ratio must be >= 1, got {self.deadline_ratio}")
        if not (math.isfinite(self.max_slowdown) and self.max_slowdown >= 0):
            raise PlanError(f"max_slowdown must be >= 0, got {self.max_slowdown}")
        if not (math.isfinite(self.switch_latency_s) and self.switch_latency_s >= 0):
            raise PlanError(f"switch_latency_s must be >= 0, got {self.switch_latency_s}")
        if self.placement not in PLACEMENTS:
            raise PlanError(
                f"unknown placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}"
            )
        if self.placement == "v" and self.num_chunks != 2:
            raise PlanError(f"the v placement needs num_chunks=2, got {self.num_chunks}")
        if self.schedule != RECORDED:
            build_schedule(self.schedule, self.num_stages, self.num_microbatches, self.num_chunks)


def rows_to_payload(rows: list[ProfileRow]) -> list[list[Any]]:
    """Compact, picklable rows for the gather."""
    return [[r.stage, r.instruction, r.freq_mhz, r.time_s, r.energy_j] for r in rows]


def rows_from_payload(data: list[list[Any]]) -> list[ProfileRow]:
    """Inverse of :func:`rows_to_payload`."""
    return [
        ProfileRow(
            stage=int(s), instruction=str(k), freq_mhz=float(f), time_s=float(t), energy_j=float(e)
        )
        for s, k, f, t, e in data
    ]


def auto_unit_time_s(profile: Profile) -> float:
    """τ: a power of ten at most 1/20 of the shortest instruction.

    That is 1 ms for 50 ms instructions, as the Perseus artifact used on A100; 0.1 ms for 5 ms.
    """
    shortest = min(r.time_s for r in profile.rows)
    return 10.0 ** math.floor(math.log10(shortest / 20.0))


def _say(spec: PlanSpec, message: str) -> None:
    if spec.progress:
        print(f"powerlib: {message}", file=sys.stderr, flush=True)


GATHERED = "the gathered profile"


def merge_profiles(payloads: list[dict[str, Any]]) -> tuple[list[ProfileRow], float | None]:
    """Every rank's rows merged per stage, and P_block measured between instructions.

    P_block is time-weighted over all ranks' gaps; ``None`` when no rank has usable gaps (a
    counter that never moved in them tells nothing).
    """
    rows = aggregate_stage_rows(rows_from_payload(p["rows"]) for p in payloads)
    gap_s = sum(p.get("gap_time_s", 0.0) for p in payloads)
    gap_j = sum(p.get("gap_energy_j", 0.0) for p in payloads)
    return rows, (gap_j / gap_s if gap_s > 0 and gap_j > 0 else None)


def write_profile(spec: PlanSpec, payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0 in ``profile`` mode: merge the profiles and write ``profile.csv``; no plan."""
    rows, p_block_w = merge_profiles(payloads)
    if spec.out_dir is not None and rows:
        spec.out_dir.mkdir(parents=True, exist_ok=True)
        Profile(rows, source=GATHERED).write_csv(spec.out_dir / "profile.csv")
        _say(spec, f"profile written to {spec.out_dir / 'profile.csv'}")
    return {"profile_only": True, "p_block_w": p_block_w}


def _schedule_for(spec: PlanSpec, payloads: list[dict[str, Any]]) -> tuple[Schedule, str]:
    """The order the ranks recorded while profiling, else the named schedule's.

    Every rank sends the order its hooks saw in the last profiled iteration; the ranks of a
    stage must agree. The recorded order is used when it forms a complete, deadlock-free
    pipeline the planner models; otherwise the generated order of ``spec.schedule`` is
    (``recorded`` has none: then the recorded order must do).
    """
    generated: Schedule | None = None
    if spec.schedule != RECORDED:
        generated = build_schedule(
            spec.schedule, spec.num_stages, spec.num_microbatches, spec.num_chunks
        )

    def fallback(why: str) -> tuple[Schedule, str]:
        if generated is None:
            raise PlanError(f"schedule 'recorded' but {why}; there is no built-in order to use")
        return generated, "generated"

    if not payloads or not all(p.get("order") for p in payloads):
        return fallback("no instruction order was recorded")
    by_stage: dict[int, list[tuple[int, int, str]]] = {}
    for p in payloads:
        order = [(int(c), int(m), str(k)) for c, m, k in p["order"]]
        first = by_stage.setdefault(int(p["stage"]), order)
        if first != order:
            raise PlanError(
                f"the ranks of stage {p['stage']} ran different instruction orders while profiling"
            )
    if sorted(by_stage) != list(range(spec.num_stages)):
        return fallback(f"the recorded orders cover stages {sorted(by_stage)}")
    recorded = [
        [Instruction(stage=s, microbatch=m, kind=k, chunk=c) for c, m, k in by_stage[s]]
        for s in range(spec.num_stages)
    ]
    try:
        build_dag(recorded, spec.placement)
    except PlanError as err:
        if generated is None:
            raise PlanError(
                f"the recorded order is not a pipeline the planner models: {err}"
            ) from None
        _say(
            spec,
            f"the recorded order is not a pipeline the planner models ({err}); "
            f"planning on the {spec.schedule} order",
        )
        return generated, "generated"
    if generated is not None and recorded != generated:
        _say(spec, f"the recorded instruction order differs from {spec.schedule}'s; planning on it")
    return recorded, "recorded"


def make_plan(spec: PlanSpec, payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: merge the profiles, plan, write the files, and return the plan JSON.

    Each payload: ``{"stage": s, "rows": [...], "gap_time_s": ..., "gap_energy_j": ...}`` (time
    and energy between instructions, for P_block); or, for a saved
    profile, ``{"profile_path": ...}`` on rank 0; or, for a saved plan, ``{"plan_path": ...}``.

    Raises:
        PlanError: Incomplete or malformed profiles, or a plan the policy cannot meet.
    """
    first = payloads[0]
    if "plan_path" in first:
        plan = FrequencyPlan.read(first["plan_path"])
        if plan.num_stages != spec.num_stages:
            raise PlanError(
                f"{first['plan_path']}: the plan has {plan.num_stages} stage(s), the job {spec.num_stages}"
            )
        return plan.to_json()
    if "profile_path" in first:
        profile = Profile.read(first["profile_path"])
        measured_p_block: list[float] = []
    else:
        rows, measured = merge_profiles(payloads)
        if not rows:
            raise PlanError("no rank measured any instruction: was the session's step() called?")
        still = [r for r in rows if r.energy_j <= 0]
        if still:
            first = still[0]
            raise PlanError(
                f"the energy counter did not move during {len(still)} of {len(rows)} profiled "
                f"(stage, kind, clock) cases, e.g. stage {first.stage} {first.instruction} at "
                f"{first.freq_mhz:g} MHz ({first.time_s * 1e3:.3g} ms): the device publishes "
                "energy more coarsely than the instructions last; raise iterations_per_freq, "
                "or profile larger microbatches"
            )
        profile = Profile(rows, source=GATHERED)
        measured_p_block = [] if measured is None else [measured]
    profile.validate_for(spec.num_stages, ())  # kinds: checked against the order
    if spec.p_block_w is not None:
        p_block_w = spec.p_block_w
    elif measured_p_block:
        p_block_w = sum(measured_p_block) / len(measured_p_block)
    elif idle := [p["idle_power_w"] for p in payloads if p.get("idle_power_w")]:
        p_block_w = sum(idle) / len(idle)
        _say(
            spec,
            f"no usable gaps between instructions for P_block; using the devices' power before "
            f"the session, {p_block_w:.1f} W (pass p_block_w to set it)",
        )
    else:
        raise PlanError(
            "P_block is unknown: no rank measured time between instructions; pass p_block_w"
        )
    unit_time_s = spec.unit_time_s or auto_unit_time_s(profile)
    schedule, order_source = _schedule_for(spec, payloads)
    num_microbatches = 1 + max(ins.microbatch for order in schedule for ins in order)
    num_chunks = 1 + max(ins.chunk for order in schedule for ins in order)
    _say(
        spec,
        f"planning {spec.num_stages} stages x {num_microbatches} microbatches "
        f"({spec.schedule}, {order_source} order), P_block {p_block_w:.2f} W, "
        f"tau {unit_time_s * 1e3:g} ms",
    )
    started = time.perf_counter()
    frontier = compute_frontier(
        profile,
        schedule,
        schedule_name=spec.schedule,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        placement=spec.placement,
        p_block_w=p_block_w,
        unit_time_s=unit_time_s,
    )
    solve_s = time.perf_counter() - started
    deadline_s = spec.deadline_s
    if spec.policy == "deadline" and deadline_s is None:
        assert spec.deadline_ratio is not None
        deadline_s = spec.deadline_ratio * frontier.baseline_time_s
    if spec.policy == "deadline":
        assert deadline_s is not None
        deadline_s = max(deadline_s, frontier.fastest.time_s)
    chosen = frontier.select(spec.policy, deadline_s, argmin=spec.argmin)
    guarded = None
    if spec.policy in ("fastest", "deadline"):
        guarded = frontier.within_slowdown(
            chosen,
            spec.max_slowdown,
            switch_latency_s=spec.switch_latency_s,
            limit_s=deadline_s if spec.policy == "deadline" else None,
        )
    info = summary(
        frontier,
        chosen,
        policy=spec.policy,
        solve_time_s=solve_s,
        guarded=guarded,
        max_slowdown=spec.max_slowdown if guarded is not None else None,
        switch_latency_s=spec.switch_latency_s,
    )
    plan = frontier.plan_json(
        chosen,
        policy=spec.policy,
        chosen=guarded,
        metadata={
            "deadline_s": deadline_s,
            "profile_source": profile.source,
            "order_source": order_source,
        },
    )
    _say(
        spec,
        f"frontier of {len(frontier.points)} points in {solve_s:.1f} s; {spec.policy} plan saves "
        f"{info['realized']['saving_percent'] or 0.0:.2f} % at "
        f"{info['realized']['slowdown_percent']:+.3f} % "
        "(replayed on the profile)",
    )
    if spec.out_dir is not None:
        out = Path(spec.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        profile.write_csv(out / "profile.csv")
        write_frontier_csv(frontier, out / "frontier.csv")
        (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
        (out / "summary.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        _say(spec, f"profile, frontier, plan and summary written to {out}/")
        if spec.plot:
            try:
                plot_frontier(frontier, chosen, out / "frontier.png")
            except BackendUnavailableError as err:
                _say(spec, f"no frontier.png: {err}")
    plan["planner_summary"] = info
    return plan
