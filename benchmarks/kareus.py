"""Kareus on the simulator: search quality, frontiers against the baselines, Theorem 1.

Run::

    python3 benchmarks/kareus.py --out kareus_bench.json          # all configurations (~3 min)
    python3 benchmarks/kareus.py --configs llama3.2-3b:tp8 --out x.json

For each configuration (Llama 3.2 3B and Qwen3 1.7B, TP8 and CP2×TP4, micro-batch 8, sequence
4096, plus a small-work Qwen3 CP2×TP4 case with micro-batch 2 and sequence 1024; PP=2 with the
artifact's 15/13 layer split, 8 microbatches, 1F1B, A100 parameters):

1. **Search.** Every partition type is searched with the multi-pass search on the simulated
   evaluator (1 % measurement noise, thermal drift, 5 s window + 5 s cooldown) within the paper's
   budget (84/112/224 evaluations). Its quality is the hypervolume of the *true* (noise-free)
   values of the configurations it measured, relative to the exhaustive front of the whole
   space, both normalised by the exhaustive min/max with reference point 1.1
   (:func:`~powerlib.kareus.search.relative_hypervolume`).
2. **Frontiers.** The measured partitions are composed into instruction options and solved
   with the Perseus solver: Kareus (composed + sequential + stock), Perseus-only ("M+P":
   sequential execution, clock per instruction) and nanobatch+Perseus ("N+P": collective
   launched as soon as possible with the stock SM count). Metrics as in the paper
   (docs/kareus.md §4): iso-time energy reduction against Megatron-LM ("M": sequential, every
   instruction at the highest clock; the lowest Kareus energy within M's iteration time) and,
   separately, against Perseus alone (M+P, within its fastest time); iso-energy time reduction
   against M+P; max throughput against M; weak dominance of the Kareus frontier over M+P and N+P
   at 10 sampled points each.
3. **Power limit.** The simulated A100 keeps its 400 W limit in force, as a real one does: a
   candidate that would draw more at its locked clock runs throttled (its clock drops until the
   power fits; the measurement is slower and averages a clock below the lock). Reported per
   partition type and configuration: the highest average power the device drew in any
   measurement window (and the noisy reading of it), on the returned fronts, in the noise-free
   truth of the measured configurations, and what those configurations would draw at their
   locked clocks without the limit; how many measurements throttled. A window above the limit
   (plus 1 W for the controller's overshoot) is flagged and makes the run exit with status 1.
4. **Composition correction.** :func:`~powerlib.kareus.compose.calibrate_correction`
   fitted from the planner's composed times of the nanobatched instructions of the fastest and
   minimum-energy Kareus plans against the same instructions run in situ (their partitions and
   extra work back to back on the simulated GPU, noise-free, under the power limit). The plans
   use correction 1.0; the fitted factor says how far that is off.
5. **Execution-model switch.** How many instructions of the Kareus plans run sequentially, and
   whether that is right: sequential at the plan's clock against the best nanobatched
   composition at that clock in the exhaustive (noise-free) space.

Plus **Theorem 1** on the overlapped TP8 attention partition: a run capped at 400 W with the
clock locked at 1410 MHz against a run locked at the capped run's average clock, same work.

All numbers are simulated (A100 parameter set of :mod:`powerlib.kareus.sim_model`); the
planner and the search are the library's, unchanged. JSON goes to stdout (and ``--out``);
progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from powerlib.kareus.comparison import compare_frontiers
from powerlib.kareus.compose import (
    METHODS,
    calibrate_correction,
    measure_components,
    sample_frontier,
)
from powerlib.kareus.evaluator import Measurement
from powerlib.kareus.hypervolume import relative_hypervolume
from powerlib.kareus.partition import build_workload, config_space, search_budget
from powerlib.kareus.search import search_partition
from powerlib.kareus.shapes import MODEL_SHAPES, Parallelism
from powerlib.kareus.sim_capping import Work, run_capped, run_locked
from powerlib.kareus.sim_fluid import model, model_sequential, simulate, throttled_clock
from powerlib.kareus.sim_model import SimulatedOverlapEvaluator
from powerlib.kareus.sim_params import A100
from powerlib.kareus.workflow import compose_methods, solve_methods

FREQS = tuple(float(f) for f in range(900, 1411, 30))
STAGE_LAYERS = (15, 13)
MICROBATCHES = 8

CONFIGS = {
    "llama3.2-3b:tp8": ("llama3.2-3b", Parallelism(tp=8, micro_batch=8, seq_len=4096)),
    "llama3.2-3b:cp2tp4": ("llama3.2-3b", Parallelism(tp=4, cp=2, micro_batch=8, seq_len=4096)),
    "qwen3-1.7b:tp8": ("qwen3-1.7b", Parallelism(tp=8, micro_batch=8, seq_len=4096)),
    "qwen3-1.7b:cp2tp4": ("qwen3-1.7b", Parallelism(tp=4, cp=2, micro_batch=8, seq_len=4096)),
    # Small work per microbatch: nanobatches too small to fill the GPU (docs/kareus.md §1.3, §5.3
    # item 7); the search must fall back to sequential execution.
    "qwen3-1.7b:cp2tp4:small": (
        "qwen3-1.7b",
        Parallelism(tp=4, cp=2, micro_batch=2, seq_len=1024),
    ),
}


POWER_TOLERANCE_W = 1.0
"""A measurement window may average this much above the limit: the controller compares a
trailing 100 ms average every 10 ms and overshoots briefly before each step down."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Recording:
    """The simulated evaluator, recording every measurement with its locked clock."""

    def __init__(self, inner: SimulatedOverlapEvaluator) -> None:
        self.inner = inner
        self.taken: list[tuple[float, Measurement]] = []

    @property
    def p_static_w(self) -> float:
        return self.inner.p_static_w

    @property
    def freqs_mhz(self) -> tuple[float, ...]:
        return self.inner.freqs_mhz

    def _keep(self, freq_mhz: float, m: Measurement) -> Measurement:
        self.taken.append((float(freq_mhz), m))
        return m

    def evaluate(self, ptype: Any, config: Any) -> Measurement:
        return self._keep(config.freq_mhz, self.inner.evaluate(ptype, config))

    def evaluate_sequential(self, segments: Any, freq_mhz: float, sm_count: int) -> Measurement:
        return self._keep(freq_mhz, self.inner.evaluate_sequential(segments, freq_mhz, sm_count))

    def evaluate_compute(self, ops: Any, freq_mhz: float) -> Measurement:
        return self._keep(freq_mhz, self.inner.evaluate_compute(ops, freq_mhz))

    def power_since(self, start: int) -> dict[str, Any]:
        """Power of the measurements taken from index ``start`` on."""
        taken = self.taken[start:]
        windows = self.inner.window_powers_w[start:]
        assert len(windows) == len(taken)
        throttled = sum(
            1 for f, m in taken if m.avg_freq_mhz is not None and m.avg_freq_mhz < f - 1e-6
        )
        return {
            "measurements": len(taken),
            "throttled": throttled,
            "max_device_power_w": max(windows),
            "max_measured_power_w": max(m.energy_j / m.time_s for _, m in taken),
            "above_limit": sum(
                1 for w in windows if w > self.inner.power_cap_w + POWER_TOLERANCE_W
            ),
        }


