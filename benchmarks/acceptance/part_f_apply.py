"""F. The real apply path: one stage of E's plan applied on the GPU by a real session.

One stage's instructions of E's plan (the runtime profile's, else the reference's) run on the GPU
by a real ``powerlib.optimize(mode="apply")`` session, the pipeline's waits played by sleeps until
each instruction's inputs would arrive (from E's timeline), in alternating blocks against all-max
locked and the unlocked default, for the stage with the most slack (E's largest stage saving) and
for the critical one (the smallest): energy per iteration, saving, stage slowdown, clock changes,
instructions started before their clock landed, beside E's prediction. The blocks shrink to keep
the run inside its budget.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Library names: mend here when one moves (and the session readers below).
import powerlib
from powerlib import Session
from powerlib.runtime import AppliedChange, SessionPhase, SingleProcess

from .harness import STAGES, Rig, Skipped, rounded, sleep_until
from .readings import counter_window, read_lock

KEY = "F"
TITLE = "the real apply path"
VARIANTS = ("plan", "all_max", "default")


# -- what the script reads of an applying session (the runtime's restructure may move it) --------


def _apply_session(rig: Rig, plan_path: Path, stage: int) -> Session:
    """A real session applying ``stage`` of the plan at ``plan_path`` (no closed-loop check)."""
    return powerlib.optimize(
        num_stages=STAGES,
        num_microbatches=rig.scale.pipeline_microbatches,
        mode="apply",
        plan_path=plan_path,
        stage=stage,
        backend=rig.backend,
        device=rig.dev,
        coordinator=SingleProcess(),
        out_dir=None,
        progress=False,
        check_rounds=0,  # the blocks here are the check
        guardian=rig.guardian,
    )


def _applied(session: Session) -> tuple[list[AppliedChange], SessionPhase, Any]:
    """The clock changes the session made (once its controller is idle), its phase, its sampler."""
    assert session.controller is not None
    session.controller.wait_idle()
    return list(session.controller.applied), session.phase, session.sampler


def _applying(phase: SessionPhase) -> bool:
    """Whether the session was in its apply phase."""
    return phase is SessionPhase.APPLY


# -- one block of iterations -----------------------------------------------------------------------


def _landings(
    applied: Sequence[Any], sampler: Any, after_call_s: float
) -> tuple[list[tuple[float, float | None]], str]:
    """When each applied clock change landed, and how that was known.

    Seen in the session's own sampler reads when they show the clock (the first read showing
    the new clock after the previous change landed: late by at most one read interval, so
    "early" instructions are counted generously); else estimated as the controller's write
    plus C's median landing after a write.
    """
    seen = sampler is not None and sampler.reports_clock
    out: list[tuple[float, float | None]] = []
    previous = -math.inf
    for change in applied:
        if not change.ok:
            continue
        landed = None
        if seen and change.freq_mhz is not None:
            found = sampler.first_clock_at(change.freq_mhz, previous)
            landed = None if found is None else found[1]
        if landed is None:
            landed = change.time_s + after_call_s
        out.append((landed, change.freq_mhz))
        previous = landed
    return out, "the session's sampler reads" if seen else "write + C's landing after a write"


def _clock_at(landings: Sequence[tuple[float, float | None]], t: float) -> float | None:
    """The clock in force at ``t``: the change landed last by then (None: unlocked)."""
    landed = [(when, freq) for when, freq in landings if when <= t]
    return max(landed, key=lambda x: x[0])[1] if landed else None


def _block(
    rig: Rig,
    releases: Sequence[tuple[str, int, float]],
    iteration_s: float,
    block_s: float,
    session: Session | None = None,
) -> dict[str, Any]:
    """Iterations of one stage for ``block_s`` (after one unmeasured), energy from the counter."""
    work = rig.work
    begins: list[tuple[float, str, int]] = []

    def one() -> None:
        start = time.perf_counter()
        for kind, microbatch, ready_s in releases:
            sleep_until(start + ready_s)
            begins.append((time.perf_counter(), kind, microbatch))
            if session is None:
                work.run(kind, microbatch)
            else:
                with session.instruction(kind, microbatch):
                    work.run(kind, microbatch)
            work.sync()
        sleep_until(start + iteration_s)  # the rest of the pipeline, then the step
        work.end_iteration()
        if session is not None:
            session.step()

    one()  # the session checks the order here; the clocks warm up
    begins.clear()

    def iterations() -> int:
        n = 0
        t0 = time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < block_s:
            one()
            n += 1
        return n

    window = counter_window(rig, iterations)
    n = window.value
    return {
        "iterations": n,
        "energy_per_iteration_j": window.energy_j / n,
        "time_per_iteration_s": window.time_s / n,
        "begins": begins,
    }


@dataclasses.dataclass(frozen=True, slots=True)
class _Setup:
    """E's plan, and how long F measures it."""

    plan: Any
    plan_path: Path
    rounds: int
    block_s: float
    after_call_s: float  # C: median landing after a write


