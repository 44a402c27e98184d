"""Issue 44: the closed loop's paired counterfactual, its verdicts, and its bias on the emulator."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from runtime_helpers import toy_profile

from powerlib.planning.perseus.counterfactual import IterationRecord, Replayer
from powerlib.planning.perseus.replay import ReplayModel
from powerlib.planning.pipeline import build_dag
from powerlib.planning.schedules import build_schedule
from powerlib.runtime.closed_loop import CheckConfig, Judge
from powerlib.runtime.estimator import Estimate, interleaved, paired, verdict
from powerlib.runtime.records import MeasureMore, Prediction, Verdict, Windows

STAGES, MICROBATCHES, P_BLOCK_W = 2, 3, 80.0


def _model() -> ReplayModel:
    profile = toy_profile(STAGES)
    measured: dict[tuple[int, str], dict[float, tuple[float, float]]] = {}
    for r in profile.rows:
        measured.setdefault((r.stage, r.instruction), {})[r.freq_mhz] = (r.time_s, r.energy_j)
    dag = build_dag(build_schedule("1f1b", STAGES, MICROBATCHES, 1))
    return ReplayModel(dag=dag, options={}, measured=measured, unit_time_s=1e-3,
                       p_block_w=P_BLOCK_W)  # fmt: skip


def _iteration(
    model: ReplayModel,
    freqs: dict[tuple[int, str], float | None],
    phi: dict[int, float],
    *,
    start_s: float = 0.0,
    overhead_s: float = 0.0,
    energy_scale: float = 1.0,
) -> list[IterationRecord]:
    """An iteration run as the DAG says at ``freqs`` with noise factor ``phi[node]``.

    Each stage's energy is what the model says (busy energy on the factors, P_block between),
    times ``energy_scale``; ``overhead_s`` is host time the DAG does not model (at the end).
    """
    dag = model.dag
    times = []
    for i, ins in enumerate(dag.instructions):
        rows = model.measured[(ins.stage, ins.kind)]
        f = freqs[(ins.stage, ins.kind)]
        times.append(phi[i] * rows[max(rows) if f is None else f][0])
    starts = dag.start_times(times)
    makespan = max(s + t for s, t in zip(starts, times))
    end_s = start_s + makespan + overhead_s
    out = []
    for stage in range(dag.num_stages):
        spans, busy_e, busy_t = [], 0.0, 0.0
        for i in dag.stage_order(stage):
            ins = dag.instructions[i]
            rows = model.measured[(ins.stage, ins.kind)]
            f = freqs[(ins.stage, ins.kind)]
            t, e = rows[max(rows) if f is None else f]
            spans.append((ins.chunk, ins.microbatch, ins.kind, start_s + starts[i],
                          start_s + starts[i] + times[i]))  # fmt: skip
            busy_e += phi[i] * e
            busy_t += times[i]
        energy = busy_e + P_BLOCK_W * (end_s - start_s - busy_t)
        clock = freqs[(stage, "forward")]
        out.append(
            IterationRecord(stage=stage, start_s=start_s, end_s=end_s, spans=tuple(spans),
                            clocks=((start_s - 1.0, clock),), energy_j=energy * energy_scale)
        )  # fmt: skip
    return out


def _slow_plan() -> dict[tuple[int, str], float | None]:
    # stage 0 has slack (lighter): run it slower; stage 1 at the baseline
    return {(0, "forward"): 1200.0, (0, "backward"): 1200.0, (1, "forward"): None,
            (1, "backward"): None}  # fmt: skip


def test_the_counterfactual_replays_the_same_noise_at_the_baseline_clocks() -> None:
    model = _model()
    replayer = Replayer(model)
    n = len(model.dag.instructions)
    phi = {i: 1.0 + 0.03 * math.sin(7 * i) for i in range(n)}
    plan = _iteration(model, _slow_plan(), phi, overhead_s=0.05)
    base = _iteration(model, dict.fromkeys(_slow_plan(), None), phi, overhead_s=0.05)
    cf = replayer.replay(plan)
    assert cf is not None
    # the very iteration at the baseline clocks, on the same factors, with the same overhead
    assert cf.baseline_time_s == pytest.approx(base[0].end_s - base[0].start_s, rel=1e-12)
    assert cf.baseline_energy_j == pytest.approx(sum(r.energy_j for r in base), rel=1e-9)
    assert cf.model_energy_j == pytest.approx(sum(r.energy_j for r in plan), rel=1e-9)
    # a baseline iteration is its own counterfactual
    own = replayer.replay(base)
    assert own is not None and own.baseline_time_s == pytest.approx(own.time_s, rel=1e-12)


def test_a_change_that_lands_mid_instruction_is_split_at_its_landing() -> None:
    model = _model()
    replayer = Replayer(model)
    n = len(model.dag.instructions)
    base = _iteration(model, dict.fromkeys(_slow_plan(), None), dict.fromkeys(range(n), 1.0))
    # stage 0's first instruction ran half its work at 1200 MHz, then the rest at the top clock
    t_slow = model.measured[(0, "forward")][1200.0][0]
    t_top = model.measured[(0, "forward")][1410.0][0]
    first = base[0].spans[0]
    duration = 0.5 * t_slow + 0.5 * t_top
    shift = duration - (first[4] - first[3])
    spans = [(*first[:3], first[3], first[3] + duration)]
    spans += [(c, m, k, a + shift, b + shift) for c, m, k, a, b in base[0].spans[1:]]
    landing = first[3] + 0.5 * t_slow
    record = IterationRecord(stage=0, start_s=base[0].start_s, end_s=base[0].end_s + shift,
                             spans=tuple(spans), clocks=((-1.0, 1200.0), (landing, None)),
                             energy_j=base[0].energy_j)  # fmt: skip
    cf = replayer.replay([record, base[1]])
    assert cf is not None
    # its factor is 1: the counterfactual is the baseline iteration exactly (the first
    # instruction starts every path, so the late landing cost the iteration `shift`)
    assert cf.time_s == pytest.approx(base[0].end_s - base[0].start_s + shift, rel=1e-9)
    assert cf.baseline_time_s == pytest.approx(base[0].end_s - base[0].start_s, rel=1e-9)
    assert replayer.replay([record]) is None  # a stage missing: nothing to replay


def test_paired_estimate_matches_the_truth_and_cancels_shared_noise() -> None:
    """Noise both arms share cancels: the paired slowdown's interval is far narrower than the
    per-iteration noise, and the energy model's bias (10 % here) is calibrated away."""
    model = _model()
    replayer = Replayer(model)
    n = len(model.dag.instructions)
    plans, refs, truth_t, truth_e = [], [], [], []
    rng = random.Random(7)
    for k in range(24):
        common = 1.0 + rng.gauss(0.0, 0.02)  # per-iteration noise, 2 %
        phi = {i: common * (1.0 + rng.gauss(0.0, 0.004)) for i in range(n)}
        plan = _iteration(model, _slow_plan(), phi, start_s=10.0 * k, energy_scale=1.1)
        base = _iteration(model, dict.fromkeys(_slow_plan(), None), phi, start_s=10.0 * k,
                          energy_scale=1.1)  # fmt: skip
        plans.append(plan)
        if k % 4 == 0:
            refs.append(base)
        truth_t.append((plan[0].end_s - plan[0].start_s) / (base[0].end_s - base[0].start_s))
        truth_e.append(sum(r.energy_j for r in plan) / sum(r.energy_j for r in base))
    est = paired(replayer, refs, plans)
    assert est is not None and est.method == "paired" and est.samples == 24
    assert est.slowdown_percent == pytest.approx(100 * (statistics.fmean(truth_t) - 1), abs=1e-6)
    assert est.saving_percent == pytest.approx(100 * (1 - statistics.fmean(truth_e)), abs=1e-6)
    assert est.slowdown_ci_percent < 0.05  # the 2 % per-iteration noise cancelled
    # the interleaved windows see the same figures, with the noise
    rounds = [([refs[r]], plans[4 * r + 1 : 4 * r + 4]) for r in range(len(refs))]
    check = interleaved(rounds)
    assert check is not None and check.samples == len(refs)
    assert check.slowdown_ci_percent > 10 * est.slowdown_ci_percent
    assert est.agrees_with(check)


