"""The device check for powerlib.measure on a real GPU (NVML): counter, accuracy, overhead.

Run on a machine with an NVIDIA GPU and CUDA torch::

    POWERLIB_BACKEND=nvidia python3 benchmarks/measure_gpu.py --out measure_gpu.json

Read-only: it changes no clock and no limit. Four parts, one JSON object:

1. **counter**: NVML's energy counter read as fast as possible for 1 s idle and 1 s under a
   matmul load; how often it moved (its update period, :func:`estimate_counter_period_s`),
   and the power field next to it.
2. **accuracy**: 24 steps of bf16 matmuls (about 0.25 s each, alternating two sizes so the
   power moves) inside ``powerlib.measure`` (CUDA-aligned), with idle lead-in and tail. The
   reference is the counter read directly, 0.5 s before the measurement starts and after it
   ends, idle, plus the idle power over those margins; and the steps' summed energy against
   the whole-run energy.
3. **overhead**: ``with m.step():`` around 2 ms of queued kernels, 500 steps, ``align="cuda"``
   and ``align="host"``: per-step cost on the training thread (median, p99).
4. **alignment**: each CUDA-aligned step's length against ``torch.cuda.Event.elapsed_time``
   around the same kernels.

``--smoke`` runs a few seconds of each on the simulated backend without CUDA (CI checks the
script still runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import powerlib
from powerlib.measurement.counter_period import estimate_counter_period_s


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _counter(dev: Any, seconds: float, load: Any) -> dict[str, Any]:
    reads: list[tuple[float, float | None, float | None]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if load is not None:
            load()
        st = dev.read_state()
        reads.append((time.monotonic(), st.energy_j, st.power_w))
    intervals = [b[0] - a[0] for a, b in zip(reads, reads[1:])]
    changes = sum(1 for a, b in zip(reads, reads[1:]) if a[1] != b[1])
    est = estimate_counter_period_s(intervals, changes)
    e = [r[1] for r in reads if r[1] is not None]
    powers = [r[2] for r in reads if r[2] is not None]
    return {
        "reads": len(reads),
        "read_us_median": round(statistics.median(intervals) * 1e6, 2) if intervals else None,
        "changes": changes,
        "update_period_s": None if est is None else round(est[0], 5),
        "period_is_upper_bound": None if est is None else est[1],
        "energy_j": round(e[-1] - e[0], 4) if len(e) > 1 else None,
        "power_w_mean": round(statistics.fmean(powers), 2) if powers else None,
        "counter_power_w": round((e[-1] - e[0]) / (reads[-1][0] - reads[0][0]), 2)
        if len(e) > 1
        else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    backend = powerlib.open_backend("simulated" if args.smoke else None)
    dev = backend.devices()[0]
    out: dict[str, Any] = {
        "benchmark": "measure_gpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": dev.info.name,
        "backend": dev.info.backend,
    }
    if cuda:
        torch.cuda.set_device(0)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        small = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

        def load_big() -> None:
            torch.mm(a, a)

        def work(seconds: float, big: bool) -> None:
            x = a if big else small
            n = max(1, int(seconds / (0.0014 if big else 0.000025)))
            for _ in range(n):
                torch.mm(x, x)

        sync = torch.cuda.synchronize
        load_big()
        sync()
    else:
        a = small = None

        def load_big() -> None:
            pass

        def work(seconds: float, big: bool) -> None:
            time.sleep(seconds)

        def sync() -> None:
            pass

    # 1. the counter
    out["counter_idle"] = _counter(dev, 1.0, None)
    out["counter_load"] = _counter(dev, 1.0, load_big)
    sync()

    # 2. accuracy
    time.sleep(0.5)
    before = dev.read_state()
    time.sleep(0.5)
    with powerlib.measure([dev], backend=backend, align="cuda" if cuda else "host") as m:
        time.sleep(0.3)
        for i in range(24):
            with m.step(tokens=4096):
                work(0.25, i % 2 == 0)
        sync()
        time.sleep(0.3)
    time.sleep(0.5)
    after = dev.read_state()
    res = m.result()
    idle_w = out["counter_idle"]["power_w_mean"] or out["counter_idle"]["counter_power_w"] or 0.0
    span_s = after.timestamp_s - before.timestamp_s
    direct_j = (after.energy_j or 0.0) - (before.energy_j or 0.0)
    reference_j = direct_j - idle_w * (span_s - res.time_s)
    steps_j = sum(res.step_energy_j)
    out["accuracy"] = {
        "measured_j": round(res.energy_j, 3),
        "reference_j": round(reference_j, 3),
        "relative_error": round(res.energy_j / reference_j - 1.0, 5) if reference_j > 0 else None,
        "time_s": round(res.time_s, 4),
        "steps": res.num_steps,
        "steps_j": round(steps_j, 3),
        "step_j_median": round(statistics.median(res.step_energy_j), 3),
        "step_j_big": round(statistics.fmean(res.step_energy_j[0::2]), 3),
        "step_j_small": round(statistics.fmean(res.step_energy_j[1::2]), 3),
        "idle_w_assumed_for_margins": idle_w,
        "estimated": res.estimated,
    }

    # 3. overhead, 4. alignment
    ns = time.perf_counter_ns
    for align in ("cuda", "host") if cuda else ("host",):
        cost: list[float] = []
        gaps: list[float] = []
        with powerlib.measure([dev], backend=backend, align=align) as m:
            events = []
            for _ in range(500):
                if cuda:
                    e0, e1 = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                t0 = ns()
                w = m.step()
                w.__enter__()
                t1 = ns()
                if cuda:
                    e0.record()
                work(0.002, False)
                if cuda:
                    e1.record()
                t2 = ns()
                w.__exit__(None, None, None)
                t3 = ns()
                cost.append(((t1 - t0) + (t3 - t2)) / 1e3)
                if cuda:
                    events.append((w, e0, e1))
            sync()
        if cuda and align == "cuda":
            for w, e0, e1 in events:
                gaps.append((w.end_s - w.start_s) * 1e3 - e0.elapsed_time(e1))
            out["alignment_ms"] = {
                "step_minus_cuda_elapsed_median": round(statistics.median(gaps), 4),
                "p99_abs": round(_pct([abs(g) for g in gaps], 0.99), 4),
                "cuda_step_ms_median": round(
                    statistics.median(e0.elapsed_time(e1) for _, e0, e1 in events), 4
                ),
            }
        out[f"per_step_cost_us_{align}"] = {
            "median": round(statistics.median(cost), 3),
            "p99": round(_pct(cost, 0.99), 3),
        }
    backend.close()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
