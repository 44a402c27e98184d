"""Planner scaling: the flow solve, HiGHS and the walk, whole `powerlib plan` processes, side by side.

Workload: the SOSP'24 GPT-3 175B A100 emulation profile, its 8 stages repeated to N stages
(stage s uses profile stage s mod 8), synchronous 1F1B, P_block = 83.64 W, τ = 1 ms, the CLI's
default 5 ms switch latency. For every N x M case and policy, ``powerlib plan --json`` runs as a
child process and is timed from the outside (interpreter start, profile read, schedule, solve,
slowdown guard, summary): that is ``wall_s``; ``peak_mb`` is the child's peak resident set
(``wait4``). powerlib's bytecode is compiled first, as an installed package has it. Solvers, each in its own child:

* ``flow``: ``--solver direct`` with the compiled min-cost flow (the default install);
* ``highs``: the same with ``POWERLIB_DIRECT_SOLVER=highs`` (needs extra ``fast``), up to
  ``--highs-max-instructions``;
* ``walk``: ``--solver walk``, where its work estimate fits ``--walk-budget-s``.

Per case, ``max_rel_cost_diff`` is the largest relative difference of the chosen point's planned
energy between flow and each reference (HiGHS, the walk): the same optimum. Where the walk runs,
``guard`` compares in this process the issue-34 guard (exact-time flow start) with the greedy
it replaced (one speed-up per replay from the quantized point): realized energy and time, both
replayed with the latency (for ``deadline``, the energy of an iteration held until the deadline:
the straggler sets its length). With lowtime 0.3.0 importable (extra ``bench``), its frontier at
8 x 24 runs in a child through ``benchmarks/planner.py``'s driver, timed the same way.

Run (in an environment with extras ``bench`` and ``fast``)::

    python benchmarks/planner_scale.py --out benchmarks/results/planner_scale.json
    python benchmarks/planner_scale.py --cases 16x256 --policies fastest

JSON on stdout (and ``--out``); progress on stderr.
"""

from __future__ import annotations

import argparse
import compileall
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