def _search(
    workload: Any, seed: int
) -> tuple[dict[str, Any], dict[str, list[Any]], Any, dict[str, Any]]:
    evaluator = _Recording(SimulatedOverlapEvaluator(A100, noise=0.01, seed=seed, freqs_mhz=FREQS))
    per_type: dict[str, Any] = {}
    records: dict[str, list[Any]] = {}
    for ptype in workload.partitions:
        space = config_space(ptype, FREQS)
        truth = {c: model(ptype, c) for c in space}
        budget = search_budget(ptype)
        started = time.perf_counter()
        first = len(evaluator.taken)
        result = search_partition(ptype, space, evaluator, budget=budget, seed=seed)
        cpu_s = time.perf_counter() - started
        power = evaluator.power_since(first)
        front = result.pareto("total") + result.pareto("dynamic")
        power["max_front_measured_power_w"] = max(r.energy_j / r.time_s for r in front)
        power["max_model_power_w"] = max(truth[r.config][1] / truth[r.config][0] for r in front)
        power["max_model_power_measured_w"] = max(
            truth[r.config][1] / truth[r.config][0] for r in result.evaluations
        )
        power["max_power_at_lock_without_limit_w"] = max(
            simulate(ptype, r.config).avg_power_w for r in result.evaluations
        )
        found = np.array([truth[r.config] for r in result.evaluations])
        every = np.array(list(truth.values()))
        p_s = evaluator.p_static_w
        rel_total = relative_hypervolume(found, every)
        rel_dynamic = relative_hypervolume(_dynamic(found, p_s), _dynamic(every, p_s))
        measured = result.points("total")
        rng = np.random.default_rng(seed)
        random_pick = every[rng.choice(len(every), size=len(found), replace=False)]
        per_type[ptype.key] = {
            "space": len(space),
            "budget": budget.total,
            "evaluations": result.evaluations_used,
            "batches": result.batches_run,
            "stopped": result.stopped,
            "relative_hv_total": rel_total,
            "relative_hv_dynamic": rel_dynamic,
            "relative_hv_measured_front": relative_hypervolume(measured, every),
            "relative_hv_random_same_budget": relative_hypervolume(random_pick, every),
            "pareto_recovered_within_1pct": _recovered(found, every),
            "pareto_recovered_random_same_budget": _recovered(random_pick, every),
            "front_sources": result.front_sources("total"),
            "profiling_h": result.wall_s / 3600.0,
            "exhaustive_profiling_h": len(space)
            * result.wall_s
            / max(1, len(result.evaluations))
            / 3600.0,
            "search_cpu_s": cpu_s,
            "power": power,
        }
        records[ptype.key] = [(r.config, r.time_s, r.dynamic_energy_j) for r in result.evaluations]
        _log(
            f"  {ptype.key:<12} {result.evaluations_used:>3}/{len(space):<4} evaluations, "
            f"HV {100 * rel_total:.2f} % of exhaustive ({result.stopped}), "
            f"max {power['max_device_power_w']:.1f} W ({power['throttled']} throttled)"
        )
    first = len(evaluator.taken)
    components = measure_components(workload, evaluator, FREQS)
    return per_type, records, components, evaluator.power_since(first)


