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
   (:func:`~powerlib.planning.kareus.search.relative_hypervolume`).
2. **Frontiers.** The measured partitions are composed into instruction options and solved
   with the Perseus solver: Kareus (composed + sequential + stock), Perseus-only ("M+P":
   sequential execution, clock per instruction) and nanobatch+Perseus ("N+P": collective
   launched as soon as possible with the stock SM count). Metrics as in the paper
   (docs/kareus.md §4): iso-time energy reduction and iso-energy time reduction against M+P, max
   throughput against Megatron-LM (sequential at the highest clock), weak dominance of the
   Kareus frontier over M+P and N+P at 10 sampled points each.
3. **Execution-model switch.** How many instructions of the Kareus plans run sequentially, and
   whether that is right: sequential at the plan's clock against the best nanobatched
   composition at that clock in the exhaustive (noise-free) space.

Plus **Theorem 1** on the overlapped TP8 attention partition: a run capped at 400 W with the
clock locked at 1410 MHz against a run locked at the capped run's average clock, same work.

All numbers are simulated (A100 parameter set of :mod:`powerlib.emulator.partition_model`); the
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

from powerlib.emulator.partition_model import (
    A100,
    SimulatedOverlapEvaluator,
    Work,
    model,
    model_sequential,
    run_capped,
    run_locked,
)
from powerlib.planning.kareus.compose import (
    METHODS,
    calibrate_correction,
    compare_frontiers,
    measure_components,
    sample_frontier,
)
from powerlib.planning.kareus.partition import (
    MODEL_SHAPES,
    Parallelism,
    build_workload,
    config_space,
    search_budget,
)
from powerlib.planning.kareus.search import relative_hypervolume, search_partition
from powerlib.planning.kareus.workflow import compose_methods, solve_methods

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


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _search(workload: Any, seed: int) -> tuple[dict[str, Any], dict[str, list[Any]], Any]:
    evaluator = SimulatedOverlapEvaluator(A100, noise=0.01, seed=seed, freqs_mhz=FREQS)
    per_type: dict[str, Any] = {}
    records: dict[str, list[Any]] = {}
    for ptype in workload.partitions:
        space = config_space(ptype, FREQS)
        truth = {c: model(ptype, c) for c in space}
        budget = search_budget(ptype)
        started = time.perf_counter()
        result = search_partition(ptype, space, evaluator, budget=budget, seed=seed)
        cpu_s = time.perf_counter() - started
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
        }
        records[ptype.key] = [(r.config, r.time_s, r.dynamic_energy_j) for r in result.evaluations]
        _log(
            f"  {ptype.key:<12} {result.evaluations_used:>3}/{len(space):<4} evaluations, "
            f"HV {100 * rel_total:.2f} % of exhaustive ({result.stopped})"
        )
    components = measure_components(workload, evaluator, FREQS)
    return per_type, records, components


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


def _calibration(workload: Any, frontier: Any) -> dict[str, Any]:
    """The composition correction, fitted from composed vs in-situ instruction times.

    In situ: the instruction's partitions and extra work run back to back on the simulated GPU
    (noise-free); composed: the planner's sum of separately measured (noisy) partitions.
    """
    pairs = []
    seen = set()
    for ins, o in zip(frontier.dag.instructions, frontier.planned_options(frontier.fastest)):
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
        pairs.append((o.time_s, Work(tuple(items), params=A100).at(o.freq_mhz)[0]))
    if not pairs:  # every instruction runs sequentially: there is nothing composed to calibrate
        return {"instructions": 0, "factor": None}
    return {"instructions": len(pairs), "factor": calibrate_correction(pairs)}


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
    per_type, records, components = _search(workload, seed)
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
    cmp_ = compare_frontiers(frontiers["kareus"], frontiers["perseus"], frontiers["nanobatch"])
    kareus = frontiers["kareus"]
    sampled = sample_frontier(kareus.points)
    switch = {
        "fastest": _sequential_check(workload, kareus, kareus.fastest),
        "min_energy": _sequential_check(workload, kareus, kareus.min_energy),
    }
    hv = [t["relative_hv_total"] for t in per_type.values()]
    recovered = [t["pareto_recovered_within_1pct"] for t in per_type.values()]
    recovered_random = [t["pareto_recovered_random_same_budget"] for t in per_type.values()]
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
        "comparison": cmp_,
        "kareus_sampled_total_energy_u_shape": _u_shape([p.energy_j for p in sampled]),
        "execution_switch": switch,
        "correction_calibration": _calibration(workload, kareus),
        "elapsed_s": time.perf_counter() - started,
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
