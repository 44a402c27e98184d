"""Composition of partition measurements into instruction options and one frontier.

A small analytic evaluator stands in for the GPU here so the checks are exact: brute-force
enumeration against the pruned composition, frontier nesting, plan fields, the study files.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from powerlib.errors import PlanError
from powerlib.kareus.compose import (
    METHODS,
    Knob,
    calibrate_correction,
    compose_options,
    measure_components,
    method_frontier,
    pareto_indices,
    sample_frontier,
)
from powerlib.kareus.evaluator import Measurement
from powerlib.kareus.partition import build_workload, config_space
from powerlib.kareus.partition_types import Config, PartitionType
from powerlib.kareus.shapes import MODEL_SHAPES, Parallelism
from powerlib.kareus.study import read_study, write_study
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.schedules import schedule_1f1b

P_STATIC_W = 85.0
FREQS = (1110.0, 1260.0, 1410.0)


class AnalyticEvaluator:
    """Compute slows with clock and lost SMs; the collective overlaps after its slot's start."""

    p_static_w = P_STATIC_W
    freqs_mhz = FREQS

    def _compute(self, ops, freq_mhz: float, sms: int = 108) -> tuple[float, float]:
        t = sum(
            max(o.flops / (200e12 * sms / 108 * freq_mhz / 1410), o.hbm_bytes / 1.4e12) for o in ops
        )
        e = sum(o.flops for o in ops) / 1e12 * (0.4 + 0.6 * (freq_mhz / 1410) ** 2)
        return t, e

    def _comm(self, comm, sm_count: int) -> tuple[float, float]:
        t = comm.wire_bytes / min(230e9, sm_count * 10e9)
        return t, 0.05 * t * sm_count

    def evaluate(self, ptype: PartitionType, config: Config) -> Measurement:
        tc, ec = self._compute(ptype.ops, config.freq_mhz, 108 - config.sm_count)
        tm, em = self._comm(ptype.comm, config.sm_count)
        if config.slot is None:
            t = tc + tm
        else:
            start, _ = self._compute(ptype.ops[: ptype.slot_ops[config.slot]], config.freq_mhz)
            t = max(tc, start + tm)
        return Measurement(time_s=t, energy_j=ec + em + P_STATIC_W * t, p_static_w=P_STATIC_W)

    def evaluate_sequential(self, segments, freq_mhz: float, sm_count: int) -> Measurement:
        t = e = 0.0
        for seg in segments:
            tc, ec = self._compute(seg.ops, freq_mhz)
            tm, em = self._comm(seg.comm, sm_count)
            t, e = t + tc + tm, e + ec + em
        return Measurement(time_s=t, energy_j=e + P_STATIC_W * t, p_static_w=P_STATIC_W)

    def evaluate_compute(self, ops, freq_mhz: float) -> Measurement:
        t, e = self._compute(ops, freq_mhz)
        return Measurement(time_s=t, energy_j=e + P_STATIC_W * t, p_static_w=P_STATIC_W)


def _records(workload, evaluator, sm_counts=(3, 12, 24)):
    out = {}
    for p in workload.partitions:
        rows = []
        for c in config_space(p, FREQS, sm_counts):
            m = evaluator.evaluate(p, c)
            rows.append((c, m.time_s, m.dynamic_energy_j))
        out[p.key] = rows
    return out


@pytest.fixture(scope="module")
def tp_case():
    workload = build_workload(
        MODEL_SHAPES["llama3.2-3b"], Parallelism(tp=8, micro_batch=8, seq_len=4096), [15, 13]
    )
    ev = AnalyticEvaluator()
    return workload, _records(workload, ev), measure_components(workload, ev, FREQS)


def test_pareto_indices_keeps_exactly_the_non_dominated_points() -> None:
    times = [1.0, 2.0, 2.0, 3.0, 1.5, 3.0]
    costs = [5.0, 3.0, 4.0, 1.0, 5.0, 1.0]
    assert pareto_indices(times, costs) == [0, 1, 3]