def _recovered(found: np.ndarray, every: np.ndarray) -> float:
    """Share of the exhaustive Pareto points (time, total energy) that ``found`` matches within
    1 % in both objectives."""
    order = np.lexsort((every[:, 1], every[:, 0]))
    front, best = [], np.inf
    for i in order:
        if every[i, 1] < best:
            front.append(every[i])
            best = every[i, 1]
    hits = sum(
        bool(np.any((found[:, 0] <= 1.01 * t) & (found[:, 1] <= 1.01 * e))) for t, e in front
    )
    return hits / len(front)


def _dynamic(points: np.ndarray, p_static_w: float) -> np.ndarray:
    """(time, total energy) -> (time, dynamic energy)."""
    return np.column_stack([points[:, 0], points[:, 1] - p_static_w * points[:, 0]])


def _sequential_check(workload: Any, frontier: Any, point: Any) -> dict[str, Any]:
    """Plan instructions run sequentially: is that right in the exhaustive noise-free space?"""
    options = frontier.planned_options(point)
    seq = [
        (frontier.dag.instructions[i], o)
        for i, o in enumerate(options)
        if o.knob is not None and o.knob.execution == "sequential"
    ]
    right = 0
    checked: dict[tuple[int, str, float], bool] = {}
    for ins, o in seq:
        key = (ins.stage, ins.kind, o.freq_mhz)
        if key not in checked:
            checked[key] = _sequential_faster(workload, ins.kind, o.freq_mhz)
        right += checked[key]
    return {
        "sequential_instructions": len(seq),
        "instructions": len(options),
        "sequential_confirmed_by_exhaustive": right,
    }


