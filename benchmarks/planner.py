"""Perseus planner benchmark: powerlib against lowtime 0.3.0, side by side, on the same inputs.

Workload: the SOSP'24 GPT-3 175B emulation profile on A100 (8 stages, synchronous 1F1B,
P_block = 83.64 W, τ = 1 ms, filter-then-subtract order, exponential fit), at M = 12, 24, 48
and 96 microbatches. For every M the frontier is computed by powerlib and, when ``lowtime`` is
importable in this interpreter (extra ``bench``), by lowtime through the same driver as
``benchmarks/make_lowtime_references.py``; the two frontiers are then compared point by point.

Each solve runs in a fresh child process (this script with ``--worker``), so that one case's
memory and caches do not leak into the next. Reported per solver:

* ``wall_s``: the solve, from the profile (already parsed) to the last frontier point: option
  filtering, cost fits, DAG construction and every Phillips-Dessouky step;
* ``peak_mb``: with ``--memory rss`` (default), the child's peak resident set size during the
  solve (``VmHWM``, reset through ``/proc/self/clear_refs`` just before; ``ru_maxrss`` where that
  is unavailable) minus its resident size just before the solve, which counts native allocations
  too (lowtime's Rust min cut, scipy); with ``--memory tracemalloc``,
  ``tracemalloc``'s peak of Python and numpy allocations during the solve, which misses
  lowtime's Rust heap and slows Python code down, so ``wall_s`` is then inflated.

Per case: ``max_rel_energy_diff`` (largest ``|E_powerlib - E_lowtime| / |E_lowtime|`` over the
points), ``identical_times`` (same point count and exactly equal ``quant_time`` and ``time_s``)
and ``speedup`` (lowtime wall time / powerlib wall time). lowtime fields are null when it is not
installed or M is above ``--lowtime-max-m`` (lowtime needs 20-40 min at M = 96).

Run::

    pip install -e '.[bench,fast]'            # bench: lowtime==0.3.0; fast: scipy
    python benchmarks/planner.py --out planner_bench.json
    python benchmarks/planner.py --microbatches 12 24 --lowtime-max-m 24
    python benchmarks/planner.py --memory tracemalloc

or with lowtime in a separate venv that can import powerlib::

    PYTHONPATH=. /path/to/venv/bin/python benchmarks/planner.py --out /tmp/planner_bench.json

The JSON goes to stdout and, with ``--out``, to a file; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROFILE_CANDIDATES = (
    Path("/work/shared/perseus_validation/sosp24_emulation/profile_gpt3-175b_a100_sxm.csv"),
    REPO / "tests" / "data" / "lowtime_frontiers" / "profiles" / "profile_gpt3-175b_a100_sxm.csv",
)
NUM_STAGES = 8
P_BLOCK_W = 83.64
UNIT_TIME_S = 0.001


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last reset (or since it started)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _solve_powerlib(profile_path: Path, m: int):
    from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier
    from powerlib.planning.profile import Profile
    from powerlib.planning.schedules import build_schedule

    profile = Profile.read(profile_path)
    schedule = build_schedule("1f1b", NUM_STAGES, m)
    if importlib.util.find_spec("scipy") is not None:  # imported lazily by the max flow
        import scipy.sparse.csgraph  # noqa: F401

    def run() -> list[tuple[int, float, float]]:
        frontier = compute_frontier(
            profile,
            schedule,
            settings=FrontierSettings(
                unit_time_s=UNIT_TIME_S,
                p_block_w=P_BLOCK_W,
                order="filter-then-subtract",
                cost_model="exp",
            ),
            schedule_name="1f1b",
            num_microbatches=m,
        )
        return [(p.quant_time, p.time_s, p.energy_j) for p in frontier.points]

    return run


def _solve_lowtime(profile_path: Path, m: int):
    sys.path.insert(0, str(HERE))
    import lowtime.cost_model  # noqa: F401  (imported inside build_dag: not in the measurement)
    import lowtime.graph_utils  # noqa: F401
    import lowtime.perseus.schedule  # noqa: F401
    import make_lowtime_references as ref
    import networkx  # noqa: F401
    from lowtime.solver import PhillipsDessouky

    def run() -> list[tuple[int, float, float]]:
        dag = ref.build_dag(profile_path, NUM_STAGES, m, P_BLOCK_W, UNIT_TIME_S)
        n_block = NUM_STAGES * P_BLOCK_W
        return [
            (int(r.quant_time), float(r.real_time), float(r.cost + n_block * r.real_time))
            for r in PhillipsDessouky(dag).run()
        ]

    return run


def worker(solver: str, profile_path: Path, m: int, memory: str) -> None:
    """Solve one case in this (fresh) process and print the result as JSON."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # lowtime's fit overflows exp()
    warnings.filterwarnings("ignore", message="Covariance of the parameters could not be estimated")
    run = (_solve_powerlib if solver == "powerlib" else _solve_lowtime)(profile_path, m)
    if memory == "tracemalloc":
        tracemalloc.start()
        start = time.perf_counter()
        points = run()
        wall = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    else:
        _reset_peak_rss()
        before = _rss_bytes()
        start = time.perf_counter()
        points = run()
        wall = time.perf_counter() - start
        peak = _peak_rss_bytes() - before
    json.dump({"wall_s": wall, "peak_mb": peak / 2**20, "points": points}, sys.stdout)


