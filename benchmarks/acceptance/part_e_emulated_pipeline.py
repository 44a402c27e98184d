"""E. An 8-stage pipeline emulated from D's curves: predicted against realized.

:mod:`powerlib.emulator` (virtual time) with A's counter period and read cost, C's latency and
D's noise: the plan the runtime makes from the reference profile and from the runtime's profile,
predicted against realized saving and slowdown (the reference curves are the emulated GPUs'
truth). Hands on ``rig.emulated`` (F applies one stage of a plan on the GPU).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Library names: mend here when one moves (and the outcome read in _make_plan).
from powerlib import PlanError
from powerlib.emulator.demo import run_plan
from powerlib.emulator.engine import Emulator, NvmlLikeModel
from powerlib.emulator.noise_model import IID
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.planning.profile_rows import ProfileRow
from powerlib.runtime import SessionConfig, make_plan
from powerlib.runtime.records import NoPlan, SavedProfile

from .harness import STAGES, Rig, Skipped, rounded

KEY = "E"
TITLE = "8-stage pipeline emulated from D's curves"
Rows = dict[tuple[str, float], tuple[float, float]]  # (kind, MHz) -> (seconds, joules)


def _make_plan(
    rig: Rig, profile_path: Path, latency_s: float, p_block_w: float
) -> tuple[Any, Any, str | None]:
    """The runtime's plan from one profile: (plan or None, prediction or None, why no plan)."""
    config = SessionConfig.from_keywords(
        num_stages=STAGES,
        num_microbatches=rig.scale.pipeline_microbatches,
        switch_latency_s=latency_s,
        p_block_w=p_block_w,
        out_dir=None,
        progress=False,
    )
    # rank 0 planning from a saved profile (PlanError: refused)
    outcome = make_plan(config, [SavedProfile(stage=0, path=profile_path)])
    if isinstance(outcome, NoPlan):
        return None, outcome.prediction, outcome.reason
    return outcome.plan, outcome.prediction, None


def _profile8(rows: Rows) -> Profile:
    """One stage's curves as every stage of the emulated pipeline."""
    return Profile(
        [
            ProfileRow(stage=stage, instruction=kind, freq_mhz=freq, time_s=t, energy_j=e)
            for stage in range(STAGES)
            for (kind, freq), (t, e) in rows.items()
        ],
        source="gpu_acceptance D",
    )


def _releases(emulator: Any, result: Any, stage: int) -> list[tuple[str, int, float]]:
    """Each instruction of ``stage`` and when its inputs from other stages arrived (from start)."""
    dag = emulator.dag
    ends = {ex.instruction: ex.end_s - result.start_s for ex in result.executed}
    preds: dict[int, list[int]] = {}
    for u, v in dag.edges:
        if dag.instructions[u].stage != dag.instructions[v].stage:
            preds.setdefault(v, []).append(u)
    out = []
    for v in dag.stage_order(stage):
        ins = dag.instructions[v]
        ready = max((ends[dag.instructions[u]] for u in preds.get(v, ())), default=0.0)
        out.append((ins.kind, ins.microbatch, ready))
    return out


def emulate_plan(
    plan: Any, truth: Any, model: Any, p_block_w: float, iterations: int
) -> dict[str, Any]:
    """Replay ``plan`` on emulated GPUs whose truth is ``truth`` (as ``powerlib simulate``).

    The session's own apply phase over inline frequency controllers, paired with all-max
    iterations on the same noise draws (:func:`powerlib.emulator.demo.simulate_plan`), plus
    what F needs: each stage's energy and its instructions' release times.
    """
    schedule = [[p.instruction for p in plan.stage(s)] for s in range(plan.num_stages)]
    emulator = Emulator(truth, schedule, p_block_w=p_block_w, model=model, seed=0)

    def per_stage(runs: Sequence[Any]) -> list[float]:
        return [
            statistics.fmean(
                dev.energy_at(r.start_s + r.time_s) - dev.energy_at(r.start_s) for r in runs
            )
            for dev in emulator.devices
        ]

    base = [emulator.run_iteration(noise_key=k) for k in range(1, iterations + 1)]
    base_stage_j = per_stage(base)
    runs = run_plan(emulator, plan, iterations)
    plan_stage_j = per_stage(runs)
    base_t = statistics.fmean(r.time_s for r in base)
    plan_t = statistics.fmean(r.time_s for r in runs)
    base_e = statistics.fmean(r.energy_j for r in base)
    plan_e = statistics.fmean(r.energy_j for r in runs)
    return {
        "saving_percent": 100 * (1 - plan_e / base_e),
        "slowdown_percent": 100 * (plan_t / base_t - 1),
        "iteration_s": {"all_max": base_t, "plan": plan_t},
        "stages": [
            {
                "stage": s,
                "all_max_j": b,
                "plan_j": p,
                "saving_percent": 100 * (1 - p / b),
                "releases_plan": _releases(emulator, runs[0], s),
                "releases_all_max": _releases(emulator, base[0], s),
                "iteration_s_plan": runs[0].time_s,
                "iteration_s_all_max": base[0].time_s,
            }
            for s, (b, p) in enumerate(zip(base_stage_j, plan_stage_j))
        ],
    }