def _sequential_faster(workload: Any, kind: str, freq_mhz: float) -> bool:
    """Sequential layer time < the best nanobatched layer time at ``freq_mhz`` (noise-free)."""
    seq_t = sum(
        model_sequential(workload.sequential[ph], freq_mhz)[0] for ph in workload.phases(kind)
    )
    nano_t = 0.0
    for ptype, per_layer in workload.instruction_types(kind):
        best = min(model(ptype, c)[0] for c in config_space(ptype, [freq_mhz]))
        nano_t += per_layer * best
    return seq_t < nano_t


def _in_situ_time_s(work: Work, freq_mhz: float) -> float:
    """Noise-free time of ``work`` locked at ``freq_mhz`` under the device's power limit."""

    def power(f: float) -> float:
        t, e = work.at(f)
        return e / t

    return work.at(throttled_clock(power, freq_mhz, A100.power_cap_w, A100))[0]


def _calibration(workload: Any, frontier: Any) -> dict[str, Any]:
    """The composition correction, fitted from composed vs in-situ instruction times.

    In situ: the instruction's partitions and extra work run back to back on the simulated GPU
    (noise-free, under the power limit, which then acts on the instruction's average power);
    composed: the planner's sum of separately measured (noisy, each throttled on its own)
    partitions. The nanobatched instructions of the fastest and minimum-energy plans.
    """
    pairs = []
    seen = set()
    for point in (frontier.fastest, frontier.min_energy):
        for ins, o in zip(frontier.dag.instructions, frontier.planned_options(point)):
            key = (ins.stage, ins.kind, o.freq_mhz, o.knob)
            if o.knob.execution != "nanobatch" or key in seen:
                continue
            seen.add(key)
            stage = workload.stages[ins.stage]
            items: list[Any] = []
            for name, cfg in o.knob.configs:
                ptype = workload.partition(name.removeprefix("recompute_"))
                items += [(ptype, cfg)] * (ptype.per_layer * stage.layers)
            extra = stage.extra_forward if ins.kind == "forward" else stage.extra_backward
            if extra:
                items.append(tuple(extra))
            pairs.append((o.time_s, _in_situ_time_s(Work(tuple(items), params=A100), o.freq_mhz)))
    if not pairs:  # every instruction runs sequentially: there is nothing composed to calibrate
        return {"instructions": 0, "factor": None, "used": 1.0}
    ratios = [m / c for c, m in pairs]
    return {
        "instructions": len(pairs),
        "factor": calibrate_correction(pairs),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "used": 1.0,
    }


def _theorem1() -> dict[str, Any]:
    """Qwen3 1.7B TP8: one nanobatched layer, each partition type at its fastest config."""
    w = build_workload(
        MODEL_SHAPES["qwen3-1.7b"], Parallelism(tp=8, micro_batch=8, seq_len=4096), STAGE_LAYERS
    )
    items: list[Any] = []
    for ptype in w.partitions:
        best = min(config_space(ptype, [1410.0]), key=lambda c: model(ptype, c)[0])
        items += [(ptype, best)] * ptype.per_layer
    work = Work(tuple(items), params=A100)
    t_unit, e_unit = work.at(1410.0)
    capped = run_capped(work, 1410.0, A100.power_cap_w, duration_s=5.0)
    locked = run_locked(work, capped.avg_freq_mhz, capped.work_units)
    return {
        "work": f"{w.label}: one nanobatched layer, fastest configuration per partition type",
        "uncapped_power_w": e_unit / t_unit,
        "power_cap_w": A100.power_cap_w,
        "capped": {
            "time_s": capped.time_s,
            "energy_j": capped.energy_j,
            "avg_freq_mhz": capped.avg_freq_mhz,
            "avg_power_w": capped.avg_power_w,
            "freq_min_mhz": min(capped.freq_trace_mhz),
            "freq_max_mhz": max(capped.freq_trace_mhz),
            "freq_std_mhz": float(np.std(capped.freq_trace_mhz)),
        },
        "locked": {
            "time_s": locked.time_s,
            "energy_j": locked.energy_j,
            "freq_mhz": locked.freq_mhz,
            "avg_power_w": locked.avg_power_w,
        },
        "time_ratio": locked.time_s / capped.time_s,
        "energy_saving": 1.0 - locked.energy_j / capped.energy_j,
        "holds": abs(locked.time_s / capped.time_s - 1.0) <= 0.01
        and locked.energy_j < capped.energy_j,
    }