def run_child(cmd: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """Run ``cmd``: wall time, its own peak RSS (MB, from ``wait4``), return code, output."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
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
    """``powerlib plan --json`` for one case (``solver``: ``direct`` or ``walk``)."""
    cmd = [sys.executable, "-m", "powerlib.cli", "plan", str(profile), "--stages", str(n)]
    cmd += ["--microbatches", str(m), "--p-block-w", str(P_BLOCK_W)]
    cmd += ["--unit-time-s", str(UNIT_TIME_S), "--policy", policy, "--solver", solver, "--json"]
    cmd += ["--max-work", str(10**15)]
    if deadline_s is not None:
        cmd += ["--deadline-s", repr(deadline_s)]
    return cmd


def guard_check(profile: Path, n: int, m: int, policy: str, deadline_s: float | None) -> dict:
    """The guard against the greedy it replaced, on one case, in this process."""
    from powerlib.planning.choice import Policy
    from powerlib.planning.perseus import guard
    from powerlib.planning.profile import Profile
    from powerlib.planning.workflow import PlanRequest, plan_profile

    pol = Policy(name=policy, deadline_s=deadline_s)
    frontier = plan_profile(
        Profile.read(profile),
        PlanRequest(
            num_stages=n,
            num_microbatches=m,
            p_block_w=P_BLOCK_W,
            unit_time_s=UNIT_TIME_S,
            policy=policy,
            deadline_s=deadline_s,
            solver="direct",
            max_work=None,
        ),
    ).frontier
    point = frontier.select(policy, deadline_s)
    reference_s = frontier.baseline_time_s if deadline_s is None else deadline_s
    limit = guard.guard_limit(reference_s, pol.max_slowdown)
    lat = pol.switch_latency_s
    started = time.perf_counter()
    ours = frontier.within_slowdown(
        point, pol.max_slowdown, switch_latency_s=lat, limit_s=deadline_s
    )
    guard_s = time.perf_counter() - started
    started = time.perf_counter()
    start = frontier.planned_options(point)
    greedy = guard._speed_up(frontier.model, start, limit, lat, None, batch=False)
    greedy_s = time.perf_counter() - started
    a, b = frontier.realized(ours, lat), frontier.realized(greedy, lat)
    # under a straggler (deadline) the iteration lasts the deadline whatever the plan
    ea = guard.held_energy_j(frontier.model, ours, lat, deadline_s)
    eb = guard.held_energy_j(frontier.model, greedy, lat, deadline_s)
    return {
        "limit_s": limit,
        "guard": {"time_s": a.time_s, "energy_j": ea, "wall_s": guard_s},
        "greedy": {"time_s": b.time_s, "energy_j": eb, "wall_s": greedy_s},
        "rel_energy_vs_greedy": ea / eb - 1.0,
        "within_limit": a.time_s <= limit * (1 + 1e-12),
    }


def parse_case(text: str) -> tuple[int, int]:
    """``NxM`` -> (N, M)."""
    n, _, m = text.lower().partition("x")
    return int(n), int(m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", nargs="+", default=["8x24", "16x24", "8x256", "16x256", "32x512", "64x1024"]
    )
    parser.add_argument("--policies", nargs="+", default=["fastest", "deadline", "min-energy"])
    parser.add_argument(
        "--walk-budget-s",
        type=float,
        default=60.0,
        help="run the walk reference only where its estimate is at most this (default 60 s)",
    )
    parser.add_argument(
        "--highs-max-instructions",
        type=int,
        default=40_000,
        help="run HiGHS only up to this many instructions (default 40000: to 32 x 512)",
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per child process")
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
    from powerlib.planning.perseus.work import estimate_pipeline_work
    from powerlib.planning.profile import Profile

    # Bytecode first, as any installed package has it (pip compiles at install; lowtime is a
    # wheel): an editable checkout under PYTHONDONTWRITEBYTECODE=1 would otherwise compile every
    # powerlib module in every child (about 45 ms of an 8 x 24 plan).
    compileall.compile_dir(str(HERE.parent / "powerlib"), quiet=1)
    have_highs = importlib.util.find_spec("highspy") is not None
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, m in map(parse_case, args.cases):
            profile = repeated_profile(source, n, Path(tmp))
            points = Profile.read(profile).option_points()
            estimate = estimate_pipeline_work(
                points, num_stages=n, num_microbatches=m, unit_time_s=UNIT_TIME_S
            )
            for policy in args.policies:
                case: dict = {"stages": n, "microbatches": m, "policy": policy}
                deadline = None
                if policy == "deadline":
                    # 5 % over the all-max iteration time: a mild straggler
                    base = run_child(
                        plan_cmd(profile, n, m, "fastest", "direct", None), args.timeout_s
                    )
                    deadline = 1.05 * json.loads(base["out"])["baseline"]["own_time_s"]
                for solver in ("flow", "highs", "walk"):
                    env = dict(os.environ)
                    if solver == "walk" and estimate.time_s > args.walk_budget_s:
                        case[solver] = {"skipped": f"estimated {estimate.describe()}"}
                        continue
                    if solver == "highs":
                        if not have_highs:
                            case[solver] = {"skipped": "highspy not installed (extra fast)"}
                            continue
                        if n * m * 2 > args.highs_max_instructions:
                            case[solver] = {"skipped": "past --highs-max-instructions"}
                            continue
                        env["POWERLIB_DIRECT_SOLVER"] = "highs"
                    cmd = plan_cmd(
                        profile, n, m, policy, "walk" if solver == "walk" else "direct", deadline
                    )
                    print(f"{n} x {m} {policy} {solver} ...", file=sys.stderr, flush=True)
                    got = run_child(cmd, args.timeout_s, env)
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
                            sped_up=data["replay"]["instructions_sped_up"],
                            saving_percent=data["saving_percent"],
                            num_points=data["num_points"],
                        )
                    case[solver] = entry
                    print(f"  {entry.get('wall_s'):.1f} s", file=sys.stderr, flush=True)
                flow = case.get("flow", {})
                diffs = [
                    abs(flow["energy_j"] - ref["energy_j"]) / ref["energy_j"]
                    for ref in (case.get("highs", {}), case.get("walk", {}))
                    if "energy_j" in ref and "energy_j" in flow
                ]
                if diffs:
                    case["max_rel_cost_diff"] = max(diffs)
                for ref in ("highs", "walk"):
                    if "wall_s" in case.get(ref, {}) and "energy_j" in flow:
                        case[f"speedup_vs_{ref}"] = case[ref]["wall_s"] / flow["wall_s"]
                if "energy_j" in case.get("walk", {}) and policy != "min-energy":
                    case["guard"] = guard_check(profile, n, m, policy, deadline)
                cases.append(case)
        lowtime = None
        want_lowtime = not args.no_lowtime and (8, 24) in map(parse_case, args.cases)
        if want_lowtime and importlib.util.find_spec("lowtime") is not None:
            profile = repeated_profile(source, 8, Path(tmp))
            cmd = [sys.executable, str(HERE / "planner.py"), "--worker", "lowtime"]
            print("8 x 24 lowtime ...", file=sys.stderr, flush=True)
            got = run_child(
                cmd + ["--profile", str(profile), "--microbatches", "24"], args.timeout_s
            )
            # ours right after, on the same machine state: the median of five (a 0.3 s process
            # varies by 15 % from run to run here; lowtime's 30 s by far less)
            ours = sorted(
                run_child(plan_cmd(profile, 8, 24, "fastest", "direct", None), args.timeout_s)[
                    "wall_s"
                ]
                for _ in range(5)
            )
            lowtime = {
                "wall_s": got["wall_s"],
                "rc": got.get("rc"),
                "powerlib_flow_wall_s": ours[2],
                "powerlib_flow_runs_s": ours,
                "speedup": got["wall_s"] / ours[2],
            }
    result = {
        "benchmark": "planner_scale",
        "profile": str(source),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "switch_latency_s": 0.005,
        "cases": cases,
        "lowtime_8x24": lowtime,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