def test_composition_matches_brute_force_enumeration(tp_case) -> None:
    workload, records, components = tp_case
    options = compose_options(workload, records, components)
    stage = workload.stages[1]  # no embedding; output layer and loss on the last stage
    for kind in ("forward", "backward"):
        types = workload.instruction_types(kind)
        composed = [o for o in options[(1, kind)] if o[3].source == "search"]
        for f in FREQS:
            ext = components.extras[(1, kind, f)]
            per_type = [[r for r in records[p.key] if r[0].freq_mhz == f] for p, _ in types]
            sums = []
            for combo in itertools.product(*per_type):
                t = sum(n * stage.layers * r[1] for (p, n), r in zip(types, combo))
                e = sum(n * stage.layers * r[2] for (p, n), r in zip(types, combo))
                sums.append((t + ext.time_s, e + ext.dynamic_energy_j))
            brute = sorted(sums[i] for i in pareto_indices(*zip(*sums)))
            got = sorted((o[1], o[2] - P_STATIC_W * o[1]) for o in composed if o[0] == f)
            # Options dominated across clocks are pruned as well; each survivor is on its
            # clock's brute-force front, and the clock's front points that survive all match.
            for point in got:
                assert any(
                    math.isclose(point[0], b[0], rel_tol=1e-12)
                    and math.isclose(point[1], b[1], rel_tol=1e-12)
                    for b in brute
                )
            all_opts = [(o[1], o[2] - P_STATIC_W * o[1]) for o in options[(1, kind)]]
            for b in brute:  # a front point missing from the options must be dominated by one
                if not any(math.isclose(b[0], g[0], rel_tol=1e-12) for g in got):
                    assert any(t <= b[0] and e <= b[1] for t, e in all_opts)


def test_every_option_carries_one_configuration_per_partition_type(tp_case) -> None:
    workload, records, components = tp_case
    options = compose_options(workload, records, components)
    fwd_keys = {p.key for p in workload.partitions if p.phase == "fwd"}
    bwd_keys = {p.key for p in workload.partitions if p.phase == "bwd"}
    for (_stage, kind), opts in options.items():
        for f, _t, _e, knob in opts:
            if knob.execution == "sequential":
                assert knob.configs == ()
                continue
            keys = [k for k, _ in knob.configs]
            want = (
                fwd_keys if kind == "forward" else {f"recompute_{k}" for k in fwd_keys} | bwd_keys
            )
            assert sorted(keys) == sorted(want)
            assert all(c.freq_mhz == f for _, c in knob.configs)  # one clock per instruction


def test_kareus_frontier_weakly_dominates_both_baselines(tp_case) -> None:
    workload, records, components = tp_case
    sched = schedule_1f1b(2, 4)
    fronts = {
        m: method_frontier(
            workload,
            compose_options(workload, records, components, method=m),
            components,
            sched,
            schedule_name="1f1b",
            num_microbatches=4,
        )
        for m in METHODS
    }
    kareus = fronts["kareus"]
    for name in ("perseus", "nanobatch"):
        for p in sample_frontier(fronts[name].points):
            fits = [q.energy_j for q in kareus.points if q.time_s <= p.time_s + 1e-9]
            assert fits and min(fits) <= p.energy_j + 1e-6, (name, p.time_s)
    # Overlap pays off on this communication-heavy layer: Kareus is faster and cheaper.
    assert kareus.fastest.time_s < fronts["perseus"].fastest.time_s
    assert kareus.baseline_time_s == pytest.approx(fronts["perseus"].baseline_time_s)


def test_overlap_plan_round_trips_with_partition_settings(tp_case, tmp_path: Path) -> None:
    workload, records, components = tp_case
    frontier = method_frontier(
        workload,
        compose_options(workload, records, components),
        components,
        schedule_1f1b(2, 4),
        schedule_name="1f1b",
        num_microbatches=4,
    )
    data = frontier.plan(frontier.fastest, policy="fastest").to_json()
    plan = FrequencyPlan.from_json(json.loads(json.dumps(data)))
    nano = [p for s in plan.stages for p in s if p.execution == "nanobatch"]
    assert nano, "the fastest plan overlaps communication"
    for p in nano:
        assert p.predicted_time_s and p.predicted_energy_j
        for setting in p.overlap.values():
            assert setting.sm_count in (3, 12, 24) and setting.block_size == 1024
    again = FrequencyPlan.from_json(plan.to_json())
    assert again.stages == plan.stages


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"execution": "both"}, "execution must be one of"),
        ({"execution": "nanobatch", "overlap": {}}, "needs its partition settings"),
        (
            {"execution": "nanobatch", "overlap": {"fwd_attn": {"slot": "rope_0", "sm_count": 0}}},
            "sm_count must be a positive integer",
        ),
        (
            {"overlap": {"fwd_attn": {"slot": "rope_0", "sm_count": 3}}},
            "a sequential instruction has no partition settings",
        ),
        (
            {"execution": "nanobatch", "overlap": {"fwd_attn": {"slot": 3, "sm_count": 3}}},
            "slot must be a slot name or null",
        ),
    ],
)
def test_malformed_overlap_fields_are_one_clear_error(patch, message) -> None:
    item = {"kind": "forward", "microbatch": 0, "freq_mhz": 1410.0, **patch}
    data = {"schema": "powerlib.plan.v1", "stages": [{"stage": 0, "instructions": [item]}]}
    with pytest.raises(PlanError, match=message):
        FrequencyPlan.from_json(data)