def _plan_block(
    rig: Rig, setup: _Setup, stage: int, st: dict[str, Any]
) -> tuple[dict[str, Any], bool]:
    """One block under a session applying the plan; whether it applied it."""
    planned = {
        (p.instruction.kind, p.instruction.microbatch): p.freq_mhz for p in setup.plan.stage(stage)
    }
    rig.restore()
    with _apply_session(rig, setup.plan_path, stage) as session:
        block = _block(rig, st["releases_plan"], st["iteration_s_plan"], setup.block_s, session)
        applied, phase, sampler = _applied(session)
        landings, seen_by = _landings(applied, sampler, setup.after_call_s)
    first = block["begins"][0][0] if block["begins"] else math.inf
    in_window = [c for c in applied if c.time_s >= first]
    early = sum(
        1 for t, kind, mb in block["begins"] if _clock_at(landings, t) != planned[(kind, mb)]
    )
    block.update(
        landings_from=seen_by,
        phase=phase,
        clock_changes_per_iteration=len(in_window) / block["iterations"],
        failed_changes=sum(1 for c in applied if not c.ok),
        early_instructions=early,
        instructions=len(block["begins"]),
    )
    return block, _applying(phase) and bool(applied) and not block["failed_changes"]


def _variant_block(
    rig: Rig, setup: _Setup, variant: str, stage: int, st: dict[str, Any]
) -> tuple[dict[str, Any], bool]:
    """One block of ``variant`` (the plan, all-max locked, the unlocked default)."""
    if variant == "plan":
        return _plan_block(rig, setup, stage, st)
    if variant == "all_max":
        rig.ctl().lock_sm_clocks(rig.dev, max(rig.dev.info.supported_sm_freqs_mhz))
        block = _block(rig, st["releases_all_max"], st["iteration_s_all_max"], setup.block_s)
        rig.restore()
    else:
        rig.restore()
        block = _block(rig, st["releases_all_max"], st["iteration_s_all_max"], setup.block_s)
    return block, True


def _budget(rig: Rig, stages: list[dict[str, Any]], n_chosen: int) -> tuple[int, float]:
    """F's rounds and block length: fewer and shorter when the run's budget is short."""
    s = rig.scale
    rounds, block_s = s.rounds, s.block_s
    reserve_s = 30.0 if not rig.smoke else 10.0  # G
    blocks = 3 * rounds * n_chosen
    per_block_s = block_s + 2 * max(st["iteration_s_plan"] for st in stages) + 1.0
    if rig.left_s() - reserve_s < blocks * per_block_s:
        rounds = 1
        blocks = 3 * n_chosen
        block_s = max(0.5, (rig.left_s() - reserve_s) / blocks - per_block_s + block_s)
    return rounds, block_s


# -- one stage -------------------------------------------------------------------------------------


