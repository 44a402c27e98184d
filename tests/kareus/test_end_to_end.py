"""Kareus on the simulated A100: search quality, execution-model switch, frontier gains.

The full figures (five configurations, every partition type, 18 clocks) are in
``benchmarks/kareus.py``; these are the same checks on reduced spaces so they run in seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from powerlib.kareus.comparison import compare_frontiers
from powerlib.kareus.compose import METHODS, measure_components
from powerlib.kareus.partition import build_workload, config_space, search_budget
from powerlib.kareus.shapes import MODEL_SHAPES, Parallelism
from powerlib.kareus.sim_fluid import model
from powerlib.kareus.sim_model import SimulatedOverlapEvaluator
from powerlib.kareus.workflow import compose_methods, solve_methods

pytest.importorskip("sklearn")
pytest.importorskip("moocore")

from powerlib.kareus.hypervolume import relative_hypervolume  # noqa: E402
from powerlib.kareus.search import search_partition  # noqa: E402

FREQS = tuple(float(f) for f in range(900, 1411, 30))
FEW_FREQS = (1110.0, 1260.0, 1410.0)


def _workload(model_key: str, **par: int):
    return build_workload(MODEL_SHAPES[model_key], Parallelism(**par), [15, 13])


@pytest.mark.parametrize(
    ("model_key", "par", "key"),
    [
        ("llama3.2-3b", {"tp": 8, "micro_batch": 8, "seq_len": 4096}, "fwd_attn"),
        ("qwen3-1.7b", {"tp": 4, "cp": 2, "micro_batch": 8, "seq_len": 4096}, "bwd_a_rs"),
    ],
)
def test_search_reaches_98_percent_of_exhaustive_hypervolume_on_the_simulator(
    model_key, par, key
) -> None:
    ptype = _workload(model_key, **par).partition(key)
    space = config_space(ptype, FREQS)
    evaluator = SimulatedOverlapEvaluator(noise=0.01, seed=3, freqs_mhz=FREQS)
    result = search_partition(ptype, space, evaluator, seed=3)
    assert result.evaluations_used <= search_budget(ptype).total <= 224
    truth = {c: model(ptype, c) for c in space}
    found = np.array([truth[r.config] for r in result.evaluations])
    every = np.array(list(truth.values()))
    assert relative_hypervolume(found, every) >= 0.98
    # Every measurement took the thermally stable protocol's ~13 s of (virtual) GPU time.
    assert result.wall_s == pytest.approx(13.0 * result.evaluations_used, rel=0.05)


def test_search_respects_the_power_limit() -> None:
    """No candidate the search measures, and none on the front it returns, draws more than the
    device's limit (Llama 3.2 3B CP2xTP4 fwd_ao_ar reaches 486 W at 1410 MHz without it): the
    hot ones run throttled, below their locked clock."""
    from powerlib.kareus.partition import Budget
    from powerlib.kareus.sim_fluid import simulate
    from powerlib.kareus.sim_params import A100

    ptype = _workload("llama3.2-3b", tp=4, cp=2, micro_batch=8, seq_len=4096).partition("fwd_ao_ar")
    freqs = (1230.0, 1320.0, 1410.0)
    space = config_space(ptype, freqs)
    assert max(simulate(ptype, c).avg_power_w for c in space) > 480
    evaluator = SimulatedOverlapEvaluator(noise=0.0, seed=1, freqs_mhz=freqs)
    result = search_partition(ptype, space, evaluator, budget=Budget(24, 2, 8), seed=1)
    cap = A100.power_cap_w
    assert max(evaluator.window_powers_w) <= cap + 1.0
    assert max(r.energy_j / r.time_s for r in result.evaluations) <= cap + 1.0
    front = result.pareto("total") + result.pareto("dynamic")
    assert front and max(r.energy_j / r.time_s for r in front) <= cap + 1.0
    assert any(r.energy_j / r.time_s > cap - 5.0 for r in front)  # the front reaches the limit
    hot = [r for r in result.evaluations if simulate(ptype, r.config).avg_power_w > cap + 5.0]
    assert hot  # measured throttled: slower than at their locked clock
    for r in hot:
        assert r.time_s > 1.005 * simulate(ptype, r.config).time_s
        t, e = model(ptype, r.config)
        assert e / t <= cap + 1e-6 and r.time_s == pytest.approx(t, rel=0.04)


def _exact_study(workload):
    """Noise-free measurements of a reduced space (3 clocks, 3 SM counts), all of it."""
    evaluator = SimulatedOverlapEvaluator(noise=0.0, thermal=False, freqs_mhz=FEW_FREQS)
    records = {}
    for p in workload.partitions:
        sms = (3, 12, 24) if p.comm.group_size >= 4 else (2, 8, 16)
        rows = []
        for c in config_space(p, FEW_FREQS, sms):
            t, e = model(p, c)
            rows.append((c, t, e - evaluator.p_static_w * t))
        records[p.key] = rows
    return records, measure_components(workload, evaluator, FEW_FREQS)


def _frontiers(workload):
    records, components = _exact_study(workload)
    return solve_methods(
        workload,
        compose_methods(workload, records, components, methods=METHODS),
        components,
        microbatches=8,
        schedule="1f1b",
    )


def _executions(frontier, point) -> set[str]:
    return {o.knob.execution for o in frontier.planned_options(point)}


def test_communication_heavy_layer_overlaps_and_saves_10_to_30_percent_at_iso_time() -> None:
    fronts = _frontiers(_workload("llama3.2-3b", tp=8, micro_batch=8, seq_len=4096))
    kareus = fronts["kareus"]
    # Overlap everywhere time matters; an instruction with slack may run sequentially at a low
    # clock, the cheapest in dynamic energy when its time is free.
    modes = [o.knob.execution for o in kareus.planned_options(kareus.fastest)]
    assert modes.count("nanobatch") >= 0.9 * len(modes)
    cmp_ = compare_frontiers(kareus, fronts["perseus"], fronts["nanobatch"])
    assert cmp_.iso_time_energy_reduction is not None
    assert 0.10 <= cmp_.iso_time_energy_reduction <= 0.30
    assert all(d.weakly_dominated for d in cmp_.dominance.values())
    data = cmp_.to_json()
    assert list(data) == [
        "iso_time_energy_reduction",
        "iso_time",
        "iso_energy_time_reduction",
        "megatron",
        "max_throughput",
        "dominance",
    ]
    assert list(data["max_throughput"]) == ["kareus", "perseus", "nanobatch"]
    assert data["megatron"] == {"time_s": cmp_.megatron_time_s, "energy_j": cmp_.megatron_energy_j}
    # Total energy along the Kareus frontier is U-shaped: static energy dominates at the slow end.
    energies = [p.energy_j for p in kareus.points]
    k = int(np.argmin(energies))
    assert 0 < k < len(energies) - 1


def test_small_nanobatches_fall_back_to_sequential_execution() -> None:
    fronts = _frontiers(_workload("qwen3-1.7b", tp=4, cp=2, micro_batch=2, seq_len=1024))
    kareus, perseus = fronts["kareus"], fronts["perseus"]
    for point in (kareus.fastest, kareus.min_energy):
        assert _executions(kareus, point) == {"sequential"}
    # With sequential execution everywhere, Kareus is exactly Perseus-only.
    assert kareus.fastest.time_s == pytest.approx(perseus.fastest.time_s)
    assert kareus.fastest.energy_j == pytest.approx(perseus.fastest.energy_j)
    # Plain nanobatching is slower than Megatron-LM here.
    assert fronts["nanobatch"].fastest.time_s > perseus.baseline_time_s
