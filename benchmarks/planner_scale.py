"""Planner scaling: the direct solve and the walk, whole `powerlib plan` processes, side by side.

Workload: the SOSP'24 GPT-3 175B A100 emulation profile, its 8 stages repeated to N stages
(stage s uses profile stage s mod 8), synchronous 1F1B, P_block = 83.64 W, τ = 1 ms. For every
(N, M) and policy, ``powerlib plan --json`` runs as a child process and is timed from the
outside (interpreter start, profile read, schedule, solve, slowdown guard, summary): that is
``wall_s``; ``peak_mb`` is the child's peak resident set (``wait4``). The frontier walk
(``--solver walk``) runs as the reference where its work estimate fits ``--walk-budget-s``;
then ``max_rel_energy_diff`` compares the chosen points' planned energies and
``same_guard`` the guarded, replayed outcome (realized time and energy, instructions sped up).
With lowtime 0.3.0 importable (extra ``bench``), its frontier at 8 x 24 runs in a child through
``benchmarks/planner.py``'s driver, timed the same way.

Run::

    python benchmarks/planner_scale.py --out benchmarks/results/planner_scale.json
    python benchmarks/planner_scale.py --stages 16 --microbatches 256 --policies fastest

JSON on stdout (and ``--out``); progress on stderr.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROFILE_CANDIDATES = (
    Path("/work/shared/perseus_validation/sosp24_emulation/profile_gpt3-175b_a100_sxm.csv"),
    HERE.parent
    / "tests"
    / "data"
    / "lowtime_frontiers"
    / "profiles"
    / "profile_gpt3-175b_a100_sxm.csv",
)
P_BLOCK_W = 83.64
UNIT_TIME_S = 0.001


def repeated_profile(source: Path, stages: int, folder: Path) -> Path:
    """The 8-stage profile with its stages repeated to ``stages``."""
    out = folder / f"profile_{stages}.csv"
    if out.exists():
        return out
    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    base = 1 + max(int(r["stage"]) for r in rows)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for s in range(stages):
            for r in rows:
                if int(r["stage"]) == s % base:
                    w.writerow({**r, "stage": s})
    return out


def run_child(cmd: list[str], timeout_s: float) -> dict:
    """Run ``cmd``: wall time, its own peak RSS (MB, from ``wait4``), return code, output."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        deadline = started + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                return {"timed_out": True, "wall_s": time.perf_counter() - started}
            time.sleep(0.01)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {
            "rc": proc.returncode,
            "wall_s": wall,
            "peak_mb": usage.ru_maxrss / 1024,
            "out": out.read(),
            "err": err.read()[-2000:],
        }


