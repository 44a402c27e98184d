"""How well profile -> plan -> apply holds up when the GPU behaves like NVML (issues 32, 45).

For every combination of counter period, clock-change latency, noise (and noise model) and
power-sampling duty (and a few seeds), this runs ``powerlib demo``'s whole pipeline on the
emulator (:func:`powerlib.emulator.demo.run_demo`: sessions profile through a sampled counter,
rank 0 plans, the plan is applied and checked by the closed loop) and reports, side by side in
one run, each figure with its error and the emulation model that produced it
(``model_description``):

- ``oracle``: the plan made from the emulator's ground truth (``Emulator.truth_profile()``: the
  profile with the emulated GPUs' persistent offsets), the true mean latency and the true
  noise structure (``NvmlLikeModel.time_noise()``: per iteration, per microbatch, independent),
  switches up requested ahead by the true p90 latency as sessions do (``ApplyConfig``'s
  ``request_ahead``), replayed by :func:`~powerlib.emulator.demo.simulate_plan` on the same
  model and seed: warm,
  interleaved with all-max on the same noise draws, 200 pairs, with standard errors (issue 45:
  the earlier oracle ran 10 all-max iterations, then the plan, while the GPUs warmed, and read
  about 0.56 points low);
- ``oracle_ignoring_noise``: the same plan made as if there were no noise;
- ``predicted``: what the sessions' planner predicted from their own profile;
- ``realized``: the truth of the sessions' plan (the demo's ``truth``: the emulator's exact
  energy, paired with all-max on the same noise draws, with standard errors), and its slowdown;
- ``measured``: what the sessions' closed loop measured (with its 95 % interval);
- the profile's row error against the ground truth (mean and worst, energy and time), the
  blocking-power error, the profiling iterations, the clock stall that driver reads in the
  hooks cost, and the hooks' own CPU time per instruction.

Every figure comes from the emulator (virtual time): no GPU. Output: JSON (``--out``), one
record per case plus a summary per cell (every case field but the seed: mean, min and max of
the realized saving and slowdown, the worst |predicted - realized|, the oracles with the
standard errors of their means).

Usage::

    python benchmarks/fidelity.py --issue45 --out benchmarks/results/fidelity_issue45.json
    python benchmarks/fidelity.py --targets --out benchmarks/results/fidelity_targets.json
    python benchmarks/fidelity.py --out benchmarks/results/fidelity.json      # full grid
    python benchmarks/fidelity.py --quick --out /tmp/fidelity.json            # 4 cases
    python benchmarks/fidelity.py --issue45 --only 5 --out /tmp/one.json     # one case
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

PERIODS_S = (0.001, 0.02, 0.1)
LATENCIES_S = (0.0, 0.005, 0.02, 0.05)
NOISES = (0.0, 0.02)
DUTIES = (1.0, 0.25)
SEEDS = (0, 1, 2)
ORACLE_PAIRS = 200
"""Paired iterations of each oracle's replay (``simulate_plan``)."""


_SPENT = {"s": 0.0, "calls": 0}
"""CPU time of the profile phase's hooks in this worker process (reset per case)."""


