"""What ``with m.step():`` costs the training thread, and what measuring costs a loop.

Run::

    python3 benchmarks/measure_overhead.py --steps 1000 --out benchmarks/results/measure_overhead.json

The loop: ``--devices`` simulated A100s on the wall clock (in memory; ``--persisted`` keeps
their state in files, each read a locked file read and write, far slower than an NVML read),
the sampler thread reading them every 10 ms; each step starts simulated work on every device and runs a real CPU
workload of about ``--step-ms`` (a torch matmul loop, which releases the GIL like a CUDA
launch queue does, or a pure-Python loop that holds it with ``--gil``).

Two figures, measured side by side in one run:

* **per-step cost**: ``perf_counter_ns`` around the window's enter and around its exit (the
  step's body excluded), minus the cost of the timer pair itself; median and p99 in µs.
* **null window**: the same pair timed on a class that only reads the clock at both ends, in
  the unmeasured blocks: what this machine charges any code that runs between two steps (after
  a step's work the caches are cold and the core may have clocked down).
* **loop slowdown**: the same loop with and without the measurement, in alternating blocks;
  the ratio of the median step times.

Prints one JSON object. Exits 1 if the median per-step cost is not below ``--limit-us`` (20).
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

import powerlib
from powerlib.backends.simulated import SimulatedBackend
from powerlib.backends.simulated_model import WorkUnit
from powerlib.config import Settings


def _work(step_s: float, gil: bool) -> None:
    if gil:
        end = time.perf_counter() + step_s
        x = 0
        while time.perf_counter() < end:
            x += 1
        return
    import torch

    torch.set_num_threads(1)  # a GPU job's host thread launches; it does not spin a CPU pool
    a = torch.ones(128, 128)
    end = time.perf_counter() + step_s
    while time.perf_counter() < end:
        a = (a @ a) * 1e-3


class _Null:
    """The least a timestamping window can do: read the clock at both ends, keep the pair."""

    def __init__(self) -> None:
        self.log: list[tuple[float, float]] = []

    def __enter__(self) -> _Null:
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.append((self.t0, time.monotonic()))


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--gil", action="store_true", help="a step that holds the GIL")
    ap.add_argument(
        "--persisted",
        action="store_true",
        help="devices keep state in files (what the CLI sees; each read costs ~1 ms)",
    )
    ap.add_argument("--limit-us", type=float, default=20.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    step_s = args.step_ms / 1e3

    with tempfile.TemporaryDirectory() as state:
        backend = SimulatedBackend(
            Settings(state_dir=Path(state), sim_gpus=args.devices), persist=args.persisted
        )
        devices = backend.devices()
        work = WorkUnit(time_at_max_s=1.0, sm_activity=0.9)

        def body() -> None:
            for d in devices:
                d.begin_work(work)
            _work(step_s, args.gil)
            for d in devices:
                d.end_work()

        ns = time.perf_counter_ns
        timer = []
        for _ in range(2000):
            a = ns()
            b = ns()
            timer.append(b - a)
        timer_ns = statistics.median(timer)

        cost_us: list[float] = []
        with_s: list[float] = []
        without_s: list[float] = []
        null_us: list[float] = []
        null = _Null()
        block = 50
        with powerlib.measure(backend=backend) as m:
            for start in range(0, args.steps, block):
                for _ in range(block):  # measured steps
                    t0 = ns()
                    w = m.step(tokens=4096)
                    w.__enter__()
                    t1 = ns()
                    body()
                    t2 = ns()
                    w.__exit__(None, None, None)
                    t3 = ns()
                    cost_us.append(((t1 - t0) + (t3 - t2) - 2 * timer_ns) / 1e3)
                    with_s.append((t3 - t0) / 1e9)
                for _ in range(block):  # the same steps, unmeasured (the sampler still runs)
                    t0 = ns()
                    null.__enter__()
                    t1 = ns()
                    body()
                    t2 = ns()
                    null.__exit__(None, None, None)
                    t3 = ns()
                    null_us.append(((t1 - t0) + (t3 - t2) - 2 * timer_ns) / 1e3)
                    without_s.append((t3 - t0) / 1e9)
                del start
        samples = m.result().devices[0].samples
        result = m.result()
        backend.close()

    med, p99 = statistics.median(cost_us), _pct(cost_us, 0.99)
    out = {
        "benchmark": "measure_overhead",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "devices": args.devices,
        "steps": args.steps,
        "step_ms": args.step_ms,
        "step_holds_gil": args.gil,
        "persisted_devices": args.persisted,
        "sample_period_s": m.sample_period_s,
        "samples_per_device": samples,
        "per_step_cost_us": {
            "median": round(med, 3),
            "p99": round(p99, 3),
            "max": round(max(cost_us), 3),
        },
        # The same enter/exit measured on a class that only reads the clock twice: what the
        # machine charges any code run between two steps (cold caches after the step's work).
        "null_window_cost_us": {
            "median": round(statistics.median(null_us), 3),
            "p99": round(_pct(null_us, 0.99), 3),
        },
        "step_time_ms": {
            "measured_median": round(statistics.median(with_s) * 1e3, 4),
            "unmeasured_median": round(statistics.median(without_s) * 1e3, 4),
            "ratio": round(statistics.median(with_s) / statistics.median(without_s), 5),
        },
        "energy_per_step_j": round(result.energy_per_step_j or 0.0, 4),
        "limit_us": args.limit_us,
        "ok": med < args.limit_us,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