def _estimate(saving: float, saving_ci: float, slowdown: float, slowdown_ci: float) -> Estimate:
    return Estimate(method="paired", saving_percent=saving, saving_ci_percent=saving_ci,
                    slowdown_percent=slowdown, slowdown_ci_percent=slowdown_ci, samples=24)  # fmt: skip


@pytest.mark.parametrize(
    ("estimate", "expected"),
    [
        (_estimate(10.0, 0.2, 0.05, 0.03), "kept"),
        (_estimate(10.0, 0.2, 0.30, 0.03), "reverted"),  # slower than 0.1 % beyond its interval
        (_estimate(10.0, 0.2, 0.12, 0.05), "kept"),  # maybe slower: not beyond its interval
        (_estimate(-1.0, 0.5, 0.0, 0.03), "reverted"),  # saves nothing
        (_estimate(7.0, 0.5, 0.0, 0.03), "shortfall"),  # 10 predicted, at most 7.5
        (_estimate(-68.9, 204.3, 0.0, 0.03), "inconclusive"),  # the user's +-204 %
        (_estimate(10.0, 0.2, 0.0, 5.5), "inconclusive"),
    ],
)
def test_each_verdict(estimate: Estimate, expected: str) -> None:
    got, reason = verdict(estimate, max_slowdown=0.001, predicted_saving_percent=10.0)
    assert got == expected
    assert (reason is None) == (expected == "kept")


def _windows(stage: int, records: list[tuple[str, int, int, IterationRecord]]) -> Windows:
    return Windows(stage=stage, iterations=tuple(records))