def _hook_timer() -> dict[str, float]:
    """Time the profile phase's hooks (begin, end, step) on the (virtual) training thread.

    ``start_iteration`` is left out: it is where rank 0 plans once, at the end of the sweep
    (reported by the planner as ``solve_time_s``), not a per-instruction cost.
    """
    from powerlib.runtime import profile_phase

    _SPENT["s"], _SPENT["calls"] = 0.0, 0
    cls = profile_phase.ProfilePhase
    for name in ("begin", "end", "step"):
        original = getattr(cls, name)
        if getattr(original, "_timed", False):
            continue

        def timed(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _original(self, *args, **kwargs)
            finally:
                _SPENT["s"] += time.thread_time() - t0
                _SPENT["calls"] += 1

        timed._timed = True  # type: ignore[attr-defined]
        setattr(cls, name, timed)
    return _SPENT


def _row_errors(out_dir: Path, true_profile: Any) -> dict[str, float]:
    """The sessions' profile against the one the emulated GPUs really run."""
    from powerlib.planning.profile import Profile

    truth = {(r.stage, r.instruction, r.freq_mhz): r for r in true_profile.rows}
    got = Profile.read(out_dir / "profile.csv")
    energy, times = [], []
    for r in got.rows:
        t = truth[(r.stage, r.instruction, r.freq_mhz)]
        energy.append(abs(r.energy_j / t.energy_j - 1.0))
        times.append(abs(r.time_s / t.time_s - 1.0))
    return {
        "rows": len(energy),
        "energy_mean_abs_error": statistics.fmean(energy),
        "energy_worst_error": max(energy),
        "time_mean_abs_error": statistics.fmean(times),
        "time_worst_error": max(times),
    }


def _truth_profile(model: Any, seed: int) -> Any:
    """The profile the emulated GPUs really run: their persistent offsets applied per stage.

    ``Emulator.truth_profile()`` (the noise model's per-GPU offsets, drawn from the seed); the
    shipped profile on an emulator without it.
    """
    from powerlib.emulator.demo import DEFAULT_P_BLOCK_W, default_profile
    from powerlib.emulator.engine import Emulator
    from powerlib.planning.schedules import build_schedule

    profile = default_profile()
    if not hasattr(Emulator, "truth_profile"):
        return profile
    schedule = build_schedule("1f1b", profile.num_stages, 12, 1)
    emulator = Emulator(profile, schedule, p_block_w=DEFAULT_P_BLOCK_W, model=model, seed=seed)
    return emulator.truth_profile()


def _true_time_noise(model: Any) -> Any:
    """The structure of the model's time noise (``NvmlLikeModel.time_noise()``), else i.i.d."""
    from powerlib.planning.perseus.noise import TimeNoise

    if hasattr(model, "time_noise"):
        return model.time_noise()
    return TimeNoise.iid(model.noise)


def _oracle(model: Any, policy: str, straggler: float | None, seed: int) -> dict[str, Any]:
    """The plan from the ground truth, replayed paired on the model (``simulate_plan``).

    Two plans from the emulator's true profile (its GPUs' persistent offsets included), with
    the true mean latency and its distribution, requesting switches up ahead by the mean as the
    sessions do: ``oracle``, whose guard is told the true noise structure (per
    iteration, per microbatch, independent: ``NvmlLikeModel.time_noise()``), and
    ``oracle_ignoring_noise``, planned as if there were none (the planner before issue 32): the
    gap between them is what the noise costs, whoever plans. Each is replayed by
    :func:`powerlib.emulator.demo.simulate_plan` on the same model and seed as the demo: warm,
    interleaved with all-max, 200 pairs, each figure with its standard error (issue 45).
    """
    from powerlib.emulator.demo import DEFAULT_P_BLOCK_W, simulate_plan
    from powerlib.planning.choice import Policy, choose
    from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier
    from powerlib.planning.perseus.noise import TimeNoise
    from powerlib.planning.perseus.points import Wanted
    from powerlib.planning.schedules import build_schedule

    profile = _truth_profile(model, seed)
    frontier = compute_frontier(
        profile,
        build_schedule("1f1b", profile.num_stages, 12, 1),
        settings=FrontierSettings(unit_time_s=0.001, p_block_w=DEFAULT_P_BLOCK_W),
        schedule_name="1f1b",
        num_microbatches=12,
        wanted=Wanted(t_star=True),
    )
    deadline_s = None
    if straggler is not None:
        deadline_s = straggler * frontier.baseline_time_s
    true_noise = _true_time_noise(model)
    lead_s = _sessions_lead_s(model)
    ahead = {"request_ahead_s": lead_s} if "request_ahead_s" in Policy.__dataclass_fields__ else {}
    out: dict[str, Any] = {}
    for name, noise in (("oracle", true_noise), ("oracle_ignoring_noise", TimeNoise())):
        choice = choose(
            frontier,
            Policy(
                name=policy,
                deadline_s=deadline_s,
                switch_latency_s=model.switch_latency_s,
                time_noise=noise,
                latency_samples_s=_true_latencies_s(model),
                **ahead,
            ),
        )
        result = simulate_plan(
            choice.plan(), model=model, iterations=ORACLE_PAIRS, seed=seed,
            straggler_time_s=deadline_s, lead_s=lead_s if ahead else None,
        )  # fmt: skip
        out[name] = {
            key: result[key]
            for key in ("saving_percent", "saving_se_percent", "slowdown_percent",
                        "slowdown_se_percent", "iterations", "model_description",
                        "request_ahead_s")
        }  # fmt: skip
        out[name]["time_noise_told"] = noise.to_json()
        if true_noise.is_zero:
            out["oracle_ignoring_noise"] = out["oracle"]
            break
    return out


def _sessions_lead_s(model: Any) -> float | None:
    """How far ahead a session requests a switch up on ``model``: the median of its clock
    latency (uniform on ``mean (1 +- spread)``: the mean), as rank 0 plans it from the measured
    landings, when sessions request ahead (``ApplyConfig.request_ahead``, default on); ``None``
    otherwise."""
    from powerlib.runtime.session_config import ApplyConfig

    if not getattr(ApplyConfig(), "request_ahead", False) or model.switch_latency_s <= 0:
        return None
    return float(model.switch_latency_s)


def _true_latencies_s(model: Any) -> tuple[float, ...]:
    """The model's landing latency distribution, as the sessions' probes sample it: 200
    evenly spaced quantiles of ``mean (1 +- spread)``."""
    mean, spread = model.switch_latency_s, model.latency_spread
    if mean <= 0:
        return ()
    return tuple(mean * (1 - spread + 2 * spread * (i + 0.5) / 200) for i in range(200))


def _demo_config(case: dict[str, Any], out_dir: str) -> Any:
    """The demo a case runs: the NVML-like model with the case's counter, latency and duty;
    its noise (the independent part, ``None``: the preset's) and noise model as the demo's
    ``--noise`` and ``--noise-model`` give them (``DemoConfig`` overrides)."""
    from powerlib.emulator.demo import DemoConfig
    from powerlib.emulator.engine import NVML_LIKE_MODEL

    model = dataclasses.replace(
        NVML_LIKE_MODEL,
        counter_period_s=case["period_s"],
        switch_latency_s=case["latency_s"],
        latency_spread=0.5 if case["latency_s"] > 0 else 0.0,
        duty=case["duty"],
        name="fidelity",
    )
    extra = {}
    # DemoConfig.noise_model is issue 45's; an older powerlib has only its i.i.d. noise
    if case.get("noise_model") is not None and "noise_model" in DemoConfig.__dataclass_fields__:
        extra["noise_model"] = case["noise_model"]
    return DemoConfig(
        profile_path=case.get("profile_path"),
        model=model,
        noise=case.get("noise"),
        seed=case["seed"],
        policy=case.get("policy"),
        straggler=case.get("straggler"),
        out_dir=out_dir,
        plot=False,
        progress=False,
        **extra,
    )


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One (period, latency, noise, noise model, duty, seed[, policy, straggler]) case."""
    import logging
    import warnings

    from powerlib.emulator.demo import run_demo
    from powerlib.errors import PowerlibError

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    spent = _hook_timer()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        config = _demo_config(case, str(out))
        model = config.effective_model()
        # every figure below comes from this model (the oracles' replay names its own too)
        record: dict[str, Any] = {
            "case": case,
            "model_description": model.describe(),
            "model": model.to_json(),
        }
        try:
            report = run_demo(config)
        except PowerlibError as err:
            record["refused"] = str(err)
            record["elapsed_s"] = time.perf_counter() - started
            return record
        profile, predicted, truth = report.profile, report.predicted, report.truth
        measured = report.measured_by_sessions
        record.update(
            {
                "realized_saving_percent": truth.saving_percent,
                "realized_saving_se_percent": truth.saving_se_percent,
                "realized_slowdown_percent": truth.slowdown_percent,
                "realized_slowdown_se_percent": truth.slowdown_se_percent,
                "realized_iterations": truth.iterations,
                "predicted_saving_percent": None if predicted is None else predicted.saving_percent,
                "predicted_slowdown_percent": None
                if predicted is None
                else predicted.slowdown_percent,
                "measured": None if measured is None else dict(measured),
                "profile_iterations": profile.iterations,
                "p_block_error": statistics.fmean(
                    abs(p / 83.64 - 1.0) for p in profile.measured_p_block_w if p
                ),
                "measured_latency_s": [x for x in profile.measured_latency_s if x],
                "hook_stall_s_per_instruction": profile.hook_stall_s_per_instruction,
            }
        )
        if case.get("profile_path") is None:
            record["profile_error"] = _row_errors(out, _truth_profile(model, case["seed"]))
    instructions = 8 * 12 * 2 * record["profile_iterations"]
    record["hook_cpu_s_per_instruction"] = spent["s"] / instructions if instructions else None
    if case.get("profile_path") is None:
        record.update(_oracle(model, report.policy, case.get("straggler"), case["seed"]))
    record["elapsed_s"] = time.perf_counter() - started
    return record


_CELL = ("period_s", "latency_s", "noise", "noise_model", "duty", "policy", "straggler")
"""What a summary cell shares: every case field but the seed."""


def _values(rows: list[dict[str, Any]], path: str) -> list[float]:
    """The finite numbers at ``path`` (dotted) in ``rows``."""
    values = []
    for g in rows:
        v: Any = g
        for part in path.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, (int, float)) and math.isfinite(v):
            values.append(float(v))
    return values


def _spread(rows: list[dict[str, Any]], path: str, name: str) -> dict[str, float | None]:
    """``name``'s mean, min and max over the seeds."""
    values = _values(rows, path)
    return {
        f"{name}_percent": statistics.fmean(values) if values else None,
        f"min_{name}_percent": min(values, default=None),
        f"max_{name}_percent": max(values, default=None),
    }


def _oracle_summary(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """An oracle's mean saving and slowdown over the seeds, each with the standard error of the
    mean from the seeds' own (independent replays: ``sqrt(sum se_i^2) / n``)."""
    out: dict[str, Any] = {}
    for figure in ("saving", "slowdown"):
        values = _values(rows, f"{name}.{figure}_percent")
        errors = _values(rows, f"{name}.{figure}_se_percent")
        out[f"{name}_{figure}_percent"] = statistics.fmean(values) if values else None
        out[f"{name}_{figure}_se_percent"] = (
            math.sqrt(math.fsum(e * e for e in errors)) / len(errors) if errors else None
        )
    out[f"{name}_model_description"] = sorted(
        {g[name]["model_description"] for g in rows if name in g}
    )
    return out


def _summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per cell (every case field but the seed): the seeds' figures side by side."""
    cells: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault(tuple(r["case"].get(k) for k in _CELL), []).append(r)
    out = []
    for key, group in sorted(cells.items(), key=lambda kv: str(kv[0])):
        ok = [g for g in group if "refused" not in g]

        def mean(path: str, rows: list[dict[str, Any]] = ok) -> float | None:
            values = _values(rows, path)
            return statistics.fmean(values) if values else None

        gaps = [
            abs(g["predicted_saving_percent"] - g["realized_saving_percent"])
            for g in ok
            if g.get("predicted_saving_percent") is not None
        ]
        out.append(
            {
                **dict(zip(_CELL, key, strict=True)),
                "seeds": len(group),
                "refused": len(group) - len(ok),
                "model_description": sorted({g["model_description"] for g in group}),
                **_spread(ok, "realized_saving_percent", "realized_saving"),
                **_spread(ok, "realized_slowdown_percent", "realized_slowdown"),
                "worst_realized_slowdown_percent": max(
                    (g["realized_slowdown_percent"] for g in ok), default=None
                ),
                "realized_saving_se_percent": mean("realized_saving_se_percent"),
                "realized_slowdown_se_percent": mean("realized_slowdown_se_percent"),
                "predicted_saving_percent": mean("predicted_saving_percent"),
                "worst_predicted_minus_realized_points": max(gaps, default=None),
                "measured_saving_percent": mean("measured.saving_percent"),
                **_oracle_summary(ok, "oracle"),
                **_oracle_summary(ok, "oracle_ignoring_noise"),
                "profile_energy_mean_abs_error": mean("profile_error.energy_mean_abs_error"),
                "profile_energy_worst_error": max(
                    (g["profile_error"]["energy_worst_error"] for g in ok if "profile_error" in g),
                    default=None,
                ),
                "p_block_error": mean("p_block_error"),
                "profile_iterations": mean("profile_iterations"),
                "hook_cpu_s_per_instruction": mean("hook_cpu_s_per_instruction"),
                "hook_stall_s_per_instruction": mean("hook_stall_s_per_instruction"),
            }
        )
    return out


def _cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The cases the flags ask for."""
    target = {"period_s": 0.1, "latency_s": 0.02, "duty": 1.0}
    if args.quick:  # the demo's defaults (its default noise model), duty 1 and 0.25
        return [
            {"period_s": 0.1, "latency_s": 0.02, "noise": None, "duty": d, "seed": s}
            for d in (1.0, 0.25)
            for s in (0, 1)
        ]
    if args.issue45:
        cases = [{**target, "noise": None, "noise_model": "fixed-length", "seed": s}
                 for s in range(5)]  # fmt: skip
        cases += [{**target, "noise": 0.02, "noise_model": "iid", "seed": s} for s in range(5)]
        cases.append({**target, "noise": None, "noise_model": "variable-length", "seed": 0})
        cases.append({**target, "noise": None, "noise_model": "fixed-length", "seed": 0,
                      "duty": 0.25})  # fmt: skip
        return cases
    # issue 32's grids: their noise is independent per instruction (the iid model)
    if args.targets:
        return [
            {**target, "noise": 0.02, "noise_model": "iid", "seed": s, **extra}
            for extra in ({}, {"straggler": 1.2}, {"policy": "min-energy"})
            for s in SEEDS
        ]
    return [
        {"period_s": p, "latency_s": lat, "noise": n, "noise_model": "iid", "duty": d, "seed": s}
        for p, lat, n, d, s in itertools.product(PERIODS_S, LATENCIES_S, NOISES, DUTIES, SEEDS)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON output file")
    parser.add_argument("--quick", action="store_true",
                        help="4 cases: the demo's defaults, duty 1 and 0.25, seeds 0-1")  # fmt: skip
    parser.add_argument("--targets", action="store_true",
                        help="only issue 32's target cases (0.1 s, 20 ms, 2 %% iid; policies)")  # fmt: skip
    parser.add_argument("--issue45", action="store_true",
                        help="issue 45's cases: fixed-length and iid 2 %% (seeds 0-4), "
                        "variable-length and duty 0.25 (seed 0)")  # fmt: skip
    parser.add_argument("--only", type=int, nargs="*", default=None,
                        help="run only these case indices of the chosen set")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    cases = _cases(args)
    if args.only is not None:
        cases = [cases[i] for i in args.only]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        records = []
        for i, record in enumerate(pool.map(run_case, cases), 1):
            records.append(record)
            print(f"[{i}/{len(cases)}] {record['case']}: realized "
                  f"{record.get('realized_saving_percent', float('nan')):.2f} %, oracle "
                  f"{record.get('oracle', {}).get('saving_percent', float('nan')):.2f} %",
                  file=sys.stderr)  # fmt: skip
    result = {
        "schema": "powerlib.bench.fidelity.v2",
        "emulation": "powerlib.emulator NvmlLikeModel (virtual time; no GPU), GPT-3 175B A100 "
        "profile, 8 stages x 12 microbatches, 1f1b; each record and cell names its model "
        "(model_description)",
        "oracle_pairs": ORACLE_PAIRS,
        "elapsed_s": time.perf_counter() - started,
        "summary": _summarize(records),
        "cases": records,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(records)} cases, {result['elapsed_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
