"""powerlib's Perseus frontier against lowtime 0.3.0's, on the SOSP'24 emulation profiles.

The references in tests/data/lowtime_frontiers/ were written by
benchmarks/make_lowtime_references.py, which drives lowtime (the paper's solver) as a black box
from its own environment; these tests need neither lowtime nor /work/shared. Times and the
number of points must match exactly, energies to 1e-6 relative.

The two A40 cases (τ = 0.1 ms, 10.5k and 11.8k points) take about 20 s each with scipy's max flow
and over a minute each without it: they are marked slow, and without scipy they run only with
PLANNER_SLOW_TESTS=1.

Bloom A40's forward options are not convex (their least-squares exponential degenerates to a line,
b -> 0-), so the fit has no true optimum and lowtime's Levenberg-Marquardt stops at a different
near-linear curve than powerlib's (MSE 10.472236 vs 10.471818 on stage 0): its frontier energies
differ by up to 5.4e-6 relative, and that case is checked at 1e-5.

lowtime prunes options by strict Pareto dominance and keeps the most expensive option per time
quantum: the frontiers are computed with ``pruning="artifact"`` (powerlib's default, ``weak``,
gives other frontiers on the GPT-3 profiles; docs/perseus.md §2.1).
"""

from __future__ import annotations

import csv
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule

DATA = Path(__file__).resolve().parents[2] / "data" / "lowtime_frontiers"
PROFILES = DATA / "profiles"
NUM_STAGES = 8
REL_TOL = 1e-6
HAVE_SCIPY = importlib.util.find_spec("scipy") is not None
RUN_SLOW = HAVE_SCIPY or os.environ.get("PLANNER_SLOW_TESTS") == "1"


@dataclass(frozen=True)
class Case:
    name: str
    profile: str
    num_microbatches: int
    p_block_w: float
    unit_time_s: float
    slow: bool = False
    rel_tol: float = REL_TOL


A100 = {"p_block_w": 83.64, "unit_time_s": 0.001}
A40 = {"p_block_w": 70.38, "unit_time_s": 0.0001, "slow": True}
CASES = [
    Case("gpt3_a100_mb12", "profile_gpt3-175b_a100_sxm.csv", 12, **A100),
    Case("gpt3_a100_mb24", "profile_gpt3-175b_a100_sxm.csv", 24, **A100),
    Case("gpt3_a100_mb48", "profile_gpt3-175b_a100_sxm.csv", 48, **A100),
    Case("bloom_a100_mb12", "profile_bloom_a100_sxm.csv", 12, **A100),
    Case("bloom_a100_mb24", "profile_bloom_a100_sxm.csv", 24, **A100),
    Case("gpt3_a40_mb12", "profile_gpt3-175b_a40.csv", 12, **A40),
    # Degenerate (near-linear) forward fits: see the module docstring.
    Case("bloom_a40_mb12", "profile_bloom_a40.csv", 12, **A40, rel_tol=1e-5),
]


def read_reference(path: Path) -> list[tuple[int, int, float, float]]:
    with path.open(newline="") as f:
        return [
            (int(r["iteration"]), int(r["quant_time"]), float(r["time_s"]), float(r["energy_j"]))
            for r in csv.DictReader(f)
        ]


def params() -> list[object]:
    out = []
    for case in CASES:
        marks = []
        if case.slow:
            marks = [
                pytest.mark.slow,
                pytest.mark.skipif(
                    not RUN_SLOW, reason="slow without scipy; set PLANNER_SLOW_TESTS=1"
                ),
            ]
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


def test_every_reference_has_a_case() -> None:
    known = {case.name for case in CASES}
    present = {path.stem for path in DATA.glob("*.csv")}
    assert present <= known, f"references without a case: {sorted(present - known)}"


@pytest.mark.parametrize("case", params())
def test_matches_lowtime(case: Case) -> None:
    reference_path = DATA / f"{case.name}.csv"
    if not reference_path.exists():
        pytest.skip(f"{reference_path.name} not generated")
    reference = read_reference(reference_path)
    frontier = compute_frontier(
        Profile.read(PROFILES / case.profile),
        build_schedule("1f1b", NUM_STAGES, case.num_microbatches),
        settings=FrontierSettings(
            unit_time_s=case.unit_time_s,
            p_block_w=case.p_block_w,
            order="filter-then-subtract",
            cost_model="exp",
            pruning="artifact",  # lowtime's (the SOSP'24 artifact's) option pruning
        ),
        schedule_name="1f1b",
        num_microbatches=case.num_microbatches,
    )
    points = frontier.points
    assert len(points) == len(reference)
    mismatches = []
    for point, (iteration, quant, time_s, energy) in zip(points, reference):
        if (point.iteration, point.quant_time, point.time_s) != (iteration, quant, time_s):
            mismatches.append(
                f"iteration {iteration}: time {point.quant_time}/{point.time_s!r} "
                f"vs lowtime {quant}/{time_s!r}"
            )
        elif abs(point.energy_j - energy) > case.rel_tol * abs(energy):
            mismatches.append(
                f"iteration {iteration}: energy {point.energy_j!r} vs lowtime {energy!r} "
                f"(rel {abs(point.energy_j - energy) / abs(energy):.3g})"
            )
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:5]}"
