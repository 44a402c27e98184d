"""The slowdown guard's plans against the greedy it replaced (issue 34), case by case.

For each SOSP'24 emulation profile (GPT-3 175B and BLOOM on A100 and A40), 8 stages x
``--microbatches``, 1F1B, τ = 1 ms, P_block = 83.64 W, policies ``fastest`` and ``deadline``
(5 % over all-max), clock-change latency 0 / 5 / 20 ms and run-to-run noise 0 / 2 %, three plans
are guarded from the same frontier:

* ``greedy``: the guard before issue 34 (from the quantized point, one speed-up per replay);
* ``exact``: the issue-34 exact-time flow start alone (what runs above
  ``guard.BOTH_STARTS_MAX_NODES`` instructions);
* ``guard``: what ships (both starts at this size, the cheaper wins).

Energies are replayed on the measured profile with the latency; for ``deadline`` the iteration
is held until the deadline (``guard.held_energy_j``: the straggler sets its length). Reported per
case: each plan's energy relative to the greedy's, and whether it realizes within the limit.
Needs the compiled flow extension. JSON on stdout and with ``--out``; progress on stderr.

Run::

    python benchmarks/guard_quality.py --out benchmarks/results/guard_quality.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from powerlib.planning.choice import Policy  # noqa: E402
from powerlib.planning.perseus import guard  # noqa: E402
from powerlib.planning.profile import Profile  # noqa: E402
from powerlib.planning.workflow import PlanRequest, plan_profile, wanted_for  # noqa: E402

PROFILES = (
    "profile_gpt3-175b_a100_sxm.csv",
    "profile_bloom_a40.csv",
    "profile_gpt3-175b_a40.csv",
    "profile_bloom_a100_sxm.csv",
)
FOLDERS = (
    Path("/work/shared/perseus_validation/sosp24_emulation"),
    HERE.parent / "tests" / "data" / "lowtime_frontiers" / "profiles",
)
P_BLOCK_W = 83.64
MAX_SLOWDOWN = 0.001


def one_case(profile: Profile, m: int, policy: str, latency: float, cv: float) -> dict:
    """The three guarded plans of one case."""
    fastest = plan_profile(
        profile,
        PlanRequest(
            num_stages=8,
            num_microbatches=m,
            p_block_w=P_BLOCK_W,
            unit_time_s=1e-3,
            policy="fastest",
            solver="direct",
        ),
    ).frontier
    deadline = None
    frontier = fastest
    if policy == "deadline":  # the same model, one more point
        deadline = fastest.baseline_time_s * 1.05
        frontier = fastest.extend(wanted_for(Policy(name="deadline", deadline_s=deadline)))
    point = frontier.select(policy, deadline)
    reference_s = frontier.baseline_time_s if deadline is None else deadline
    limit = guard.guard_limit(reference_s, MAX_SLOWDOWN)
    noisy = guard._NoiseCheck(frontier.model, cv, 0.0, deadline, MAX_SLOWDOWN) if cv > 0 else None
    plans = {}
    started = time.perf_counter()
    plans["greedy"] = guard._speed_up(
        frontier.model, frontier.planned_options(point), limit, latency, noisy, batch=False
    )
    saved = guard.BOTH_STARTS_MAX_NODES
    try:
        guard.BOTH_STARTS_MAX_NODES = 0
        plans["exact"] = frontier.within_slowdown(
            point, MAX_SLOWDOWN, switch_latency_s=latency, limit_s=deadline, time_cv=cv
        )
    finally:
        guard.BOTH_STARTS_MAX_NODES = saved
    plans["guard"] = frontier.within_slowdown(
        point, MAX_SLOWDOWN, switch_latency_s=latency, limit_s=deadline, time_cv=cv
    )
    base = guard.held_energy_j(frontier.model, plans["greedy"], latency, deadline)
    out: dict = {"wall_s": time.perf_counter() - started}
    for name, chosen in plans.items():
        run = frontier.realized(chosen, latency)
        out[name] = {
            "rel_energy_vs_greedy": guard.held_energy_j(frontier.model, chosen, latency, deadline)
            / base
            - 1.0,
            "within_limit": run.time_s <= limit * (1 + 1e-12),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 12, 24])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not guard.available():
        sys.exit("the compiled min-cost flow extension is not built")
    cases = []
    grid = itertools.product(
        PROFILES, args.microbatches, ("fastest", "deadline"), (0.0, 0.005, 0.02), (0.0, 0.02)
    )
    for name, m, policy, latency, cv in grid:
        path = next((f / name for f in FOLDERS if (f / name).exists()), None)
        if path is None:
            print(f"{name}: not found, skipped", file=sys.stderr)
            continue
        got = one_case(Profile.read(path), m, policy, latency, cv)
        got.update(profile=name, microbatches=m, policy=policy, latency_s=latency, time_cv=cv)
        cases.append(got)
        print(
            f"{name} 8x{m} {policy} {latency} {cv}: exact "
            f"{got['exact']['rel_energy_vs_greedy']:+.2e} guard "
            f"{got['guard']['rel_energy_vs_greedy']:+.2e}",
            file=sys.stderr,
            flush=True,
        )
    exact = [c["exact"]["rel_energy_vs_greedy"] for c in cases]
    shipped = [c["guard"]["rel_energy_vs_greedy"] for c in cases]
    result = {
        "benchmark": "guard_quality",
        "python": platform.python_version(),
        "cases": cases,
        "summary": {
            "cases": len(cases),
            "all_within_limit": all(
                c[k]["within_limit"] for c in cases for k in ("greedy", "exact", "guard")
            ),
            "exact_median_rel": statistics.median(exact) if exact else None,
            "exact_best_rel": min(exact, default=None),
            "exact_worst_rel": max(exact, default=None),
            "exact_worse_than_1e-6": sum(r > 1e-6 for r in exact),
            "guard_worst_rel": max(shipped, default=None),
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