def _latency_s(rig: Rig) -> float:
    """C's mean landing through the controller (20 ms when it measured none)."""
    latency_s: float = rig.latency.get("mean_s") or 0.02
    return latency_s


def _model(rig: Rig, curves: dict[str, Any]) -> NvmlLikeModel:
    """The emulated GPUs as measured: A's counter and reads, C's latency, D's noise."""
    latency_s = _latency_s(rig)
    spread = 0.0
    if rig.latency.get("max_s") is not None and latency_s > 0:
        spread = min(1.0, (rig.latency["max_s"] - rig.latency["min_s"]) / (2 * latency_s))
    return NvmlLikeModel(
        counter_period_s=rig.counter_period_s or 0.1,
        duty=1.0,
        read_cost_s=min(rig.read_state_s or 0.003, 0.05),
        switch_latency_s=latency_s,
        latency_spread=spread,
        noise=min(curves["time_cv"], 0.2),
        # the GPU's measured spread, independent per instruction: no structure is known there
        noise_model=IID,
        drift=0.0,
        name=f"measured on {rig.dev.info.name}",
    )


def _plan_and_emulate(
    rig: Rig,
    name: str,
    rows: Rows,
    p_block: float,
    truth: Profile,
    model: NvmlLikeModel,
    record: dict[str, Any],
) -> None:
    """The plan from profile ``name``, emulated against ``truth``: ``record`` and the checks."""
    report, curves = rig.report, rig.curves
    assert curves is not None
    criterion = f"the plan from the {name} profile: |predicted - realized saving| <= 2 points"
    path = rig.tmp / f"{name}_{STAGES}stages.csv"
    _profile8(rows).write_csv(path)
    record["p_block_w"] = rounded(p_block, 2)
    try:
        made, prediction, why = _make_plan(rig, path, _latency_s(rig), p_block)
    except PlanError as err:
        record["refused"] = str(err)
        report.check("E", f"{name}_saving_gap_points", False, str(err), criterion)
        return
    record["predicted"] = None if prediction is None else prediction.to_json()
    if made is None:
        record["refused"] = why
        report.check("E", f"{name}_saving_gap_points", False, why, criterion)
        return
    plan_path = rig.tmp / f"{name}_plan.json"
    made.write(plan_path)
    plan = FrequencyPlan.read(plan_path)
    result = emulate_plan(
        plan, truth, model, curves["p_block_reference_w"], rig.scale.emulated_iterations
    )
    predicted_saving = None if prediction is None else prediction.saving_percent
    predicted_slowdown = None if prediction is None else prediction.slowdown_percent
    record.update(
        predicted_saving_percent=rounded(predicted_saving, 4),
        predicted_slowdown_percent=rounded(predicted_slowdown, 4),
        realized_saving_percent=rounded(result["saving_percent"], 4),
        realized_slowdown_percent=rounded(result["slowdown_percent"], 4),
        iteration_s=result["iteration_s"],
        stages=[
            {k: rounded(v, 4) for k, v in st.items() if not k.startswith(("releases", "iteration"))}
            for st in result["stages"]
        ],
    )
    assert rig.emulated is not None
    rig.emulated[name] = {"plan_path": plan_path, "plan": plan, **result}
    gap = None if predicted_saving is None else abs(predicted_saving - result["saving_percent"])
    report.check("E", f"{name}_saving_gap_points", gap is not None and gap <= 2.0, gap, criterion)
    report.check(
        "E",
        f"{name}_realized_slowdown_percent",
        result["slowdown_percent"] <= 1.0,
        result["slowdown_percent"],
        f"the plan from the {name} profile realizes <= 1 % slower than all-max",
    )


def run(rig: Rig, part: dict[str, Any]) -> None:
    """The 8-stage pipeline emulated from D's curves: predicted against realized."""
    curves, figures = rig.curves, part["figures"]
    if curves is None:
        raise Skipped("part D produced no curves")
    model = _model(rig, curves)
    rig.report.data["emulation"]["E_model"] = model.to_json()
    figures["model"] = model.describe()
    figures["pipeline"] = {
        "stages": STAGES,
        "microbatches": rig.scale.pipeline_microbatches,
        "schedule": "1f1b",
        "truth": "D's reference curves on every stage",
        "policy": "fastest",
    }
    truth = _profile8(curves["reference"])
    rig.emulated = {}
    runtime_p_block = curves["p_block_runtime_w"] or curves["p_block_reference_w"]
    for name, rows, p_block in (
        ("reference", curves["reference"], curves["p_block_reference_w"]),
        ("runtime", curves["runtime"], runtime_p_block),
    ):
        record: dict[str, Any] = {}
        figures[f"{name}_plan"] = record
        if rows is None:
            record["skipped"] = "D's runtime profile was not resolved"
            rig.report.check(
                "E",
                f"{name}_saving_gap_points",
                None,
                record["skipped"],
                f"the plan from the {name} profile: |predicted - realized saving| <= 2 points",
            )
            continue
        _plan_and_emulate(rig, name, rows, p_block, truth, model, record)