def run_child(solver: str, profile_path: Path, m: int, memory: str) -> dict:
    """Run :func:`worker` in a child process of this interpreter."""
    cmd = [sys.executable, __file__, "--worker", solver, "--profile", str(profile_path)]
    cmd += ["--microbatches", str(m), "--memory", memory]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{solver} M={m} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def compare(ours: list, theirs: list) -> tuple[float | None, bool]:
    """Largest relative energy difference over common points, and whether all times match."""
    identical = len(ours) == len(theirs) and all(
        a[0] == b[0] and a[1] == b[1] for a, b in zip(ours, theirs)
    )
    if not ours or not theirs:
        return None, identical
    max_rel = max(abs(a[2] - b[2]) / abs(b[2]) for a, b in zip(ours, theirs))
    return max_rel, identical


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument(
        "--lowtime-max-m",
        type=int,
        default=48,
        help="skip lowtime above this M (it takes 20-40 min at M=96); default 48",
    )
    parser.add_argument("--memory", choices=("rss", "tracemalloc"), default="rss")
    parser.add_argument("--profile", type=Path, help="profile CSV (default: GPT-3 175B A100)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--worker", choices=("powerlib", "lowtime"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    profile_path = args.profile or next((p for p in PROFILE_CANDIDATES if p.exists()), None)
    if profile_path is None:
        parser.error("no GPT-3 175B A100 profile found; pass --profile")
    if args.worker:
        worker(args.worker, profile_path, args.microbatches[0], args.memory)
        return

    have_lowtime = importlib.util.find_spec("lowtime") is not None
    lowtime_version = None
    if have_lowtime:
        from importlib.metadata import version

        lowtime_version = version("lowtime")
    have_scipy = importlib.util.find_spec("scipy") is not None
    cases = []
    for m in args.microbatches:
        print(f"M={m}: powerlib ...", file=sys.stderr, flush=True)
        ours = run_child("powerlib", profile_path, m, args.memory)
        print(
            f"M={m}: powerlib {len(ours['points'])} points in {ours['wall_s']:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        case = {
            "M": m,
            "instructions": 2 * NUM_STAGES * m,
            "points": len(ours["points"]),
            "powerlib_wall_s": round(ours["wall_s"], 3),
            "powerlib_peak_mb": round(ours["peak_mb"], 2),
            "lowtime_wall_s": None,
            "lowtime_peak_mb": None,
            "lowtime_points": None,
            "max_rel_energy_diff": None,
            "identical_times": None,
            "speedup": None,
        }
        if have_lowtime and m <= args.lowtime_max_m:
            print(f"M={m}: lowtime ...", file=sys.stderr, flush=True)
            theirs = run_child("lowtime", profile_path, m, args.memory)
            print(
                f"M={m}: lowtime {len(theirs['points'])} points in {theirs['wall_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
            max_rel, identical = compare(ours["points"], theirs["points"])
            case.update(
                lowtime_wall_s=round(theirs["wall_s"], 3),
                lowtime_peak_mb=round(theirs["peak_mb"], 2),
                lowtime_points=len(theirs["points"]),
                max_rel_energy_diff=max_rel,
                identical_times=identical,
                speedup=round(theirs["wall_s"] / ours["wall_s"], 2),
            )
        cases.append(case)

    report = {
        "workload": {
            "profile": str(profile_path),
            "num_stages": NUM_STAGES,
            "schedule": "1f1b",
            "p_block_w": P_BLOCK_W,
            "unit_time_s": UNIT_TIME_S,
            "order": "filter-then-subtract",
            "cost_model": "exp",
        },
        "environment": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "scipy": have_scipy,
            "lowtime": lowtime_version,
            "memory_method": (
                "peak RSS growth during the solve (VmHWM reset before; minus RSS before), fresh process per solve"
                if args.memory == "rss"
                else "tracemalloc peak during the solve (Python/numpy heap only)"
            ),
        },
        "cases": cases,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