def test_correction_scales_partition_sums_only(tp_case) -> None:
    workload, records, components = tp_case
    plain = compose_options(workload, records, components, method="nanobatch")
    scaled = compose_options(workload, records, components, method="nanobatch", correction=1.15)
    for key in plain:
        for a, b in zip(plain[key], scaled[key]):
            ext = components.extras.get((key[0], key[1], a[0]))
            ext_t = ext.time_s if ext else 0.0
            assert b[1] - ext_t == pytest.approx(1.15 * (a[1] - ext_t))
    assert calibrate_correction([(1.0, 1.15), (2.0, 2.3)]) == pytest.approx(1.15)
    with pytest.raises(PlanError, match="positive"):
        compose_options(workload, records, components, correction=0.0)
    with pytest.raises(PlanError, match="at least one"):
        calibrate_correction([])


def test_missing_partition_results_are_named(tp_case) -> None:
    workload, records, components = tp_case
    partial = {k: v for k, v in records.items() if k != "bwd_mlp"}
    with pytest.raises(PlanError, match="bwd_mlp"):
        compose_options(workload, partial, components)
    with pytest.raises(PlanError, match="method must be one of"):
        compose_options(workload, records, components, method="fastest")


def test_sample_frontier_is_denser_at_the_fast_end(tp_case) -> None:
    workload, records, components = tp_case
    frontier = method_frontier(
        workload,
        compose_options(workload, records, components, method="perseus"),
        components,
        schedule_1f1b(2, 4),
        schedule_name="1f1b",
        num_microbatches=4,
    )
    picked = sample_frontier(frontier.points)
    assert len(picked) == 10 and picked[-1] is frontier.fastest
    times = [p.time_s for p in picked]
    assert times == sorted(times, reverse=True)
    gaps = [a - b for a, b in zip(times, times[1:])]
    assert gaps[0] > gaps[-1]


def test_study_round_trip_and_malformed_study(tp_case, tmp_path: Path) -> None:
    workload, _records_, components = tp_case
    write_study(
        tmp_path,
        model_key="llama3.2-3b",
        parallelism=workload.parallelism,
        stage_layers=(15, 13),
        freqs_mhz=FREQS,
        components=components,
        evaluator={"kind": "analytic"},
    )
    study = read_study(tmp_path)
    assert study.workload == workload
    assert study.components.sequential[("fwd", 1410.0)].time_s == pytest.approx(
        components.sequential[("fwd", 1410.0)].time_s
    )
    data = json.loads((tmp_path / "study.json").read_text())
    data["stock"] = data["stock"][1:]
    (tmp_path / "study.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="no stock measurement"):
        read_study(tmp_path)
    (tmp_path / "study.json").write_text("{")
    with pytest.raises(PlanError, match="study.json: invalid JSON"):
        read_study(tmp_path)
    with pytest.raises(PlanError, match="kareus search"):
        read_study(tmp_path / "missing")


def test_knob_plan_fields() -> None:
    knob = Knob("nanobatch", (("fwd_attn", Config(freq_mhz=1410.0, sm_count=6, slot=None)),))
    assert knob.to_plan()["overlap"] == {
        "fwd_attn": {"slot": None, "sm_count": 6, "block_size": 1024}
    }
    assert str(Config(freq_mhz=1410.0, sm_count=12, slot="rope_0")) == "rope_0-none-12-1024"
    assert Config.parse("rope_0-none-12-1024", 1410.0).slot == "rope_0"
    with pytest.raises(PlanError, match="not <slot>"):
        Config.parse("rope_0-12", 1410.0)