def _time_quantum(options: dict[str, Any]) -> float:
    """τ: a power of ten at most 1/20 of the shortest instruction (1 ms for the 4K-token
    configurations, as in the artifact; finer for the small one, where floor quantization
    would otherwise hide several percent of each instruction)."""
    shortest = min(o[1] for opts in options.values() for lst in opts.values() for o in lst)
    return float(10.0 ** np.floor(np.log10(shortest / 20.0)))


def run_config(name: str, seed: int) -> dict[str, Any]:
    model_key, par = CONFIGS[name]
    workload = build_workload(MODEL_SHAPES[model_key], par, STAGE_LAYERS)
    _log(f"{name} ({workload.label}): {len(workload.partitions)} partition types")
    started = time.perf_counter()
    per_type, records, components, components_power = _search(workload, seed)
    all_options = compose_methods(workload, records, components, methods=METHODS)
    unit_time_s = _time_quantum(all_options)
    frontiers = solve_methods(
        workload,
        all_options,
        components,
        microbatches=MICROBATCHES,
        schedule="1f1b",
        unit_time_s=unit_time_s,
    )
    cmp_ = compare_frontiers(
        frontiers["kareus"], frontiers["perseus"], frontiers["nanobatch"]
    ).to_json()
    kareus = frontiers["kareus"]
    cmp_["iso_time_vs_megatron"] = _iso_time_vs_megatron(kareus, frontiers["perseus"])
    sampled = sample_frontier(kareus.points)
    switch = {
        "fastest": _sequential_check(workload, kareus, kareus.fastest),
        "min_energy": _sequential_check(workload, kareus, kareus.min_energy),
    }

    hv = [t["relative_hv_total"] for t in per_type.values()]
    recovered = [t["pareto_recovered_within_1pct"] for t in per_type.values()]
    recovered_random = [t["pareto_recovered_random_same_budget"] for t in per_type.values()]
    powers = [t["power"] for t in per_type.values()] + [components_power]
    power = {
        "limit_w": A100.power_cap_w,
        "tolerance_w": POWER_TOLERANCE_W,
        "measurements": sum(p["measurements"] for p in powers),
        "throttled": sum(p["throttled"] for p in powers),
        "above_limit": sum(p["above_limit"] for p in powers),
        "max_device_power_w": max(p["max_device_power_w"] for p in powers),
        "max_measured_power_w": max(p["max_measured_power_w"] for p in powers),
        "max_front_measured_power_w": max(
            t["power"]["max_front_measured_power_w"] for t in per_type.values()
        ),
        "max_model_power_w": max(
            t["power"]["max_model_power_measured_w"] for t in per_type.values()
        ),
        "max_power_at_lock_without_limit_w": max(
            t["power"]["max_power_at_lock_without_limit_w"] for t in per_type.values()
        ),
    }
    return {
        "workload": workload.label,
        "unit_time_s": unit_time_s,
        "partitions": per_type,
        "min_relative_hv_total": min(hv),
        "mean_pareto_recovered": float(np.mean(recovered)),
        "mean_pareto_recovered_random": float(np.mean(recovered_random)),
        "max_evaluations": max(t["evaluations"] for t in per_type.values()),
        "profiling_gpu_h": sum(t["profiling_h"] for t in per_type.values()) * par.tp * par.cp,
        "exhaustive_profiling_gpu_h": sum(t["exhaustive_profiling_h"] for t in per_type.values())
        * par.tp
        * par.cp,
        "frontiers": {
            m: {
                "points": len(f.points),
                "fastest": {"time_s": f.fastest.time_s, "energy_j": f.fastest.energy_j},
                "min_energy": {"time_s": f.min_energy.time_s, "energy_j": f.min_energy.energy_j},
                "sampled": [
                    {"time_s": p.time_s, "energy_j": p.energy_j} for p in sample_frontier(f.points)
                ],
            }
            for m, f in frontiers.items()
        },
        "power": power,
        "components_power": components_power,
        "comparison": cmp_,
        "kareus_sampled_total_energy_u_shape": _u_shape([p.energy_j for p in sampled]),
        "execution_switch": switch,
        "correction_calibration": _calibration(workload, kareus),
        "elapsed_s": time.perf_counter() - started,
    }