def _summarize(
    record: dict[str, Any],
    results: dict[str, list[dict[str, Any]]],
    st: dict[str, Any],
    emulated: dict[str, Any],
) -> tuple[float, float]:
    """The stage's means into ``record``; its saving against all-max and its slowdown (%)."""
    mean = {
        v: (
            statistics.fmean(b["energy_per_iteration_j"] for b in blocks_),
            statistics.fmean(b["time_per_iteration_s"] for b in blocks_),
        )
        for v, blocks_ in results.items()
    }
    saving = 100 * (1 - mean["plan"][0] / mean["all_max"][0])
    slowdown = 100 * (mean["plan"][1] / mean["all_max"][1] - 1)
    early = sum(b["early_instructions"] for b in results["plan"])
    total = sum(b["instructions"] for b in results["plan"])
    record.update(
        energy_per_iteration_j={v: rounded(m[0], 4) for v, m in mean.items()},
        time_per_iteration_s={v: rounded(m[1]) for v, m in mean.items()},
        saving_vs_all_max_percent=rounded(saving, 3),
        saving_vs_default_percent=rounded(100 * (1 - mean["plan"][0] / mean["default"][0]), 3),
        stage_slowdown_percent=rounded(slowdown, 3),
        clock_changes_per_iteration=rounded(
            statistics.fmean(b["clock_changes_per_iteration"] for b in results["plan"]), 2
        ),
        instructions_started_before_their_clock_landed=f"{early} of {total}",
        landings_from=results["plan"][-1]["landings_from"],
        predicted_saving_percent=rounded(st["saving_percent"], 3),
        predicted_slowdown_percent=rounded(emulated["slowdown_percent"], 3),
    )
    return saving, slowdown


def _stage(
    rig: Rig,
    setup: _Setup,
    emulated: dict[str, Any],
    label: str,
    stage: int,
    record: dict[str, Any],
) -> None:
    """The plan, all-max and the default in alternating blocks on ``stage``; its checks."""
    st = emulated["stages"][stage]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    plan_ok = True
    for _ in range(setup.rounds):
        for variant in VARIANTS:
            block, ok = _variant_block(rig, setup, variant, stage, st)
            plan_ok &= ok
            block.pop("begins")
            results[variant].append(block)
            record["blocks"].append(
                {
                    "variant": variant,
                    **{k: rounded(v) if isinstance(v, float) else v for k, v in block.items()},
                }
            )
            rig.report.save()
    saving, slowdown = _summarize(record, results, st, emulated)
    rig.report.check(
        "F",
        f"{label}_plan_applied",
        plan_ok,
        f"stage {stage}: {record['clock_changes_per_iteration']} changes/iteration",
        "the session applied the plan (apply phase, no failed change)",
        judged_in_smoke=True,
    )
    gap = abs(saving - st["saving_percent"])
    rig.report.check(
        "F",
        f"{label}_saving_gap_points",
        gap <= 3.0,
        f"measured {saving:.2f} % vs predicted {st['saving_percent']:.2f} %",
        f"stage {stage}'s measured saving against all-max within 3 points of E's",
    )
    rig.report.check(
        "F",
        f"{label}_stage_slowdown_percent",
        slowdown <= max(1.0, emulated["slowdown_percent"] + 1.0),
        slowdown,
        "the stage's iteration <= 1 % (or E's prediction + 1 point) slower than all-max",
    )


def run(rig: Rig, part: dict[str, Any]) -> None:
    """The real apply path for two stages of E's plan against all-max and the default."""
    figures = part["figures"]
    if not rig.emulated:
        raise Skipped("part E produced no plan")
    name = "runtime" if "runtime" in rig.emulated else "reference"
    emulated = rig.emulated[name]
    stages = emulated["stages"]
    slack = max(stages, key=lambda st: st["saving_percent"])["stage"]
    critical = min(stages, key=lambda st: st["saving_percent"])["stage"]
    chosen = [("most_slack", slack), ("critical", critical)]
    if slack == critical:
        chosen = chosen[:1]
    figures["plan"] = f"E's plan from the {name} profile"
    rounds, block_s = _budget(rig, stages, len(chosen))
    figures["rounds"], figures["block_s"] = rounds, rounded(block_s, 2)
    after_call_s = rig.latency.get("after_call_s") or 0.0
    setup = _Setup(emulated["plan"], emulated["plan_path"], rounds, block_s, after_call_s)
    rig.ctl()
    for label, stage in chosen:
        record: dict[str, Any] = {"stage": stage, "blocks": []}
        figures[label] = record
        _stage(rig, setup, emulated, label, stage, record)
    after = read_lock(rig.dev)
    figures["lock_after_sessions"] = after.to_json()
    rig.report.check(
        "F",
        "released_after_sessions",
        after.locked is not True,
        str(after.locked),
        "no lock reported once the sessions and blocks have ended",
        judged_in_smoke=True,
    )