def plan_cmd(
    profile: Path, n: int, m: int, policy: str, solver: str, deadline_s: float | None
) -> list[str]:
    """``powerlib plan --json`` for one case."""
    cmd = [sys.executable, "-m", "powerlib.cli", "plan", str(profile), "--stages", str(n)]
    cmd += ["--microbatches", str(m), "--p-block-w", str(P_BLOCK_W)]
    cmd += ["--unit-time-s", str(UNIT_TIME_S), "--policy", policy, "--solver", solver, "--json"]
    cmd += ["--max-work", str(10**15)]
    if deadline_s is not None:
        cmd += ["--deadline-s", repr(deadline_s)]
    return cmd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[12, 24, 64, 128, 256, 512])
    parser.add_argument("--policies", nargs="+", default=["fastest", "deadline", "min-energy"])
    parser.add_argument(
        "--walk-budget-s",
        type=float,
        default=60.0,
        help="run the walk reference only where its estimate is at most this (default 60 s)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per child process")
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--no-lowtime", action="store_true", help="skip lowtime even where it is installed"
    )
    args = parser.parse_args()
    source = args.profile or next((p for p in PROFILE_CANDIDATES if p.exists()), None)
    if source is None:
        sys.exit("no GPT-3 A100 profile found; pass --profile")
    sys.path.insert(0, str(HERE.parent))
    from powerlib.planning.perseus.work import estimate_pipeline_work  # noqa: PLC0415
    from powerlib.planning.profile import Profile  # noqa: PLC0415

    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.stages:
            profile = repeated_profile(source, n, Path(tmp))
            points = Profile.read(profile).option_points()
            for m in args.microbatches:
                estimate = estimate_pipeline_work(
                    points, num_stages=n, num_microbatches=m, unit_time_s=UNIT_TIME_S
                )
                for policy in args.policies:
                    case: dict = {"stages": n, "microbatches": m, "policy": policy}
                    deadline = None
                    for solver in ("direct", "walk"):
                        if solver == "walk" and estimate.time_s > args.walk_budget_s:
                            case["walk"] = {"skipped": f"estimated {estimate.describe()}"}
                            continue
                        if policy == "deadline" and deadline is None:
                            # 5 % over the all-max iteration time: a mild straggler
                            base = run_child(
                                plan_cmd(profile, n, m, "fastest", "direct", None), args.timeout_s
                            )
                            deadline = 1.05 * json.loads(base["out"])["baseline"]["own_time_s"]
                        cmd = plan_cmd(profile, n, m, policy, solver, deadline)
                        print(f"{n} x {m} {policy} {solver} ...", file=sys.stderr, flush=True)
                        got = run_child(cmd, args.timeout_s)
                        entry = {"wall_s": got["wall_s"]}
                        if got.get("timed_out") or got.get("rc"):
                            entry["failed"] = got.get("err", "timed out")
                        else:
                            data = json.loads(got["out"])
                            entry.update(
                                solve_s=data["solve_time_s"],
                                peak_mb=got["peak_mb"],
                                energy_j=data["chosen"]["energy_j"],
                                realized_time_s=data["chosen"]["realized_time_s"],
                                realized_energy_j=data["chosen"]["realized_energy_j"],
                                sped_up=data["realized"]["instructions_sped_up"],
                                saving_percent=data["realized"]["saving_percent"],
                                num_points=data["num_points"],
                            )
                        case[solver] = entry
                        print(f"  {entry.get('wall_s'):.1f} s", file=sys.stderr, flush=True)
                    d, w = case.get("direct", {}), case.get("walk", {})
                    if "energy_j" in d and "energy_j" in w:
                        case["max_rel_energy_diff"] = (
                            abs(d["energy_j"] - w["energy_j"]) / w["energy_j"]
                        )
                        case["same_guard"] = (
                            d["realized_time_s"] == w["realized_time_s"]
                            and d["realized_energy_j"] == w["realized_energy_j"]
                            and d["sped_up"] == w["sped_up"]
                        )
                        case["speedup"] = w["wall_s"] / d["wall_s"]
                    cases.append(case)
        lowtime = None
        want_lowtime = not args.no_lowtime and 8 in args.stages
        if want_lowtime and importlib.util.find_spec("lowtime") is not None:
            profile = repeated_profile(source, 8, Path(tmp))
            cmd = [sys.executable, str(HERE / "planner.py"), "--worker", "lowtime"]
            got = run_child(
                cmd + ["--profile", str(profile), "--microbatches", "24"], args.timeout_s
            )
            ours = next(
                (
                    c
                    for c in cases
                    if (c["stages"], c["microbatches"], c["policy"]) == (8, 24, "fastest")
                ),
                None,
            )
            lowtime = {"wall_s": got["wall_s"], "rc": got.get("rc")}
            if ours and "direct" in ours:
                lowtime["powerlib_direct_wall_s"] = ours["direct"]["wall_s"]
                lowtime["speedup"] = got["wall_s"] / ours["direct"]["wall_s"]
    result = {
        "benchmark": "planner_scale",
        "profile": str(source),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cases": cases,
        "lowtime_8x24": lowtime,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