def test_the_judge_measures_more_before_it_calls_a_plan_inconclusive() -> None:
    """Wide intervals: another batch, up to the bound, then one inconclusive verdict."""
    config = CheckConfig(rounds=1, reference_iterations=1, plan_iterations=2, max_rounds=2)
    judge = Judge(config, max_slowdown=0.001, predicted=Prediction(saving_percent=10.0,
                  slowdown_percent=0.0), model=None)  # fmt: skip
    model = _model()
    n = len(model.dag.instructions)

    def batch(r: int, plan_energy: float) -> list[Windows]:
        ref = _iteration(model, dict.fromkeys(_slow_plan(), None), dict.fromkeys(range(n), 1.0))
        plan = _iteration(model, _slow_plan(), dict.fromkeys(range(n), 1.0),
                          energy_scale=plan_energy)  # fmt: skip
        return [
            _windows(
                s,
                [
                    ("ref", r, 3 * r + 1, ref[s]),
                    ("plan", r, 3 * r + 2, plan[s]),
                    ("plan", r, 3 * r + 3, plan[s]),
                ],
            )  # fmt: skip
            for s in range(STAGES)
        ]

    first = judge(batch(0, 0.5))  # one round: its interval is infinite
    assert isinstance(first, MeasureMore) and first.rounds == 1
    second = judge(batch(1, 1.5))  # two rounds disagreeing wildly: still too wide, at the bound
    assert isinstance(second, Verdict)
    assert second.realized.verdict == "inconclusive" and second.realized.rounds == 2
    assert "too noisy" in (second.realized.reason or "")


def test_a_stopped_rank_reverts_the_plan_with_its_reason() -> None:
    judge = Judge(CheckConfig(), max_slowdown=None, predicted=None, model=None)
    out = judge([Windows(stage=0), Windows(stage=1, stopped=True, reason="stage 1: lost")])
    assert isinstance(out, Verdict)
    assert out.realized.verdict == "reverted" and out.realized.reason == "stage 1: lost"


def test_the_paired_estimate_is_unbiased_on_the_emulator() -> None:
    """The sessions' own measurement against the truth: the same plan and the baseline run on
    the same noise draws, paired over 120 iterations (NVML-like: 100 ms counter, 2 % noise,
    20 ms +- 50 % clock latency)."""
    import contextlib

    from runtime_helpers import emulated_sessions, make_emulator

    from powerlib.emulator.demo import run_plan
    from powerlib.emulator.engine import NVML_LIKE_MODEL

    profile = toy_profile(4)
    emulator = make_emulator(profile, 6, model=NVML_LIKE_MODEL, seed=5)
    sessions = emulated_sessions(emulator, None, check_rounds=3, iterations_per_freq=3)
    with contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        for _ in range(200):
            emulator.run_iteration(sessions)
            if sessions[0].realized is not None:
                break
    realized = sessions[0].realized
    assert realized is not None and realized.method == "paired", realized
    plan = sessions[0]._flow.plan
    runs = run_plan(emulator, plan, 120)
    base = [emulator.run_iteration(noise_key=k) for k in range(1, 121)]
    slow = [100 * (a.time_s / b.time_s - 1) for a, b in zip(runs, base)]
    save = [100 * (1 - a.energy_j / b.energy_j) for a, b in zip(runs, base)]
    truth_slow, truth_save = statistics.fmean(slow), statistics.fmean(save)
    se_slow = statistics.stdev(slow) / math.sqrt(len(slow))
    se_save = statistics.stdev(save) / math.sqrt(len(save))
    # issue 44's bars: half-width <= 0.05 pt and within 0.05 pt of the truth; saving within 0.3
    assert realized.slowdown_ci_percent <= 0.05
    assert abs(realized.slowdown_percent - truth_slow) <= 0.05 + 3 * se_slow
    # (the toy's 6 reference iterations calibrate the energy model to +-0.45 %: statistical)
    assert abs(realized.saving_percent - truth_save) <= realized.saving_ci_percent + 3 * se_save
    # the interleaved windows, unpaired, are far wider on the same iterations
    assert realized.check is not None
    assert realized.check.slowdown_ci_percent > 2 * realized.slowdown_ci_percent


def test_a_straggler_holds_the_counterfactual_iteration_too() -> None:
    """Under ``deadline`` the baseline iteration waits for the straggler as the plan's does: the
    held time counts in its time and, at the blocking power, in its energy."""
    model = _model()
    replayer = Replayer(model)
    n = len(model.dag.instructions)
    plan = _iteration(model, _slow_plan(), dict.fromkeys(range(n), 1.0), overhead_s=0.3)
    free = replayer.replay(plan)
    held = replayer.replay(plan, held_s=free.baseline_time_s + 0.2) if free else None
    assert free is not None and held is not None
    assert held.baseline_time_s == pytest.approx(free.baseline_time_s + 0.2)
    extra_j = held.baseline_energy_j - free.baseline_energy_j
    assert extra_j == pytest.approx(STAGES * P_BLOCK_W * 0.2)
    assert replayer.replay(plan, held_s=0.0).baseline_time_s == free.baseline_time_s