def _iso_time_vs_megatron(kareus: Any, perseus: Any) -> dict[str, Any]:
    """The lowest Kareus energy within Megatron-LM's iteration time, against Megatron-LM's.

    Megatron-LM: sequential execution, every instruction at the highest clock (the frontiers'
    common baseline, :meth:`~powerlib.planning.perseus.frontier.Frontier.baseline`).
    """
    base = perseus.baseline()
    fits = [p for p in kareus.points if p.time_s <= base.time_s + 1e-12]
    got = min(fits, key=lambda p: (p.energy_j, p.time_s)) if fits else None
    return {
        "megatron_time_s": base.time_s,
        "megatron_energy_j": base.energy_j,
        "kareus_time_s": None if got is None else got.time_s,
        "kareus_energy_j": None if got is None else got.energy_j,
        "energy_reduction": None if got is None else 1.0 - got.energy_j / base.energy_j,
    }


def _u_shape(energies: list[float]) -> bool:
    """Slowest-first energies fall to an interior minimum and rise again."""
    k = int(np.argmin(energies))
    return 0 < k < len(energies) - 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        nargs="*",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        help="configurations to run (default: all four)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = {name: run_config(name, args.seed) for name in args.configs}
    theorem = _theorem1()
    summary = {
        "min_relative_hv_total": min(r["min_relative_hv_total"] for r in results.values()),
        "max_evaluations_per_partition": max(r["max_evaluations"] for r in results.values()),
        "mean_pareto_recovered": {n: r["mean_pareto_recovered"] for n, r in results.items()},
        "mean_pareto_recovered_random": {
            n: r["mean_pareto_recovered_random"] for n, r in results.items()
        },
        "iso_time_energy_reduction_vs_megatron": {
            n: r["comparison"]["iso_time_vs_megatron"]["energy_reduction"]
            for n, r in results.items()
        },
        "iso_time_energy_reduction": {
            n: r["comparison"]["iso_time_energy_reduction"] for n, r in results.items()
        },
        "iso_energy_time_reduction": {
            n: r["comparison"]["iso_energy_time_reduction"] for n, r in results.items()
        },
        "weakly_dominates_all": all(
            d["weakly_dominated"]
            for r in results.values()
            for d in r["comparison"]["dominance"].values()
        ),
        "configs_choosing_sequential": [
            n
            for n, r in results.items()
            if r["execution_switch"]["fastest"]["sequential_instructions"]
            or r["execution_switch"]["min_energy"]["sequential_instructions"]
        ],
        "theorem1_holds": theorem["holds"],
        "power_limit_w": A100.power_cap_w,
        "max_device_power_w": {n: r["power"]["max_device_power_w"] for n, r in results.items()},
        "max_measured_power_w": {n: r["power"]["max_measured_power_w"] for n, r in results.items()},
        "no_candidate_above_power_limit": all(
            r["power"]["above_limit"] == 0 for r in results.values()
        ),
        "correction_factor": {n: r["correction_calibration"]["factor"] for n, r in results.items()},
    }
    data = {
        "schema": "powerlib.bench.kareus.v1",
        "device_params": "A100 (simulated)",
        "schedule": {
            "name": "1f1b",
            "stages": len(STAGE_LAYERS),
            "stage_layers": list(STAGE_LAYERS),
            "microbatches": MICROBATCHES,
        },
        "freqs_mhz": list(FREQS),
        "summary": summary,
        "configs": results,
        "theorem1": theorem,
        "python": platform.python_version(),
        "elapsed_s": time.perf_counter() - started,
    }
    text = json.dumps(data, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    if not summary["no_candidate_above_power_limit"]:
        _log(
            f"FLAG: a measurement window drew more than the {A100.power_cap_w:g} W limit "
            f"(+{POWER_TOLERANCE_W:g} W): see configs.*.power.above_limit"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
