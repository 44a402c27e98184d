"""Planner test instances shared by the direct (HiGHS) and flow solver tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from powerlib.planning.perseus.cost_model import TableCostModel
from powerlib.planning.profile import Profile

SOSP = Path("/work/shared/perseus_validation/sosp24_emulation")
REPO_PROFILES = Path(__file__).resolve().parent / "data" / "lowtime_frontiers" / "profiles"


def profile_or_skip(name: str) -> Profile:
    """The named validation profile, from the shared data or the repository's copy."""
    for folder in (SOSP, REPO_PROFILES):
        if (folder / name).exists():
            return Profile.read(folder / name)
    pytest.skip(f"{name} not available")


def random_case(rng: random.Random) -> tuple[int, list[tuple[int, int]], list[TableCostModel]]:
    """A random DAG of convex, non-increasing cost tables."""
    n = rng.randint(2, 14)
    edges = [(u, v) for v in range(n) for u in range(v) if rng.random() < 0.3]
    models = []
    for _ in range(n):
        q_min = rng.randint(1, 4)
        q_max = q_min + rng.randint(0, 6)
        # convex, non-increasing: decreasing positive slopes from q_min up
        cost, table = rng.uniform(0, 5), {}
        slopes = sorted((rng.uniform(0, 4) for _ in range(q_max - q_min)), reverse=True)
        table[q_max] = cost
        for q, slope in zip(range(q_max - 1, q_min - 1, -1), reversed(slopes)):
            cost += slope
            table[q] = cost
        models.append(TableCostModel(table))
    return n, edges, models
