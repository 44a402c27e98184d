"""What one instruction's begin+end hook pair costs the training thread.

Run::

    python3 benchmarks/hooks.py --iterations 400

A one-stage session on the simulated backend (persisted state, so every clock change is
journaled and goes through the same control path as on a real GPU) applies a plan whose
consecutive instructions alternate between two clocks, so every begin hands a new frequency to
the controller thread: the worst case (a plan that repeats a clock costs less: the request is
skipped). Each pair ``session.begin(...); session.end()`` is timed with ``perf_counter_ns``; the
driver calls themselves run on the controller thread and are not in the figure, which is the
point of the design. The profile-phase pair (device sync is a no-op here, two energy reads) is
measured the same way for comparison.

Prints one JSON object: median and p99 per pair, and the median as a share of a 20 ms
instruction. Exits 1 if the median apply-phase pair is not below ``--limit-us`` (20 µs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from powerlib.config import Settings
from powerlib.planning.schedules import schedule_1f1b
from powerlib.registry import open_backend
from powerlib.runtime.coordination import SingleProcess
from powerlib.runtime.session import Session, optimize


def _plan(path: Path, microbatches: int, freqs: tuple[float, float]) -> None:
    order = schedule_1f1b(1, microbatches)[0]
    data = {
        "schema": "powerlib.plan.v1",
        "workload": {"num_stages": 1, "num_microbatches": microbatches, "schedule": "1f1b"},
        "policy": "benchmark",
        "stages": [
            {
                "stage": 0,
                "instructions": [
                    {
                        "kind": ins.kind,
                        "microbatch": ins.microbatch,
                        "chunk": 0,
                        "freq_mhz": freqs[i % 2],
                    }
                    for i, ins in enumerate(order)
                ],
            }
        ],
    }
    path.write_text(json.dumps(data), encoding="utf-8")


def _pairs(session: Session, iterations: int, microbatches: int) -> list[int]:
    order = schedule_1f1b(1, microbatches)[0]
    costs: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        for ins in order:
            t0 = clock()
            session.begin(ins.kind, ins.microbatch)
            session.end()
            costs.append(clock() - t0)
        session.step()
    return costs


def _stats(costs_ns: list[int], instruction_s: float) -> dict[str, float]:
    ordered = sorted(costs_ns)
    median_us = statistics.median(ordered) / 1e3
    return {
        "pairs": len(ordered),
        "median_us": median_us,
        "p99_us": ordered[int(0.99 * (len(ordered) - 1))] / 1e3,
        "max_us": ordered[-1] / 1e3,
        "median_share_of_instruction": median_us * 1e-6 / instruction_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--instruction-s", type=float, default=0.020)
    parser.add_argument("--limit-us", type=float, default=20.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(backend="simulated", state_dir=Path(tmp) / "state", sim_gpus=1)
        plan_path = Path(tmp) / "plan.json"
        _plan(plan_path, args.microbatches, (1410.0, 1200.0))
        with open_backend(settings=settings) as backend:
            before = backend.device(0).read_state().locked_sm_freqs_mhz
            with optimize(
                num_stages=1,
                num_microbatches=args.microbatches,
                mode="apply",
                plan_path=plan_path,
                backend=backend,
                device=0,
                coordinator=SingleProcess(),
                out_dir=None,
                progress=False,
                prefetch=False,  # one request per begin: the worst case
            ) as session:
                _pairs(session, 5, args.microbatches)  # warm-up (the order check runs here)
                apply_costs = _pairs(session, args.iterations, args.microbatches)
                assert session.controller is not None
                session.controller.wait_idle()
                changes = len(session.controller.applied)
            with optimize(
                num_stages=1,
                num_microbatches=args.microbatches,
                mode="profile",
                backend=backend,
                device=0,
                coordinator=SingleProcess(),
                freqs_mhz=[1410.0],
                warmup_iterations=0,
                settle_iterations=0,
                iterations_per_freq=args.iterations + 5,
                out_dir=None,
                progress=False,
            ) as session:
                _pairs(session, 5, args.microbatches)
                profile_costs = _pairs(session, args.iterations, args.microbatches)
            after = backend.device(0).read_state().locked_sm_freqs_mhz

    apply = _stats(apply_costs, args.instruction_s)
    report = {
        "benchmark": "hooks",
        "backend": "simulated (persisted state, journaled changes)",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "instruction_s": args.instruction_s,
        "apply_phase": {**apply, "frequency_changes_applied": changes},
        "profile_phase": _stats(profile_costs, args.instruction_s),
        "limit_us": args.limit_us,
        "device_restored": before == after,
    }
    print(json.dumps(report, indent=2))
    return 0 if apply["median_us"] < args.limit_us and before == after else 1


if __name__ == "__main__":
    sys.exit(main())
